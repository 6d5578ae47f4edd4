"""How a full tensor maps onto tensor-parallel shards, and back.

One ShardSpec describes every layout tpzoo uses, so layers, checkpoints and tests share one implementation:
  - replicated (dim=None);
  - a plain split of `dim` into tp contiguous chunks;
  - fused tensors (gate|up of SwiGLU, q|k|v): the full tensor is the concatenation of `parts` along `dim`,
    each part is split separately and a rank's shard is the concatenation of its chunks of every part;
  - replicated heads (grouped-query attention with fewer kv heads than tp): a part with `replicas` k > 1 is
    first expanded by repeating each block of `block` rows k times, then split; the k ranks that share a block
    hold identical copies, and their gradients are partial (summed by `unshard(..., reduce="sum")`).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .dims import ParallelLayoutError


@dataclass(frozen=True)
class ShardSpec:
    dim: int | None = 0
    parts: tuple[int, ...] | None = None
    replicas: tuple[int, ...] | None = None
    block: int = 1

    def _parts(self, full_size: int) -> list[tuple[int, int]]:
        parts = self.parts or (full_size,)
        reps = self.replicas or (1,) * len(parts)
        if sum(parts) != full_size:
            raise ValueError(f"fused parts {parts} do not add up to {full_size}")
        return list(zip(parts, reps))

    def local_size(self, full_size: int, tp: int) -> int:
        total = 0
        for size, rep in self._parts(full_size):
            total += _divide_part(size * rep, tp)
        return total

    @property
    def replicated(self) -> bool:
        return self.dim is None


def _divide_part(n: int, tp: int) -> int:
    if n % tp:
        raise ParallelLayoutError(f"a tensor-parallel part of size {n} is not divisible by tp={tp}")
    return n // tp


def _expand(piece: torch.Tensor, dim: int, rep: int, block: int) -> torch.Tensor:
    if rep == 1:
        return piece
    n = piece.shape[dim] // block
    shape = list(piece.shape)
    viewed = piece.unflatten(dim, (n, block))
    return viewed.repeat_interleave(rep, dim=dim).flatten(dim, dim + 1).reshape(
        shape[:dim] + [n * rep * block] + shape[dim + 1:])


def shard(full: torch.Tensor, spec: ShardSpec, rank: int, tp: int) -> torch.Tensor:
    """This rank's shard of `full`."""
    if spec.dim is None:
        return full
    dim = spec.dim % full.dim()
    chunks, offset = [], 0
    for size, rep in spec._parts(full.shape[dim]):
        piece = _expand(full.narrow(dim, offset, size), dim, rep, spec.block)
        n = _divide_part(size * rep, tp)
        chunks.append(piece.narrow(dim, rank * n, n))
        offset += size
    return torch.cat(chunks, dim=dim).contiguous() if len(chunks) > 1 else chunks[0].contiguous()


def unshard(shards: list[torch.Tensor], spec: ShardSpec, reduce: str = "first") -> torch.Tensor:
    """The full tensor from every rank's shard (rank order). Replicated blocks: keep the first copy
    (`reduce="first"`, for values) or sum the copies (`reduce="sum"`, for partial gradients)."""
    if spec.dim is None:
        return shards[0]
    tp = len(shards)
    dim = spec.dim % shards[0].dim()
    local = shards[0].shape[dim]
    parts = spec.parts
    reps = spec.replicas or ((1,) * len(parts) if parts else (1,))
    if parts is None:
        parts = (local * tp // reps[0],)
    out, offset = [], 0
    for size, rep in zip(parts, reps):
        n = _divide_part(size * rep, tp)
        expanded = torch.cat([s.narrow(dim, offset, n) for s in shards], dim=dim)
        if rep > 1:
            heads = size // spec.block
            v = expanded.unflatten(dim, (heads, rep, spec.block))
            v = v.sum(dim=dim + 1) if reduce == "sum" else v.select(dim + 1, 0)
            expanded = v.flatten(dim, dim + 1)
        out.append(expanded)
        offset += n
    return torch.cat(out, dim=dim) if len(out) > 1 else out[0]
