"""RMSNorm / LayerNorm over the last dim, replicated over TP (every block's norms, the final norm, q/k norms)."""
from __future__ import annotations

import torch
import torch.nn as nn

from tpzoo import kernels
from tpzoo.parallel import mark_parallel

from .config import ModelConfig
from .layout import ModelLayout


class Norm(nn.Module):
    """RMSNorm or LayerNorm over the last dim, of `size` (default hidden_size; q/k norms pass theirs). Replicated
    over TP; its gradient is partial (summed over TP by finish_tp_grads) when it sees only part of what the TP
    ranks normalize: this rank's sequence shard under SP, or its own heads (`partial_grad`, default: SP's).
    With cfg.norm_offset (Gemma) the scale is (1 + weight), weights starting at 0: the same kernel runs on the
    offset weight."""

    def __init__(self, cfg: ModelConfig, layout: ModelLayout, size: int | None = None,
                 partial_grad: bool | None = None):
        super().__init__()
        self.kind, self.eps, self.offset = cfg.norm, cfg.norm_eps, cfg.norm_offset
        size = size or cfg.hidden_size
        partial = layout.sequence_parallel if partial_grad is None else partial_grad
        kw = {"dtype": layout.dtype, "device": "meta"}
        self.weight = mark_parallel(nn.Parameter(torch.empty(size, **kw)), None, partial)
        self.bias = (mark_parallel(nn.Parameter(torch.empty(size, **kw)), None, partial)
                     if cfg.norm == "layernorm" else None)

    def reset_parameters(self) -> None:
        if self.weight.device.type == "meta":
            return
        with torch.no_grad():
            self.weight.fill_(0.0 if self.offset else 1.0)
            if self.bias is not None:
                self.bias.zero_()

    def forward(self, x):
        if self.kind == "rmsnorm":
            return kernels.rms_norm(x, 1 + self.weight if self.offset else self.weight, self.eps)
        return kernels.layer_norm(x, self.weight, self.bias, self.eps)
