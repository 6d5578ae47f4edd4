"""A floor under a layout's memory, found without estimating it: the search rules out the layouts whose floor is over
the GPU's memory (most of them, for a model that barely fits) and estimates only the rest.

The fullest pipeline stage holds at least what the average stage holds:
  - training state: the model's parameters on one rank (its tp shard, its ep share of the experts; a tied embedding
    once) over pp, each element at the bytes DistributedAdamW keeps for it (state_bytes of a multiple of dp
    elements, so no padding: ZeRO-2/3's late buckets, ZeRO-3's resident and gathered layers left out); LoRA: the
    frozen base in the model dtype;
  - activations: one micro-batch of every layer over pp (a stage holds at least the micro-batch it runs the backward
    of), at the layout's recompute, sequence parallelism and cp; LoRA: with what its frozen layers keep less or more;
plus the reserve. Both grow with what they count: a floor for a micro-batch of b sequences is one for any larger b.
tests/test_plan_search.py checks that no estimate is below its floor.
"""
from __future__ import annotations

from tpzoo.models.config import ModelConfig

from .layers import layer_activation_bytes
from .memory import ParamCount, stage_params, state_bytes
from .spec import DTYPE_BYTES, Layout, RankLayout, TrainingSpec, local_seq_len

_UNIT = 1 << 20  # elements per dp rank in the per-element rates (any multiple of dp: no padding)


def _per_element(training: TrainingSpec, replicas: int) -> float:
    """Bytes of training state per parameter element, sharded over `replicas` ranks."""
    n = replicas * _UNIT
    s = state_bytes(ParamCount(n, 0, 0, 0, 0, 0), training, replicas)
    return (s.params + s.grads + s.master + s.optimizer) / n


def state_floor(cfg: ModelConfig, layout: Layout, training: TrainingSpec) -> float:
    """Bytes of weights, gradients and optimizer state on the fullest stage of any layout of these tp, pp, dp, cp
    and ep, at least."""
    whole = stage_params(cfg, Layout(tp=layout.tp, ep=layout.ep), 0, training.vocab_padding_multiple)  # pp = 1
    if training.lora_rank:
        return DTYPE_BYTES[training.dtype] * whole.numel / layout.pp
    replicas = layout.grad_replicas
    if layout.ep == 1 or not whole.expert:
        return _per_element(training, replicas) * whole.numel / layout.pp
    dense = whole.numel - whole.expert
    # the expert weights in their own optimizer over edp = dp x cp / ep (memory.expert_state_bytes)
    per = _per_element(training, replicas) * dense + _per_element(training, replicas // layout.ep) * whole.expert
    return per / layout.pp


def activation_floor(cfg: ModelConfig, layout: Layout, training: TrainingSpec) -> float:
    """Bytes of one micro-batch's activations of the average stage at this layout."""
    at = RankLayout.of(layout, training)
    s = local_seq_len(layout, training)
    b = layout.micro_batch_size
    total = sum(layer_activation_bytes(cfg, i, at, b, s) for i in range(cfg.num_layers))
    if training.lora_rank and layout.recompute != "full":  # what a frozen layer keeps less or more (plan/lora.py)
        from .lora import lora_layer_activation_delta

        total += sum(lora_layer_activation_delta(cfg, i, at, training.lora_rank, b * s, training.lora_experts)
                     for i in range(cfg.num_layers))
    return total / layout.pp


def memory_floor(cfg: ModelConfig, layout: Layout, training: TrainingSpec, reserve_bytes: float = 0.0) -> float:
    """Bytes per GPU that `layout` needs at least (its estimate's total is never below)."""
    return state_floor(cfg, layout, training) + activation_floor(cfg, layout, training) + reserve_bytes

