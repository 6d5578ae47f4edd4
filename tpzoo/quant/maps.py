"""The Hugging Face tensor map of a kept-quantized model: the family's map with each quantized weight under its
stored HF name (int4: `<module>.weight_packed`) and one more map per quantized weight for its scales.

A scale map reuses the weight map's `to_tpzoo` (the families' mappings only concatenate, stack and transpose, so
they apply to the smaller scale tensors unchanged: a fused q|k|v's scales are q's, k's and v's concatenated, a
stacked experts' scales stacked alike). Its `to_hf` is that function inverted by probing it with element indices
(scale-sized, computed when used), since the families' own `to_hf` split by weight sizes.
"""
from __future__ import annotations

import math

import torch

from tpzoo.models.hf_mapping import TensorMap

from .formats import QuantError


def _inverse(to_tpzoo, shapes: list[tuple], name: str):
    """to_hf for tensors laid out by `to_tpzoo` from HF tensors of `shapes` (a pure rearrangement)."""
    def to_hf(x: torch.Tensor) -> list:
        if x.device.type == "meta":
            return [torch.empty(s, dtype=x.dtype, device="meta") for s in shapes]
        sizes = [math.prod(s) for s in shapes]
        probes, offset = [], 0
        for s, n in zip(shapes, sizes):
            probes.append(torch.arange(offset, offset + n, dtype=torch.int64).reshape(s))
            offset += n
        index = to_tpzoo(probes).reshape(-1)
        if index.numel() != offset or tuple(x.shape) != tuple(to_tpzoo(probes).shape):
            raise QuantError(f"{name}: its HF mapping is not a rearrangement of its parts; cannot split its scales")
        where = torch.empty(offset, dtype=torch.int64)
        where[index] = torch.arange(offset)
        flat, out, offset = x.reshape(-1), [], 0
        for s, n in zip(shapes, sizes):
            out.append(flat.index_select(0, where[offset:offset + n].to(flat.device)).reshape(s))
            offset += n
        return out
    return to_hf


def kept_maps(fmt, maps: list, quantized: set, hf_logical_shape) -> list:
    """The family's `maps` for a model whose tpzoo tensors in `quantized` are kept: stored HF names, plus a scale
    map for each (`hf_logical_shape(hf weight name)`: that HF weight's unquantized shape)."""
    out = []
    for m in maps:
        if m.name not in quantized:
            out.append(m)
            continue
        weight = TensorMap(m.name, tuple(fmt.hf_weight(h) for h in m.hf), m.to_tpzoo, m.to_hf, m.vocab_dim,
                           m.export, m.layer, m.rows)
        shapes = [tuple(fmt.scale_shape(hf_logical_shape(h))) for h in m.hf]
        scale = TensorMap(m.name + fmt.scale_suffix, tuple(fmt.hf_scale(h) for h in m.hf), m.to_tpzoo,
                          _inverse(m.to_tpzoo, shapes, m.name), layer=m.layer, export=m.export)
        out += [weight, scale]
    return out
