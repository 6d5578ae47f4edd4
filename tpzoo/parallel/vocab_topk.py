"""Top-K log-probabilities over a vocabulary split across tensor-parallel ranks, never gathering a vocabulary row.

Distillation (tpzoo.post.distill) needs, per token, the teacher's K most likely ids with their log-probabilities
and the student's log-probabilities at those ids. Under TP each rank holds a logits shard [..., V'/tp] (this
rank's vocabulary entries; padded entries past the real vocabulary never count), so each is assembled from
per-shard pieces:

  vocab_parallel_topk(z, k): each rank's own top-k (values and global ids) is all-gathered (2k numbers per token
      and rank), the global top-k taken among the tp * k candidates (the k largest of the vocabulary are among
      them: each lies in some shard's top k); log Z from the shards' maxima (all-reduce max) and sums of
      exponentials (all-reduce sum). No gradient (a frozen teacher).
  vocab_parallel_log_softmax_at(z, ids, temperature): log softmax(z / T) at the global `ids` [..., k], with its
      gradient. Forward: log Z of z / T over the shards (all-reduce max, all-reduce sum), each rank's z / T at the
      ids inside its shard (0 elsewhere), summed over the ranks (all-reduce of [..., k]). Backward: the incoming
      gradient g [..., k] is the same on every rank (each computes the loss from the same reduced values), so
      d/dz_j = (sum_k g_k [j == id_k] - softmax_j * sum_k g_k) / T on this rank's own entries: no collective.

Sent per token: 2k + 2 numbers (top-k), k + 2 (log-softmax at ids), against V'/tp for a gathered row.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from . import comm
from .mappings import tp_layout


def _real_shard(z: torch.Tensor, vocab_size: int | None, tp: int, rank: int) -> tuple[torch.Tensor, int]:
    """(the shard in fp32 (fp64 kept) with padded entries at -inf, this rank's first global id)."""
    local = z.shape[-1]
    start = rank * local
    real = local if vocab_size is None else max(0, min(local, vocab_size - start))
    z = z.to(torch.promote_types(z.dtype, torch.float32))
    if real < local:
        z = z.clone()
        z[..., real:] = float("-inf")
    return z, start


def _log_z(z: torch.Tensor, group, tp: int) -> torch.Tensor:
    """log sum_j exp z_j over every shard of the vocabulary ([...]); z holds -inf on padded entries."""
    top = z.max(-1).values
    if tp > 1:
        comm.all_reduce(top, group, op=dist.ReduceOp.MAX)
    sum_exp = (z - top.unsqueeze(-1)).exp().sum(-1)
    if tp > 1:
        comm.all_reduce(sum_exp, group)
    return top + sum_exp.log()


@torch.no_grad()
def vocab_parallel_topk(logits_shard: torch.Tensor, k: int, vocab_size: int | None = None,
                        group=None) -> tuple[torch.Tensor, torch.Tensor]:
    """(ids [..., k] int64, log-probabilities [..., k] fp32) of the k most likely tokens, largest first, from this
    rank's vocab shard; the same on every rank of `group` (the TP group; None: the default dims')."""
    tp, rank, group = tp_layout(group)
    z, start = _real_shard(logits_shard, vocab_size, tp, rank)
    real = vocab_size if vocab_size is not None else z.shape[-1] * tp
    if not 1 <= k <= real:
        raise ValueError(f"top-k: k={k} must be in [1, {real}] (the vocabulary)")
    kk = min(k, z.shape[-1])
    values, ids = z.topk(kk, dim=-1)
    ids = ids + start
    if tp > 1:  # every rank's candidates: [tp * kk] per token
        values = comm.all_gather(values.contiguous(), group, dim=-1)
        ids = comm.all_gather(ids.contiguous(), group, dim=-1)
        values, pick = values.topk(k, dim=-1)
        ids = ids.gather(-1, pick)
    log_z = _log_z(z, group, tp)
    return ids, (values - log_z.unsqueeze(-1)).float()


class _LogSoftmaxAt(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits_shard, ids, temperature, vocab_size, group):
        tp, rank, group = tp_layout(group)
        z, start = _real_shard(logits_shard, vocab_size, tp, rank)
        z = z / temperature
        log_z = _log_z(z, group, tp)
        local = ids - start
        mine = (local >= 0) & (local < z.shape[-1])
        picked = z.gather(-1, local.clamp(0, z.shape[-1] - 1)).masked_fill(~mine, 0.0)
        if tp > 1:
            comm.all_reduce(picked, group)
        ctx.save_for_backward(z, log_z, local, mine)
        ctx.temperature, ctx.in_dtype = temperature, logits_shard.dtype
        return picked - log_z.unsqueeze(-1)

    @staticmethod
    def backward(ctx, grad):
        z, log_z, local, mine = ctx.saved_tensors
        grad = grad.to(z.dtype)
        out = (z - log_z.unsqueeze(-1)).exp_().mul_(-grad.sum(-1, keepdim=True))  # padded entries: exp(-inf) = 0
        out.scatter_add_(-1, local.clamp(0, z.shape[-1] - 1), grad.masked_fill(~mine, 0.0))
        return (out / ctx.temperature).to(ctx.in_dtype), None, None, None, None


def vocab_parallel_log_softmax_at(logits_shard: torch.Tensor, ids: torch.Tensor, temperature: float = 1.0,
                                  vocab_size: int | None = None, group=None) -> torch.Tensor:
    """log softmax(logits / temperature) over the whole (real) vocabulary at the global `ids` [..., k] (int64),
    from this rank's vocab shard [..., V'/tp]; differentiable with respect to the shard."""
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    if tuple(ids.shape[:-1]) != tuple(logits_shard.shape[:-1]):
        raise ValueError(f"ids {tuple(ids.shape)} do not match the logits {tuple(logits_shard.shape)}")
    return _LogSoftmaxAt.apply(logits_shard, ids.long(), float(temperature), vocab_size, group)
