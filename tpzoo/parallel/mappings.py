"""Autograd collectives for tensor and sequence parallelism: one Function per conjugate pair.

  region entry / exit                         forward           backward
  copy_to_tp                                  identity          all-reduce
  reduce_from_tp                              all-reduce        identity
  scatter_to_tp        (last dim)             split             all-gather
  gather_from_tp       (last dim)             all-gather        split
  scatter_to_sequence  (sequence dim)         split             all-gather
  gather_from_sequence (sequence dim)         all-gather        reduce-scatter
  reduce_scatter_to_sequence (sequence dim)   reduce-scatter    all-gather

`gather_from_sequence` reduce-scatters its gradient because the tensor it produces feeds a column-parallel
matmul on every rank: each rank holds a partial gradient of the full sequence, and the sum belongs to the owner
of each sequence chunk. With tensor parallelism of size 1 every function is the identity. (The column-parallel
layers do not use it: tpzoo.parallel.column_linear fuses the gather with their matmul, so that backward keeps
only the shard and gathers it again.)

`group`: the tensor-parallel group to use (layers pass their dims' tp_group); None = the default dims'.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from . import comm
from .dims import SELF_GROUP
from .eager import eager_apply
from .state import get_dims


def tp_layout(group) -> tuple[int, int, object]:
    """(size, rank, group) of a tensor-parallel group argument: None = the default dims' TP group."""
    if group is None:
        dims = get_dims()
        return dims.tp, dims.tp_rank, (dims.tp_group if dims.tp > 1 else SELF_GROUP)
    if group is SELF_GROUP:
        return 1, 0, group
    return dist.get_world_size(group), dist.get_rank(group), group


def _tp_group(group):
    return tp_layout(group)[2]


def _rank_size(group):
    size, rank, _ = tp_layout(group)
    return rank, size


class _CopyToTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x

    @staticmethod
    def backward(ctx, grad):
        return comm.all_reduce(grad.contiguous(), _tp_group(ctx.group)), None


class _ReduceFromTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        return comm.all_reduce(x.contiguous().clone(), _tp_group(group))

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class _ScatterToTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        rank, size = _rank_size(group)
        return comm.split_along(x, -1, rank, size)

    @staticmethod
    def backward(ctx, grad):
        return comm.all_gather(grad, _tp_group(ctx.group), dim=-1), None


class _GatherFromTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return comm.all_gather(x, _tp_group(group), dim=-1)

    @staticmethod
    def backward(ctx, grad):
        rank, size = _rank_size(ctx.group)
        return comm.split_along(grad, -1, rank, size), None


class _ScatterToSequence(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, dim, group):
        ctx.dim, ctx.group = dim, group
        rank, size = _rank_size(group)
        return comm.split_along(x, dim, rank, size)

    @staticmethod
    def backward(ctx, grad):
        return comm.all_gather(grad, _tp_group(ctx.group), dim=ctx.dim), None, None


class _GatherFromSequence(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, dim, group, reduce_grad):
        ctx.dim, ctx.group, ctx.reduce_grad = dim, group, reduce_grad
        return comm.all_gather(x, _tp_group(group), dim=dim)

    @staticmethod
    def backward(ctx, grad):
        if ctx.reduce_grad:
            return comm.reduce_scatter(grad, _tp_group(ctx.group), dim=ctx.dim), None, None, None
        rank, size = _rank_size(ctx.group)
        return comm.split_along(grad, ctx.dim, rank, size), None, None, None


class _ReduceScatterToSequence(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, dim, group):
        ctx.dim, ctx.group = dim, group
        return comm.reduce_scatter(x, _tp_group(group), dim=dim)

    @staticmethod
    def backward(ctx, grad):
        return comm.all_gather(grad, _tp_group(ctx.group), dim=ctx.dim), None, None


def _trivial(group) -> bool:
    return _rank_size(group)[1] == 1


def copy_to_tp(x: torch.Tensor, group=None) -> torch.Tensor:
    """Enter a tensor-parallel region with a replicated input: identity forward, all-reduce backward."""
    return x if _trivial(group) else eager_apply(_CopyToTP, x, group)


def reduce_from_tp(x: torch.Tensor, group=None) -> torch.Tensor:
    """Leave a tensor-parallel region by summing partial results: all-reduce forward, identity backward."""
    return x if _trivial(group) else eager_apply(_ReduceFromTP, x, group)


def scatter_to_tp(x: torch.Tensor, group=None) -> torch.Tensor:
    """Keep this rank's chunk of the last dim: split forward, all-gather backward."""
    return x if _trivial(group) else eager_apply(_ScatterToTP, x, group)


def gather_from_tp(x: torch.Tensor, group=None) -> torch.Tensor:
    """Concatenate the last dim over ranks: all-gather forward, split backward."""
    return x if _trivial(group) else eager_apply(_GatherFromTP, x, group)


def scatter_to_sequence(x: torch.Tensor, dim: int = -2, group=None) -> torch.Tensor:
    """Keep this rank's chunk of the sequence dim: split forward, all-gather backward."""
    return x if _trivial(group) else eager_apply(_ScatterToSequence, x, dim, group)


def gather_from_sequence(x: torch.Tensor, dim: int = -2, group=None, reduce_grad: bool = True) -> torch.Tensor:
    """All-gather the sequence dim; backward reduce-scatters (or only splits, with reduce_grad=False, when the
    gathered tensor is consumed identically on every rank)."""
    return x if _trivial(group) else eager_apply(_GatherFromSequence, x, dim, group, reduce_grad)


def reduce_scatter_to_sequence(x: torch.Tensor, dim: int = -2, group=None) -> torch.Tensor:
    """Sum partial results and keep this rank's sequence chunk: reduce-scatter forward, all-gather backward."""
    return x if _trivial(group) else eager_apply(_ReduceScatterToSequence, x, dim, group)
