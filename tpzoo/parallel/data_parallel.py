"""Data-parallel gradient reduction: all-reduce SUM over the data-parallel group, in flat fp32 buckets.

Buckets: one all-reduce per ~25 MB instead of one per parameter (latency), without one model-sized temporary
(memory). Reduction in fp32 even for bf16 gradients: summing many replicas in bf16 loses the low bits that a
small learning rate depends on. The sum (not the mean) is reduced because the training loop already scales each
micro-batch's loss by 1 / (tokens of the global batch), so the sum is the gradient of the global mean loss.

Every replica must hold the same parameters with the same gradients present (true for replicas of one model
chunk: the `.grad is None` pattern is structural), since the buckets are formed locally.
"""
from __future__ import annotations

import torch

from . import comm
from .state import get_state

DEFAULT_BUCKET_MB = 25.0


def dp_group():
    """The group gradients are averaged over: data parallel (times context parallel when cp > 1)."""
    state = get_state()
    return state.groups["dp_cp"] if state.cp > 1 else state.groups["dp"]


def grad_buckets(params: list[torch.nn.Parameter], bucket_mb: float = DEFAULT_BUCKET_MB) -> list[list]:
    """Parameters with a gradient, in order, grouped so that each group's fp32 gradients fit ~bucket_mb
    (a larger parameter gets a bucket of its own)."""
    limit = max(1, int(bucket_mb * 2**20) // 4)
    buckets, current, size = [], [], 0
    for p in params:
        if p.grad is None:
            continue
        if current and size + p.grad.numel() > limit:
            buckets.append(current)
            current, size = [], 0
        current.append(p)
        size += p.grad.numel()
    if current:
        buckets.append(current)
    return buckets


def allreduce_gradients(params, group=None, bucket_mb: float = DEFAULT_BUCKET_MB) -> int:
    """Sum `params`' gradients over `group` (default: the data-parallel group). Returns the bucket count."""
    group = dp_group() if group is None else group
    if torch.distributed.get_world_size(group) == 1:
        return 0
    unique = list({id(p): p for p in params}.values())  # a tied weight listed twice is reduced once
    buckets = grad_buckets(unique, bucket_mb)
    for bucket in buckets:
        flat = torch.cat([p.grad.reshape(-1).to(torch.float32) for p in bucket])
        comm.all_reduce(flat, group)
        offset = 0
        for p in bucket:
            n = p.grad.numel()
            p.grad.copy_(flat[offset: offset + n].view_as(p.grad))
            offset += n
    return len(buckets)
