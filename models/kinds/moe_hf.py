"""Hugging Face names of a "moe" layer (models/kinds/moe.py), in the layouts HF checkpoints use.

tpzoo stacks the experts (`ours` e.g. "layers.3.mlp"): router.weight [E, h] (+ router.bias, the selection bias
router.e_score_correction_bias), gate_up [E, 2 ffn, h] (gate|up of each expert), down [E, h, ffn], gpt-oss's
gate_up_bias [E, 2 ffn] and down_bias [E, h]; the shared experts as a gated MLP `shared_experts.fc_in / fc_out`
(+ Qwen's `shared_expert_gate.weight` [1, h]). The stacked dim 0 is what expert parallelism splits.
Layouts (`theirs` is the HF layer, e.g. "model.layers.3."), each expert stored on its own unless said:
    "separate"  (the default: Qwen3-MoE, OLMoE, Qwen3.5-MoE, Qwen3-Next) mlp.gate.weight,
                mlp.experts.{e}.{gate,up,down}_proj; shared experts mlp.shared_expert.{gate,up,down}_proj and
                mlp.shared_expert_gate
    "mixtral"   block_sparse_moe.gate.weight, block_sparse_moe.experts.{e}.w1 (gate) / w3 (up) / w2 (down)
    "minimax"   (MiniMax-M2) as "mixtral" plus the selection bias block_sparse_moe.e_score_correction_bias
    "deepseek"  (DeepSeek-V3, GLM-4.5) as "separate" plus mlp.gate.e_score_correction_bias; shared experts
                mlp.shared_experts.{gate,up,down}_proj, no gate
    "kimi"      (Kimi Linear) "deepseek"'s tensors under "mixtral"'s names: block_sparse_moe.gate.weight,
                block_sparse_moe.gate.e_score_correction_bias, block_sparse_moe.experts.{e}.w1 / w3 / w2,
                block_sparse_moe.shared_experts.{gate,up,down}_proj
    "stacked"   (Mistral Small 4: transformers 5's own fused experts) mlp.gate.weight, the experts stacked as tpzoo
                stacks them: mlp.experts.gate_up_proj [E, 2 ffn, h] (gate then up), mlp.experts.down_proj [E, h, ffn];
                shared experts mlp.shared_experts.{gate,up,down}_proj
    "gpt_oss"   mlp.router.weight / .bias; the experts stacked as x @ W with gate and up interleaved
                (models/hf_experts.py): mlp.experts.gate_up_proj [E, h, 2f], gate_up_proj_bias, down_proj [E, f, h],
                down_proj_bias: permutations and transposes, bit-exact both ways
"""
from __future__ import annotations

import torch

from ..config import ModelConfig
from ..hf_experts import halves_to_interleaved, interleaved_to_halves
from ..hf_mapping import PeftParam, TensorMap, same
from .mlp_hf import gated_mlp_maps

STYLES = ("separate", "mixtral", "minimax", "deepseek", "kimi", "stacked", "gpt_oss")
MIXTRAL_NAMES = ("mixtral", "minimax", "kimi")  # block_sparse_moe, experts' w1 / w3 / w2


def stacked_gate_up(name: str, gates: list[str], ups: list[str], ffn: int, **kw) -> TensorMap:
    """Per-expert gate and up [ffn, h] <-> one [E, 2 ffn, h] (expert e: rows gate then up)."""
    hf = tuple(n for pair in zip(gates, ups) for n in pair)

    def to_tpzoo(ts):
        return torch.stack([torch.cat(ts[2 * e: 2 * e + 2], dim=0) for e in range(len(gates))])

    def to_hf(x):
        return [part.clone() for e in range(x.shape[0]) for part in x[e].split([ffn, ffn], dim=0)]

    return TensorMap(name, hf, to_tpzoo, to_hf, **kw)


def stacked(name: str, hfs: list[str], **kw) -> TensorMap:
    """Per-expert [out, in] <-> one [E, out, in]."""
    return TensorMap(name, tuple(hfs), lambda ts: torch.stack(list(ts)), lambda x: [t.clone() for t in x.unbind(0)],
                     **kw)


def _peft(theirs: str, name: str, **kw) -> PeftParam:
    """transformers 5 holds every family's routed experts fused as `mlp.experts.gate_up_proj` [E, 2f, h] (gate
    rows, then up) and `mlp.experts.down_proj` [E, h, f] (gpt-oss: transposed, gate|up interleaved), whatever the
    checkpoint stores (Mixtral's block_sparse_moe.experts.{e}.w1 ...): what PEFT's target_parameters name."""
    return PeftParam(f"{theirs}mlp.experts.{name}", **kw)


def _per_expert(cfg: ModelConfig, layer: int, ours: str, theirs: str, block: str,
                names: tuple[str, str, str]) -> list:
    """The router `block`.gate and experts `block`.experts.{e}.{gate, up, down} stored one by one."""
    experts = [f"{block}.experts.{e}." for e in range(cfg.moe.num_experts)]
    gate, up, down = ([x + n + ".weight" for x in experts] for n in names)
    return [same(f"{ours}.router.weight", f"{block}.gate.weight", layer=layer),
            stacked_gate_up(f"{ours}.gate_up", gate, up, cfg.expert_ffn, layer=layer,
                            peft=_peft(theirs, "gate_up_proj")),
            stacked(f"{ours}.down", down, layer=layer, peft=_peft(theirs, "down_proj"))]


def _gpt_oss(ours: str, theirs: str, block: str, layer: int) -> list:
    def experts(name: str, hf: str, to_tpzoo, to_hf, **kw) -> TensorMap:
        return TensorMap(name, (hf,), lambda ts: to_tpzoo(ts[0]).contiguous(), lambda x: [to_hf(x).contiguous()],
                         layer=layer, **kw)

    e = block + ".experts."
    # an adapter's B [E, 2f, r] in halves <-> gate|up interleaved, as gate_up_proj's columns
    interleaved = _peft(theirs, "gate_up_proj", out_to_hf=lambda t: halves_to_interleaved(t, 1),
                        out_from_hf=lambda t: interleaved_to_halves(t, 1))
    return [same(f"{ours}.router.weight", f"{block}.router.weight", layer=layer),
            same(f"{ours}.router.bias", f"{block}.router.bias", layer=layer),
            # [E, h, 2f] gate/up interleaved <-> [E, 2f, h] halves (and the bias likewise)
            experts(f"{ours}.gate_up", e + "gate_up_proj", lambda t: interleaved_to_halves(t, -1).transpose(1, 2),
                    lambda x: halves_to_interleaved(x.transpose(1, 2), -1), peft=interleaved),
            experts(f"{ours}.gate_up_bias", e + "gate_up_proj_bias", lambda t: interleaved_to_halves(t, -1),
                    lambda x: halves_to_interleaved(x, -1)),
            experts(f"{ours}.down", e + "down_proj", lambda t: t.transpose(1, 2), lambda x: x.transpose(1, 2),
                    peft=_peft(theirs, "down_proj")),
            same(f"{ours}.down_bias", e + "down_proj_bias", layer=layer)]


def hf_tensor_maps(cfg: ModelConfig, layer: int, ours: str, theirs: str, style: str | None = None) -> list:
    """The TensorMaps of layer `layer`'s mixture of experts: tpzoo names under `ours`, HF names in the HF layer
    `theirs`."""
    style, moe = style or "separate", cfg.moe
    block = theirs + ("block_sparse_moe" if style in MIXTRAL_NAMES else "mlp")
    if style == "gpt_oss":
        return _gpt_oss(ours, theirs, block, layer)
    if style not in STYLES:
        raise ValueError(f"unknown mixture-of-experts HF layout {style!r}; one of {STYLES}")
    if style == "stacked":  # transformers 5's own in-memory names: PEFT's target_parameters are the same tensors
        maps = [same(f"{ours}.router.weight", f"{block}.gate.weight", layer=layer),
                same(f"{ours}.gate_up", f"{block}.experts.gate_up_proj", layer=layer,
                     peft=_peft(theirs, "gate_up_proj")),
                same(f"{ours}.down", f"{block}.experts.down_proj", layer=layer, peft=_peft(theirs, "down_proj"))]
    else:
        maps = _per_expert(cfg, layer, ours, theirs, block, ("w1", "w3", "w2") if style in MIXTRAL_NAMES else
                           ("gate_proj", "up_proj", "down_proj"))
    if style in ("deepseek", "minimax", "kimi"):  # the sigmoid router's selection bias
        bias = f"{block}.e_score_correction_bias" if style == "minimax" else f"{block}.gate.e_score_correction_bias"
        maps.insert(1, same(f"{ours}.router.e_score_correction_bias", bias, layer=layer))
    if moe.shared_expert_ffn:
        shared = f"{block}.shared_experts" if style in ("deepseek", "kimi", "stacked") else f"{block}.shared_expert"
        maps += gated_mlp_maps(f"{ours}.shared_experts", shared, moe.shared_expert_ffn, layer=layer)
    if moe.shared_expert_gate:
        maps.append(same(f"{ours}.shared_expert_gate.weight", f"{block}.shared_expert_gate.weight", layer=layer))
    return maps
