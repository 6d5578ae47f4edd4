"""LoRA in the plan (`tpzoo plan --lora-rank R`, targets all-linear, or every projection that takes adapters where
a model refuses all-linear, as Qwen3-Next's regrouped in_proj_qkvz; `--lora-experts`: one adapter per routed
expert too): the frozen base, the adapters' training state and FLOPs, and what adapters change in the activations
a forward keeps.

State: the base is frozen in the model dtype (e bytes per parameter, no gradient, master or moments); the
adapters are a small model trained as usual (state_bytes of their element count: weights, fp32 main grads,
master, AdamW moments, ZeRO-1 sharded over dp); the routed experts' adapters, E / ep experts' on a rank, in the
experts' own optimizer over edp = dp x cp / ep at ep > 1 (as the experts' weights: memory.expert_state_bytes).
FLOPs: 2 per adapter element per token (forward; as much again for the input gradient and for the adapters'
weight gradients); an expert's adapters per dispatched row (k rows per token).
Activations, per layer and token, against the full model (tested against real saved tensors):
  + e * r * (adapters of the layer): each adapter's inner u = x A^T, kept for B's gradient (a fused weight has one
    per HF projection; u is full-sequence under SP, computed from the gathered input);
  + e * r * 2 * k per token with --lora-experts: each dispatched row's u of its expert's gate|up and down adapters;
    without them - e * (h + f) * k: the frozen experts keep neither their input rows nor their activations' output;
    - e * h (per shard token) the frozen router's input, unless shared experts' adapters keep it;
  - the torch RMSNorm's normalized tensor (e*h per norm) it keeps only for its weight's gradient;
per chunk: the first layer's input norm keeps nothing (no gradient reaches the frozen embedding), nor does the
embedding (lookup indices, masks); a frozen head keeps less (plan/head.py frozen_head_savings: unfused its
input without SP; fused its input, log-sum-exp and weight gradient), nor does the torch final RMSNorm keep its
normalized tensor. Exact (tested) for the
pre-norm GPT and LLaMA families; for the 2025 families approximate as their full-model activations are.
"""
from __future__ import annotations

from tpzoo.models.config import ModelConfig

from .head import frozen_head_savings

def _layer(cfg: ModelConfig, layer: int, tp: int, rank: int, ep: int = 1, experts: bool = False) -> tuple:
    """(adapter elements, linear adapter count, elements reduced late, of them the routed experts' adapters, one
    expert's adapter elements) of layer `layer` on one TP rank (of one EP rank: its E / ep experts' adapters): built
    alone on meta with tpzoo.models.lora, so by construction what a run creates. Late: what finalize_grads still
    changes (the partial gradients of column A's and row B's, replicated kv heads' B) goes last in the gradient
    buffer. Layers of the same kinds (plan/layers.py signature) share one build."""
    from .layers import memo, signature

    return memo(cfg, ("lora", signature(cfg, layer), tp, rank, ep, experts),
                lambda: _build(cfg, layer, tp, rank, ep, experts))


def _build(cfg: ModelConfig, layer: int, tp: int, rank: int, ep: int, experts: bool) -> tuple:
    from tpzoo.models import ModelLayout, Stage, Transformer
    from tpzoo.models.kinds.expert_lora import ExpertLoRA
    from tpzoo.errors import ConfigError
    from tpzoo.models.lora import LoRAConfig, add_lora, valid_targets
    from tpzoo.parallel.data_parallel import is_late
    from tpzoo.parallel.dims import ParallelDims
    from tpzoo.parallel.lora import LoRA

    one = Transformer(cfg, ModelLayout(ParallelDims.for_rank(tp=tp, dp=ep, ep=ep), device="meta"),
                      Stage(range(layer, layer + 1), pre_process=False, post_process=False))
    try:
        add_lora([one], LoRAConfig(rank, 1.0, experts=experts))
    except ConfigError:  # all-linear refused (Qwen3-Next's regrouped in_proj_qkvz / in_proj_ba): what a run names
        targets = valid_targets(one)
        if targets or experts:
            add_lora([one], LoRAConfig(rank, 1.0, targets=targets, experts=experts))
    mods = [m for m in one.modules() if isinstance(m, LoRA)]
    params = [p for m in mods for p in m.parameters()]
    routed = [m for m in one.modules() if isinstance(m, ExpertLoRA)]
    expert_params = [p for m in routed for p in m.parameters()]
    per_expert = sum(p[0].numel() for p in expert_params)
    every = params + expert_params
    return (sum(p.numel() for p in every), sum(len(m.names) for m in mods),
            sum(p.numel() for p in every if is_late(p, tp, 1)), sum(p.numel() for p in expert_params), per_expert)


def lora_layer_params(cfg: ModelConfig, layer: int, tp: int, rank: int, ep: int = 1, experts: bool = False) -> int:
    return _layer(cfg, layer, tp, rank, ep, experts)[0]


def lora_layer_late(cfg: ModelConfig, layer: int, tp: int, rank: int, ep: int = 1, experts: bool = False) -> int:
    return _layer(cfg, layer, tp, rank, ep, experts)[2]


def lora_layer_expert_params(cfg: ModelConfig, layer: int, tp: int, rank: int, ep: int = 1) -> int:
    """The routed experts' adapter elements of this rank (--lora-experts): their optimizer runs over edp."""
    return _layer(cfg, layer, tp, rank, ep, True)[3]


def lora_layer_flops(cfg: ModelConfig, layer: int, tp: int, rank: int, tokens: int, ep: int = 1,
                     experts: bool = False) -> int:
    """Forward FLOPs of the layer's adapters for `tokens` tokens of the full sequence (the adapters compute on the
    TP region's gathered input): 2 per element of every linear adapter per token; the routed experts' adapters on
    the k rows each token is dispatched as (over the ep group this rank computes T * k rows in expectation, as the
    experts do: plan/kinds/moe.py), 2 per element of one expert's adapters per row."""
    n, _, _, expert, per_expert = _layer(cfg, layer, tp, rank, ep, experts)
    rows = tokens * cfg.moe.num_experts_per_tok if per_expert else 0
    return 2 * tokens * (n - expert) + 2 * rows * per_expert


def lora_layer_activation_delta(cfg: ModelConfig, layer: int, at, rank: int, tokens: int,
                                experts: bool = False) -> int:
    """Bytes layer `layer` keeps with adapters minus what it keeps as a fully trained layer (may be negative): per
    token each linear adapter's u, per dispatched row each of an expert's two adapters' u (gate|up's, down's), or,
    without expert adapters, less the row and activation output the frozen experts do not keep."""
    _, count, _, _, per_expert = _layer(cfg, layer, at.tp, rank, at.ep, experts)
    e = at.act_bytes
    u = e * rank * count * tokens
    if cfg.is_moe_layer(layer):
        rows = tokens * cfg.moe.num_experts_per_tok
        if per_expert:  # each row's u of its expert's two adapters (whose A keep the rows and activations)
            u += e * rank * 2 * rows
        else:  # frozen experts keep neither their input rows nor their activations' output (no weight gradient)
            u -= e * (cfg.hidden_size + cfg.expert_ffn // at.tp) * rows
        if not getattr(cfg.moe, "shared_expert_ffn", 0):  # nor does the frozen router keep the layer's input
            u -= e * cfg.hidden_size * tokens // at.sp_div
    torch_rms = at.kernels == "reference" and cfg.norm == "rmsnorm"
    norms = 2 * (int(cfg.pre_norm) + int(cfg.post_norm))
    return u - (norms * at.act_bytes * cfg.hidden_size * tokens // at.sp_div if torch_rms else 0)


def lora_chunk_activation_delta(cfg: ModelConfig, at, rank: int, layers: list[int], micro_batch: int, seq_len: int,
                                first: bool, last: bool, norm_saved: int, fused_loss: bool = True,
                                experts: bool = False) -> int:
    """The whole difference for a chunk holding `layers` (see the module docstring); `norm_saved`: bytes per token
    the full model's norm keeps (plan.layers.norm_saved). Under full recomputation a layer keeps only its input, as
    without adapters: only the embedding and head terms remain."""
    h, tokens, e = cfg.hidden_size, micro_batch * seq_len, at.act_bytes
    torch_rms = at.kernels == "reference" and cfg.norm == "rmsnorm"
    full = at.recompute == "full"
    out = 0 if full else sum(lora_layer_activation_delta(cfg, i, at, rank, tokens, experts) for i in layers)
    if first:
        if layers and not full and cfg.pre_norm:  # layer 0's input norm: no gradient reaches its input
            out -= (norm_saved - (e * h if torch_rms else 0)) * tokens // at.sp_div
        out -= (9 * tokens if at.tp > 1 else 0) + (8 * seq_len if cfg.position == "learned" else 0)
    if last:
        out -= frozen_head_savings(cfg, at, tokens, fused_loss)
        out -= e * h * tokens // at.sp_div if torch_rms else 0               # the final norm's normalized tensor
    return out
