"""Tiny DeepSeek-V3, GLM-4.5, Qwen3-Next and Qwen3.5 (dense and MoE) checkpoints with multi-token-prediction weights,
written by transformers (no downloads), and the plain-torch reference of their MTP loss, for tests/test_mtp*.py.

Built the way the published checkpoints are laid out: transformers writes a model with D more layers than the
checkpoint's config counts; the last D layers become the MTP depths' blocks (DeepSeek / GLM: model.layers.{n+j}.*
as they are; Qwen: renamed mtp.layers.{j}.*) beside random enorm / hnorm / eh_proj / final norms (and
DeepSeek's copies of the embedding and head). transformers reads the checkpoint and ignores those weights; the
reference (`Reference`) runs the MTP depths with transformers' own decoder-layer modules of the larger model (its
layers n.. n+D-1), its RMSNorm class and a plain matmul, from the DeepSeek-V3 report's equations.
"""
from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

import frontier_models
import hf_models

KINDS = ("deepseek_v3", "qwen3_next")  # the proof's two (tests/test_mtp.py); every family's layout: test_mtp_convert
FAMILIES = ("deepseek_v3", "glm4_moe", "qwen3_next", "qwen3_5", "qwen3_5_moe")
DEPTHS = {"deepseek_v3": 2, "glm4_moe": 1, "qwen3_next": 1, "qwen3_5": 1, "qwen3_5_moe": 1}  # DeepSeek's two
# depths check the chain h^1 -> depth 2
MAIN_LAYERS = {"deepseek_v3": 2, "glm4_moe": 2, "qwen3_next": 4, "qwen3_5": 4, "qwen3_5_moe": 4}
VOCAB = {"deepseek_v3": frontier_models.VOCAB, "glm4_moe": frontier_models.VOCAB, "qwen3_next": hf_models.VOCAB,
         "qwen3_5": hf_models.VOCAB, "qwen3_5_moe": hf_models.VOCAB}


QWEN = ("qwen3_next", "qwen3_5", "qwen3_5_moe")  # the "qwen" layout (mtp.*)
COUNT = {"deepseek_v3": "num_nextn_predict_layers", "glm4_moe": "num_nextn_predict_layers",
         "qwen3_5": "mtp_num_hidden_layers", "qwen3_5_moe": "mtp_num_hidden_layers"}  # (Qwen3-Next's config: none)


def _qwen(kind: str, layers: int):
    """3 Gated DeltaNet layers and 1 gated attention layer (the main model), then the MTP block: full attention and
    the family's channel mixer (Qwen3-Next's layer 1 keeps a dense MLP)."""
    import transformers as tf

    hf_models.use_torch_gated_delta()
    types = ["linear_attention"] * 3 + ["full_attention"] * (layers - 3)
    common = {**hf_models.HYBRID, "num_hidden_layers": layers, "layer_types": types}
    if kind == "qwen3_5":
        cfg, cls = tf.Qwen3_5TextConfig(**common, intermediate_size=48), tf.Qwen3_5ForCausalLM
    elif kind == "qwen3_5_moe":
        cfg, cls = tf.Qwen3_5MoeTextConfig(**common, **hf_models.HYBRID_MOE), tf.Qwen3_5MoeForCausalLM
    else:
        cfg = tf.Qwen3NextConfig(**common, **hf_models.HYBRID_MOE, intermediate_size=48, mlp_only_layers=[1])
        cls = tf.Qwen3NextForCausalLM
    torch.manual_seed(0)
    return hf_models.randomized(cls(cfg).eval())


def larger_model(kind: str, vocab: int | None = None):
    """transformers' model with the MTP blocks as its last layers (`vocab`: another vocabulary, DeepSeek / GLM)."""
    layers = MAIN_LAYERS[kind] + DEPTHS[kind]
    if kind in QWEN:
        return _qwen(kind, layers)
    return frontier_models.make_hf_model(kind, vocab=vocab or VOCAB[kind], layers=layers)


def _extras(kind: str, hidden: int, depth: int) -> dict:
    """A depth's own weights, random (norms away from their defaults: each one changes the loss)."""
    g = torch.Generator().manual_seed(100 + depth)
    offset = 0.0 if kind in QWEN else 1.0  # Qwen's norms scale by (1 + w)
    norm = lambda: offset + 0.3 * torch.randn(hidden, generator=g)  # noqa: E731
    return {"enorm": norm(), "hnorm": norm(), "final": norm(),
            "eh_proj": 0.3 * torch.randn(hidden, 2 * hidden, generator=g)}


def write_checkpoint(kind: str, path, with_mtp: bool = True, vocab: int | None = None) -> "Reference":
    """The checkpoint (config.json and model.safetensors) in `path`; the reference of its MTP depths. Without
    `with_mtp`: the main model's tensors alone, its config still counting the depths (a re-upload that dropped them)."""
    big = larger_model(kind, vocab)
    n, depths = MAIN_LAYERS[kind], DEPTHS[kind]
    path = Path(path)
    tmp = path.parent / (path.name + ".larger")
    big.save_pretrained(tmp)
    tensors = {}
    for f in sorted(tmp.glob("*.safetensors")):
        tensors.update(load_file(str(f)))
    config = json.loads((tmp / "config.json").read_text())
    config["num_hidden_layers"] = n
    if "layer_types" in config:
        config["layer_types"] = config["layer_types"][:n]
    extras = [_extras(kind, config["hidden_size"], j) for j in range(depths)]
    out = {}
    for name, t in tensors.items():
        layer = int(name.split(".")[2]) if name.startswith("model.layers.") else -1
        if layer < n:
            out[name] = t
        elif with_mtp and kind in QWEN:
            out[name.replace(f"model.layers.{layer}.", f"mtp.layers.{layer - n}.")] = t
        elif with_mtp:
            out[name] = t  # DeepSeek's layout: the depth is the layer after the main ones
    if with_mtp:
        for j, e in enumerate(extras):
            if kind in QWEN:
                out.update({"mtp.pre_fc_norm_embedding.weight": e["enorm"], "mtp.pre_fc_norm_hidden.weight": e["hnorm"],
                            "mtp.norm.weight": e["final"], "mtp.fc.weight": e["eh_proj"]})
            else:
                q = f"model.layers.{n + j}."
                out.update({q + "enorm.weight": e["enorm"], q + "hnorm.weight": e["hnorm"],
                            q + "shared_head.norm.weight": e["final"], q + "eh_proj.weight": e["eh_proj"],
                            q + "embed_tokens.weight": tensors["model.embed_tokens.weight"].clone(),
                            q + "shared_head.head.weight": tensors["lm_head.weight"].clone()})
    if kind in COUNT:
        config[COUNT[kind]] = depths
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(config, indent=2))
    save_file({k: v.contiguous() for k, v in out.items()}, str(path / "model.safetensors"), metadata={"format": "pt"})
    return Reference(kind, big, extras)


class Reference:
    """The MTP loss of the DeepSeek-V3 report from transformers' modules: the larger model's first n layers (with
    its final norm and head) are the checkpoint's main model, its layers n.. the depths' blocks."""

    def __init__(self, kind: str, big, extras: list[dict]):
        self.kind, self.big, self.extras = kind, big, extras
        self.n, self.depths = MAIN_LAYERS[kind], len(extras)
        decoder = big.model
        norm_cls = type(decoder.norm)
        eps = big.config.rms_norm_eps
        self.norms = []
        for e in extras:
            mods = {}
            for key in ("enorm", "hnorm", "final"):
                m = norm_cls(big.config.hidden_size, eps=eps)
                with torch.no_grad():
                    m.weight.copy_(e[key])
                mods[key] = m
            self.norms.append(mods)

    def hidden(self, ids: torch.Tensor) -> torch.Tensor:
        """h^0: the main model's output after its final norm (the larger model's first n layers)."""
        decoder = self.big.model
        pos = torch.arange(ids.shape[1]).unsqueeze(0)
        x = decoder.embed_tokens(ids)
        rotary = decoder.rotary_emb(x, pos)
        for layer in decoder.layers[:self.n]:
            kw = {"position_embeddings": rotary, "position_ids": pos}
            if self.kind in QWEN:
                x = layer(x, rotary, position_ids=pos)
            else:
                x = layer(x, **kw)
            x = x[0] if isinstance(x, tuple) else x
        return decoder.norm(x)

    def depth(self, k: int, h: torch.Tensor, next_ids: torch.Tensor) -> torch.Tensor:
        """h^k (k = 1..D) from h^{k-1} and the tokens t_{i+k} at each position."""
        decoder, norms = self.big.model, self.norms[k - 1]
        pos = torch.arange(h.shape[1]).unsqueeze(0)
        e = decoder.embed_tokens(next_ids)
        x = torch.cat([norms["enorm"](e), norms["hnorm"](h)], dim=-1) @ self.extras[k - 1]["eh_proj"].t()
        layer = decoder.layers[self.n + k - 1]
        rotary = decoder.rotary_emb(x, pos)
        x = layer(x, rotary, position_ids=pos) if self.kind in QWEN else \
            layer(x, position_embeddings=rotary, position_ids=pos)
        x = x[0] if isinstance(x, tuple) else x
        return norms["final"](x)

    def losses(self, windows: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """(language-model loss, MTP loss) over windows [1, S + 1] of tokens, tpzoo.evaluation's way: sums over
        every predicted token over their number N; the MTP loss the mean over depths of each depth's summed
        cross-entropy over N (the report's 1/T), a position counting where its target t_{i+k+1} is in the window."""
        lm = mtp = 0.0
        n = 0
        for w in windows:
            ids, s = w[:, :-1], w.shape[1] - 1
            h = self.hidden(ids)
            lm = lm + F.cross_entropy(self.big.lm_head(h)[0], w[0, 1:], reduction="sum")
            depth_sum = 0.0
            for k in range(1, self.depths + 1):
                shifted = torch.zeros_like(ids)
                shifted[:, :max(s - k, 0)] = ids[:, k:]
                h = self.depth(k, h, shifted)
                valid = s - k  # positions i with t_{i+k+1} in the window
                if valid > 0:
                    depth_sum = depth_sum + F.cross_entropy(self.big.lm_head(h)[0, :valid], w[0, k + 1:],
                                                            reduction="sum")
            mtp = mtp + depth_sum / self.depths
            n += s
        return lm / n, mtp / n
