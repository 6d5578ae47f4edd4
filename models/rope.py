"""Rotary variants of the 2025 families, as functions (no module state): YaRN's frequencies and its attention
factor (gpt-oss, DeepSeek-V3 / Kimi K2), DeepSeek's softmax-scale mscale, and DeepSeek's interleaved rotary.

    yarn_inv_freq(dim, rope, max_position_embeddings)    -> (inv_freq [dim/2] fp32, attention_factor)
    rope_tables(inv_freq, positions, attention_factor)   -> (cos, sin) [..., s, dim/2], scaled as HF scales them
    mla_softmax_scale(qk_head_dim, rope)                 -> DeepSeek's softmax scale, mscale(factor, mscale_all_dim)^2
    apply_rotary_interleaved(x [b, s, heads, d], cos, sin) -> DeepSeek's interleaved pairs, rotated

`rope` is HF's `rope_parameters` dict (rope_theta, rope_type, factor, original_max_position_embeddings, beta_fast,
beta_slow, mscale, mscale_all_dim, attention_factor, truncate). HF multiplies cos and sin by the attention factor
(so q.k scales by its square where both are rotated); DeepSeek's attention multiplies its softmax scale by
mscale(factor, mscale_all_dim)^2 on top (transformers' `yarn_apply_mscale`). Nothing crosses ranks here.
"""
from __future__ import annotations

import math

import torch

from tpzoo import kernels
from tpzoo.errors import ConfigError


def yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    """YaRN's attention temperature 0.1 * mscale * ln(scale) + 1 (1 when the context is not stretched)."""
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def yarn_inv_freq(dim: int, rope: dict, max_position_embeddings: int | None = None) -> tuple[torch.Tensor, float]:
    """YaRN (NTK-by-parts) inverse frequencies of a `dim`-wide rotary and its attention factor, as transformers'
    `_compute_yarn_parameters`: dims rotating more than beta_fast times over the original context keep their
    frequency (extrapolation), those rotating less than beta_slow times are divided by `factor` (interpolation),
    a linear ramp between. Computed in fp32 in HF's order, so the tables match its own bit for bit."""
    base, old = rope["rope_theta"], rope.get("original_max_position_embeddings")
    if old is None:
        raise ConfigError("yarn rope_parameters need original_max_position_embeddings")
    factor = rope.get("factor")
    if factor is None:  # DeepSeek-style configs: the ratio of the stretched to the pretrained context
        if max_position_embeddings is None:
            raise ConfigError("yarn without a factor needs max_position_embeddings")
        factor = max_position_embeddings / old
    attention_factor = rope.get("attention_factor")
    if attention_factor is None:
        mscale, mscale_all_dim = rope.get("mscale"), rope.get("mscale_all_dim")
        if mscale and mscale_all_dim:
            attention_factor = float(yarn_mscale(factor, mscale) / yarn_mscale(factor, mscale_all_dim))
        else:
            attention_factor = yarn_mscale(factor)
    beta_fast, beta_slow = rope.get("beta_fast") or 32, rope.get("beta_slow") or 1

    def correction_dim(rotations: float) -> float:  # the dim whose wavelength fits `rotations` times in `old`
        return dim * math.log(old / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if rope.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # no zero-width ramp
    ramp = ((torch.arange(dim // 2, dtype=torch.float32, device="cpu") - low) / (high - low)).clamp(0, 1)
    pos_freqs = base ** (torch.arange(0, dim, 2, device="cpu").to(torch.float32) / dim)
    extrapolate = 1 - ramp  # 1: keep the original frequency
    inv_freq = (1.0 / (factor * pos_freqs)) * (1 - extrapolate) + (1.0 / pos_freqs) * extrapolate
    return inv_freq, float(attention_factor)


def rope_tables(inv_freq: torch.Tensor, positions: torch.Tensor, attention_factor: float = 1.0):
    """cos, sin [..., s, dim/2] (fp32) for integer positions [..., s], multiplied by the attention factor."""
    angles = positions.to(torch.float32).unsqueeze(-1) * inv_freq.to(positions.device)
    cos, sin = angles.cos(), angles.sin()
    if attention_factor != 1.0:
        cos, sin = cos * attention_factor, sin * attention_factor
    return cos, sin


def mla_softmax_scale(qk_head_dim: int, rope: dict | None) -> float:
    """DeepSeek's softmax scale: qk_head_dim^-0.5, times mscale(factor, mscale_all_dim)^2 when the rope is scaled
    and mscale_all_dim is set (transformers' `yarn_apply_mscale`)."""
    scale = qk_head_dim ** -0.5
    rope = rope or {}
    if rope.get("rope_type", "default") != "default" and rope.get("mscale_all_dim"):
        m = yarn_mscale(rope["factor"], rope["mscale_all_dim"])
        scale = scale * m * m
    return scale


def deinterleave(x: torch.Tensor) -> torch.Tensor:
    """(x0, x1, x2, x3, ...) -> (x0, x2, ..., x1, x3, ...) on the last dim: interleaved pairs to halves."""
    return x.unflatten(-1, (-1, 2)).transpose(-1, -2).flatten(-2)


def apply_rotary_interleaved(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """DeepSeek's rotary (`rope_interleave`): pairs (x0, x1), (x2, x3), ... each rotated by one frequency, the
    result laid out as halves [rotated evens | rotated odds] exactly as transformers returns it. That is the
    half-split rotary of the de-interleaved vector, so tpzoo's rotary kernel does the work. x [b, s, heads, d]."""
    return kernels.apply_rotary(deinterleave(x), cos, sin)
