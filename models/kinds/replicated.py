"""A linear layer every tensor-parallel rank holds whole: multi-head latent attention's down projections, a shared
expert's sigmoid gate (Qwen3-Next), small projections not worth splitting.

TP split: none. Each rank computes it on the tokens it holds: the whole sequence without SP (then the weight's
gradient is whole on every rank, since every rank sees the same tokens and the same output gradient), its
sequence shard under SP (then the gradient is partial, marked `sequence_parallel`, and summed over tp by
finish_tp_grads like a norm's). Nothing crosses ranks in its forward.
Its weights are drawn in full from the layer's seed on every rank: the same weights at any layout.
"""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from tpzoo.parallel import mark_parallel

from ..layout import ModelLayout


class ReplicatedLinear(nn.Module):
    """y = x W^T (+ b), W [out, in] whole on every tp rank; `std` the normal init of W (a bias starts at 0)."""

    def __init__(self, in_features: int, out_features: int, layout: ModelLayout, bias: bool = False,
                 std: float = 0.02):
        super().__init__()
        self.in_features, self.out_features, self.std = in_features, out_features, std
        self.dims, self.sequence_parallel = layout.dims, layout.sequence_parallel
        kw = {"dtype": layout.dtype, "device": "meta"}
        self.weight = mark_parallel(nn.Parameter(torch.empty(out_features, in_features, **kw)), None,
                                    layout.sequence_parallel)
        self.bias = (mark_parallel(nn.Parameter(torch.empty(out_features, **kw)), None, layout.sequence_parallel)
                     if bias else None)

    def reset_parameters(self) -> None:
        if self.weight.device.type == "meta":
            return
        with torch.no_grad():
            # drawn in fp32, as the parallel layers draw their master weights (the same values in any dtype)
            self.weight.copy_(torch.empty(self.weight.shape, dtype=torch.float32,
                                          device=self.weight.device).normal_(std=self.std))
            if self.bias is not None:
                self.bias.zero_()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)

    def extra_repr(self) -> str:
        return (f"in={self.in_features}, out={self.out_features}, bias={self.bias is not None}, replicated, "
                f"sequence_parallel={self.sequence_parallel}")
