"""LoRA in the plan (`tpzoo plan --lora-rank R`, targets all-linear): the frozen base, the adapters' training
state, and what adapters change in the activations a forward keeps.

State: the base is frozen in the model dtype (e bytes per parameter, no gradient, master or moments); the
adapters are a small model trained as usual (state_bytes of their element count: weights, fp32 main grads,
master, AdamW moments, ZeRO-1 sharded over dp).
Activations, per layer and token, against the full model (tested against real saved tensors):
  + e * r * (adapters of the layer): each adapter's inner u = x A^T, kept for B's gradient (a fused weight has one
    per HF projection; u is full-sequence under SP, computed from the gathered input);
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

def _layer(cfg: ModelConfig, layer: int, tp: int, rank: int) -> tuple[int, int, int]:
    """(adapter elements, adapter count, elements reduced late) of layer `layer` on one TP rank: built alone on
    meta with tpzoo.models.lora, so by construction what a run creates. Late: what finalize_grads still changes (the
    partial gradients of column A's and row B's, replicated kv heads' B) goes last in the gradient buffer. Layers of
    the same kinds (plan/layers.py signature) share one build."""
    from .layers import memo, signature

    return memo(cfg, ("lora", signature(cfg, layer), tp, rank), lambda: _build(cfg, layer, tp, rank))


def _build(cfg: ModelConfig, layer: int, tp: int, rank: int) -> tuple[int, int, int]:
    from tpzoo.models import ModelLayout, Stage, Transformer
    from tpzoo.models.lora import LoRAConfig, add_lora
    from tpzoo.parallel.data_parallel import is_late
    from tpzoo.parallel.dims import ParallelDims
    from tpzoo.parallel.lora import LoRA

    one = Transformer(cfg, ModelLayout(ParallelDims.for_rank(tp=tp), device="meta"),
                      Stage(range(layer, layer + 1), pre_process=False, post_process=False))
    add_lora([one], LoRAConfig(rank, 1.0))
    mods = [m for m in one.modules() if isinstance(m, LoRA)]
    params = [p for m in mods for p in m.parameters()]
    return (sum(p.numel() for p in params), sum(len(m.names) for m in mods),
            sum(p.numel() for p in params if is_late(p, tp, 1)))


def lora_layer_params(cfg: ModelConfig, layer: int, tp: int, rank: int) -> int:
    return _layer(cfg, layer, tp, rank)[0]


def lora_layer_late(cfg: ModelConfig, layer: int, tp: int, rank: int) -> int:
    return _layer(cfg, layer, tp, rank)[2]


def lora_layer_activation_delta(cfg: ModelConfig, layer: int, at, rank: int, tokens: int) -> int:
    """Bytes layer `layer` keeps with adapters minus what it keeps as a fully trained layer (may be negative)."""
    u = at.act_bytes * rank * _layer(cfg, layer, at.tp, rank)[1] * tokens
    torch_rms = at.kernels == "reference" and cfg.norm == "rmsnorm"
    norms = 2 * (int(cfg.pre_norm) + int(cfg.post_norm))
    return u - (norms * at.act_bytes * cfg.hidden_size * tokens // at.sp_div if torch_rms else 0)


def lora_chunk_activation_delta(cfg: ModelConfig, at, rank: int, layers: list[int], micro_batch: int, seq_len: int,
                                first: bool, last: bool, norm_saved: int, fused_loss: bool = True) -> int:
    """The whole difference for a chunk holding `layers` (see the module docstring); `norm_saved`: bytes per token
    the full model's norm keeps (plan.layers.norm_saved). Under full recomputation a layer keeps only its input, as
    without adapters: only the embedding and head terms remain."""
    h, tokens, e = cfg.hidden_size, micro_batch * seq_len, at.act_bytes
    torch_rms = at.kernels == "reference" and cfg.norm == "rmsnorm"
    full = at.recompute == "full"
    out = 0 if full else sum(lora_layer_activation_delta(cfg, i, at, rank, tokens) for i in layers)
    if first:
        if layers and not full and cfg.pre_norm:  # layer 0's input norm: no gradient reaches its input
            out -= (norm_saved - (e * h if torch_rms else 0)) * tokens // at.sp_div
        out -= (9 * tokens if at.tp > 1 else 0) + (8 * seq_len if cfg.position == "learned" else 0)
    if last:
        out -= frozen_head_savings(cfg, at, tokens, fused_loss)
        out -= e * h * tokens // at.sp_div if torch_rms else 0               # the final norm's normalized tensor
    return out
