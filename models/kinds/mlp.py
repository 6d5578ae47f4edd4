"""Channel mixer "mlp": the dense MLP, h -> ffn -> h (SwiGLU / GeGLU with gate|up fused in one matmul, or GPT-2's
tanh GeLU with a bias).

TP split: the hidden ffn units. fc_in is column-parallel (each rank its ffn/tp units; gate|up parts split alike),
fc_out row-parallel.
What crosses ranks: entering the TP region (all-gather of the sequence under SP, else the input gradient's
all-reduce in backward) and leaving it (all-reduce, or reduce-scatter under SP): Megatron's two collectives per
MLP, forward and backward.
Cache: none (it works per position).
"""
from __future__ import annotations

import math

import torch.nn as nn

from tpzoo import kernels
from tpzoo.parallel import ColumnParallelLinear, ParallelLayoutError, RowParallelLinear, ShardSpec

from ..config import ModelConfig
from ..inputs import Context
from ..layout import ModelLayout
from ..registry import register_channel_mixer
from . import mlp_hf


@register_channel_mixer("mlp")
class MLP(nn.Module):
    """Column (h -> ffn, gate|up fused for SwiGLU and GeGLU) then row (ffn -> h). `ffn`: another hidden size than
    the config's dense one (a mixture of experts' shared experts, models/kinds/moe.py)."""
    hf_tensor_maps = staticmethod(mlp_hf.hf_tensor_maps)  # its Hugging Face names

    def __init__(self, cfg: ModelConfig, layer: int, layout: ModelLayout, ffn: int | None = None):
        super().__init__()
        m = cfg.mlp
        if ffn is None:  # (a mixture of experts checks its shared experts' width itself)
            self.check_parallel(cfg, layer, layout.tp)
        ffn, self.activation = ffn or m.ffn_hidden_size, m.activation
        init = lambda t: nn.init.normal_(t, std=cfg.initializer_range)  # noqa: E731
        spec = ShardSpec(0, parts=(ffn, ffn)) if m.gated else None
        self.fc_in = ColumnParallelLinear(cfg.hidden_size, 2 * ffn if m.gated else ffn, bias=m.bias, shard_spec=spec,
                                          init_method=init, skip_bias_add=not m.gated, **layout.linear)
        out_std = cfg.initializer_range / math.sqrt(2 * cfg.num_layers)
        self.fc_out = RowParallelLinear(ffn, cfg.hidden_size, bias=m.bias,
                                        init_method=lambda t: nn.init.normal_(t, std=out_std), **layout.linear)

    @staticmethod
    def check_parallel(cfg: ModelConfig, layer: int, tp: int, cp: int = 1, ep: int = 1) -> None:
        """ParallelLayoutError where the hidden units cannot split over tp (the one copy of this check)."""
        if cfg.mlp.ffn_hidden_size % tp:
            raise ParallelLayoutError(f"tp={tp} does not divide ffn_hidden_size={cfg.mlp.ffn_hidden_size}")

    def forward(self, x, ctx: Context | None = None):
        h = self.fc_in(x)
        if self.activation == "swiglu":  # h = gate|up: packed, so the backward needs no cat of the two halves
            h = kernels.swiglu_packed(h)
        elif self.activation == "geglu_tanh":
            h = kernels.geglu_packed(h)
        else:
            h = kernels.bias_gelu(h, self.fc_in.bias)
        return self.fc_out(h)

    @staticmethod
    def num_parameters(cfg: ModelConfig, layer: int, active: bool = False, ffn: int | None = None) -> int:
        m, h = cfg.mlp, cfg.hidden_size
        ffn = ffn or m.ffn_hidden_size
        n_in = 2 * ffn if m.gated else ffn
        return h * n_in + ffn * h + ((n_in + h) if m.bias else 0)
