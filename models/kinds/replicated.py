"""A linear layer every tensor-parallel rank holds whole (tpzoo.parallel.ReplicatedLinear), built from a layout:
multi-head latent attention's down projections, a shared expert's sigmoid gate (Qwen3-Next).

TP split: none. Each rank applies it to the tokens it holds: the whole sequence without SP (the weight's gradient
is then whole on every rank, every rank seeing the same tokens and output gradient), its sequence shard under SP
(the gradient partial, marked `sequence_parallel`, summed over tp by finish_tp_grads like a norm's). Nothing
crosses ranks in its forward. Its weights are drawn in full from the layer's seed on every rank: the same weights at
any layout.
"""
from __future__ import annotations

from tpzoo.parallel import ReplicatedLinear as _Replicated
from tpzoo.parallel import normal_init

from ..layout import ModelLayout


class ReplicatedLinear(_Replicated):
    """y = x W^T (+ b), W [out, in] whole on every tp rank; `std` the normal init of W (a bias starts at 0)."""

    def __init__(self, in_features: int, out_features: int, layout: ModelLayout, bias: bool = False,
                 std: float = 0.02):
        super().__init__(in_features, out_features, bias=bias, init_method=normal_init(std), **layout.linear)
