"""Where a kept-quantized tensor's scales go when its weight is sharded, and the rule that keeps blocks whole.

A quantized tpzoo tensor (a linear weight [out, in], or stacked experts [E, out, in]) has its blocks (fp8: 128 x 128,
int4: 1 x group) on its last two dims. Its scale tensor is laid out like the weight, one entry per block, with the
weight's ShardSpec in block units: a fused weight's parts (q|k|v, gate|up) each have their own blocks (a part's last
block may be partial), so the scale's parts are ceil(part / unit). Tensor parallelism may only cut along whole
blocks: every rank's share of every part must be a multiple of the unit (and a replicated kv head a whole number of
blocks); otherwise the layout is refused, naming the tensor. Expert parallelism splits dim 0 (whole experts).
"""
from __future__ import annotations

import torch

from tpzoo.parallel.dims import ParallelLayoutError
from tpzoo.parallel.sharding import ShardSpec


def _axis(spec: ShardSpec, ndim: int) -> int | None:
    """The blocked axis (0: rows, 1: columns of the last two dims) the spec splits or fuses, else None."""
    if spec.dim is None:
        return None
    d = spec.dim % ndim
    return d - (ndim - 2) if d >= ndim - 2 else None


def scale_spec(fmt, spec: ShardSpec, ndim: int) -> ShardSpec:
    """The scale tensor's ShardSpec: the weight's, in blocks along the blocked axis it splits."""
    axis = _axis(spec, ndim)
    if axis is None:
        return spec
    unit = fmt.units()[axis]
    parts = tuple(-(-p // unit) for p in spec.parts) if spec.parts else None
    block = max(1, spec.block // unit) if spec.replicas else spec.block
    return ShardSpec(spec.dim, parts, spec.replicas, block)


def scale_full_shape(fmt, full: tuple, spec: ShardSpec) -> tuple:
    """The full scale tensor's shape: ceil(dim / unit) on the last two dims, summed part by part when fused."""
    shape = list(fmt.scale_shape(full))
    axis = _axis(spec, len(full))
    if axis is not None and spec.parts:
        shape[len(full) - 2 + axis] = sum(-(-p // fmt.units()[axis]) for p in spec.parts)
    return tuple(shape)


def check_whole_blocks(fmt, name: str, full: tuple, spec: ShardSpec, tp: int) -> None:
    """Refuse (one line naming `name`) a tensor-parallel split that would cut a block of a quantized tensor."""
    axis = _axis(spec, len(full))
    if axis is None or tp == 1:
        return
    unit, what = fmt.units()[axis], ("rows", "columns")[axis]
    d = spec.dim % len(full)
    parts = spec.parts or (full[d],)
    reps = spec.replicas or (1,) * len(parts)
    for size, rep in zip(parts, reps):
        share = size * rep // tp
        if (size * rep) % tp or share % unit or (rep > 1 and spec.block % unit):
            raise ParallelLayoutError(
                f"{name}: tp={tp} would cut its {fmt.name} blocks ({what} in units of {unit}: a part of {size} "
                f"{what}{f' replicated {rep}x' if rep > 1 else ''} gives {size * rep / tp:g} per rank); choose a tp "
                f"that splits it along whole blocks, or convert without --keep-quantized")


def block_index(fmt, spec: ShardSpec, full: tuple, rank: int, tp: int, axis: int) -> torch.Tensor:
    """For each index of this rank's weight shard along blocked axis `axis` (0 rows, 1 columns), the index of its
    block in this rank's scale shard (int64, on the CPU)."""
    from tpzoo.checkpoint.layout import local_segments

    nd = len(full)
    d = nd - 2 + axis
    unit = fmt.units()[axis]
    if _axis(spec, nd) != axis:  # not split nor fused along this axis
        return torch.arange(full[d]) // unit
    sspec = scale_spec(fmt, spec, nd)
    sfull = scale_full_shape(fmt, full, spec)
    parts = list(spec.parts or (full[d],))
    starts = torch.tensor([0] + parts).cumsum(0)
    sstarts = torch.tensor([0] + [-(-p // unit) for p in parts]).cumsum(0)
    f = torch.cat([torch.arange(s, s + n) for s, n in local_segments(spec, full[d], rank, tp)])
    j = torch.searchsorted(starts[1:], f, right=True)
    full_block = sstarts[j] + (f - starts[j]) // unit
    where = torch.full((sfull[d],), -1, dtype=torch.int64)
    held = torch.cat([torch.arange(s, s + n) for s, n in local_segments(sspec, sfull[d], rank, tp)])
    where[held.flip(0)] = torch.arange(held.numel() - 1, -1, -1)  # the first copy of a repeated block wins
    out = where[full_block]
    if (out < 0).any():
        raise ParallelLayoutError(f"a quantized shard's blocks are not on its rank (tp={tp}, spec {spec})")
    return out


def full_logical_shape(local: tuple, spec: ShardSpec, tp: int) -> tuple:
    """The full (unpadded) shape of a tensor from its shard shape and spec (checkpoint.layout.param_infos' rule;
    quantized tensors are never vocabulary-sized)."""
    full = list(local)
    if spec.dim is not None:
        d = spec.dim % len(full)
        full[d] = sum(spec.parts) if spec.parts else local[d] * tp
    return tuple(full)
