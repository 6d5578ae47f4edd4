"""A transformer block: a token mixer and a channel mixer (their kinds chosen per layer from the config through
the registries of models/kinds), each with its norms and residual add. Reads like single-device code; the
parallel layout is inside the mixers (column in, row out) and the ModelLayout they are built with.

Parameter names stay those of every checkpoint: `attn_norm`, `attn` (the token mixer, whatever its kind),
`mlp_norm`, `mlp` (the channel mixer: a dense MLP or a mixture of experts), `post_attn_norm`, `post_mlp_norm`.
"""
from __future__ import annotations

import torch.nn as nn

from .config import ModelConfig
from .inputs import Context
from .layout import ModelLayout
from .norm import Norm
from .registry import layer_kinds


class TransformerBlock(nn.Module):
    """Pre-norm (attn_norm, mlp_norm) and/or post-norm (post_attn_norm, post_mlp_norm: the mixer's output
    normalized before the residual add; OLMo 2 has only these, Gemma 2/3 both) around the two mixers."""

    def __init__(self, cfg: ModelConfig, layer: int, layout: ModelLayout):
        super().__init__()
        token_mixer, channel_mixer = layer_kinds(cfg, layer)
        if cfg.pre_norm:
            self.attn_norm = Norm(cfg, layout)
        self.attn = token_mixer(cfg, layer, layout)
        if cfg.pre_norm:
            self.mlp_norm = Norm(cfg, layout)
        self.mlp = channel_mixer(cfg, layer, layout)
        if cfg.post_norm:
            self.post_attn_norm = Norm(cfg, layout)
            self.post_mlp_norm = Norm(cfg, layout)
        self.pre_norm, self.post_norm = cfg.pre_norm, cfg.post_norm

    def forward(self, x, ctx: Context, cache=None):
        h = self.attn(self.attn_norm(x) if self.pre_norm else x, ctx, cache)
        x = x + (self.post_attn_norm(h) if self.post_norm else h)
        h = self.mlp(self.mlp_norm(x) if self.pre_norm else x, ctx)
        return x + (self.post_mlp_norm(h) if self.post_norm else h)
