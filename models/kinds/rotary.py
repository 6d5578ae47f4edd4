"""Rotary position embeddings: the tables (inverse frequencies, with their scaling variants) and their application.

A token mixer that rotates q and k declares the table it uses as a RotarySpec (its `rotary` attribute, per layer:
Gemma 3's sliding layers use their own base, SmolLM3's NoPE layers none). The Transformer keeps one
inverse-frequency buffer per distinct spec among its layers and computes each table's cos/sin once per forward
(Context.rotary[spec]), shared by every layer that uses it, outside any recomputed region.

Scaling variants (HF's `rope_type`): default, linear (positions divided by `factor`), llama3 (Llama 3.1: long
wavelengths slowed by `factor`, short ones kept, the band between interpolated), yarn (NTK-by-parts frequencies,
models/rope.py, and an attention factor that multiplies cos and sin, as transformers applies it: gpt-oss,
DeepSeek-V3, Kimi K2). A new variant is one more branch of `inv_freq` (and of `attention_factor`).
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass

import torch

from tpzoo import kernels
from tpzoo.errors import ConfigError

from ..rope import rope_tables, yarn_inv_freq

ROPE_TYPES = ("default", "linear", "llama3", "yarn")


@dataclass(frozen=True)
class RotarySpec:
    """One rotary table: `dim` leading dims of each head rotate (dim/2 frequencies), base `theta`, HF's
    rope_scaling dict as sorted JSON (hashable: specs are dict keys)."""
    dim: int
    theta: float
    scaling: str = "null"

    @classmethod
    def of(cls, dim: int, theta: float, scaling: dict | None = None) -> "RotarySpec":
        """The one instance of this spec: layers sharing a table share the key object, which torch.compile
        guards on by identity (Context.rotary[spec]): equal but distinct keys would recompile each block."""
        spec = cls(dim, float(theta), json.dumps(scaling or None, sort_keys=True))
        return _SPECS.setdefault(spec, spec)


_SPECS: dict = {}


def inv_freq(spec: RotarySpec) -> torch.Tensor:
    """Inverse frequencies [dim / 2] (fp32, on the host)."""
    dim = spec.dim
    freqs = 1.0 / (spec.theta ** (torch.arange(0, dim, 2, dtype=torch.float64, device="cpu") / dim))
    scaling = json.loads(spec.scaling) or {}
    kind = scaling.get("rope_type", scaling.get("type"))
    if kind in (None, "default"):
        return freqs.float()
    if kind == "linear":
        return (freqs / scaling["factor"]).float()
    if kind == "llama3":
        factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
        old_len = scaling["original_max_position_embeddings"]
        wavelen = 2 * math.pi / freqs
        smooth = (old_len / wavelen - low) / (high - low)
        scaled = torch.where(wavelen > old_len / low, freqs / factor, freqs)
        between = (wavelen <= old_len / low) & (wavelen >= old_len / high)
        return torch.where(between, (1 - smooth) * freqs / factor + smooth * freqs, scaled).float()
    if kind == "yarn":
        return yarn_inv_freq(dim, {**scaling, "rope_theta": spec.theta})[0]
    raise ConfigError(f"unsupported rope_scaling type {kind!r} (supported: {', '.join(ROPE_TYPES)})")


def attention_factor(spec: RotarySpec) -> float:
    """What cos and sin are multiplied by (YaRN's attention temperature; 1 for the other variants)."""
    scaling = json.loads(spec.scaling) or {}
    if scaling.get("rope_type", scaling.get("type")) != "yarn":
        return 1.0
    return yarn_inv_freq(spec.dim, {**scaling, "rope_theta": spec.theta})[1]


def cos_sin(freqs: torch.Tensor, positions: torch.Tensor, factor: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin of shape [..., s, dim // 2] (fp32) for integer positions [..., s], times `factor`
    (attention_factor)."""
    return rope_tables(freqs, positions, factor)


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary on the first 2 * cos.shape[-1] dims of each head of x [b, s, heads, d]; partial rotary (Phi-4-mini)
    passes the rest through."""
    rot = 2 * cos.shape[-1]
    if rot == x.shape[-1]:
        return kernels.apply_rotary(x, cos, sin)
    return torch.cat([kernels.apply_rotary(x[..., :rot], cos, sin), x[..., rot:]], dim=-1)
