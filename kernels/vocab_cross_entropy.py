"""Vocab-parallel cross-entropy in Triton: the semantics of tpzoo.parallel.vocab_parallel_cross_entropy.

Forward: one streaming pass over each row of this rank's logits shard (one program per row, the vocabulary in
blocks, online max/sum-exp) gives per-row fp32 statistics: local max, sum of exp relative to it, sum of the
real logits and the target logit. Everything else is per-row torch arithmetic and the same two TP
all-reduces as the reference (max; then [target logit, sum exp, sum logits]). The forward saves the logits
(no copy) and one fp32 per row (log-sum-exp).

Backward: one pass per row writes softmax - (1 - eps) onehot - eps / V (0 on padded entries) times the
incoming per-token gradient, in the logits' dtype: into a new buffer, or into the logits buffer itself with
inplace_backward. No fp32 copy of the logits exists at any point.

The gradient is written in the backward, not in the forward (as some fused losses do): the loss is per token,
so the forward cannot know each row's incoming gradient and a gradient written early would need a second
pass to scale it; writing it in the backward reads the logits twice and writes them once in all.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
import triton
import triton.language as tl

from tpzoo.parallel import comm
from tpzoo.parallel.cross_entropy import loss_from_sums
from tpzoo.parallel.mappings import tp_layout

from . import launch


@triton.jit
def _ce_fwd(Z, TARGET, STATS, M, stride_z, n_real, local_vocab, start, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    z_row = Z + row * stride_z
    m = -float("inf")
    s = 0.0
    sum_z = tl.zeros([BLOCK], dtype=tl.float32)
    for off in range(0, n_real, BLOCK):  # padded entries (cols >= n_real) never take part
        cols = off + tl.arange(0, BLOCK)
        mask = cols < n_real
        z = tl.load(z_row + cols, mask=mask, other=-float("inf")).to(tl.float32)
        m_new = tl.maximum(m, tl.max(z, axis=0))
        s = s * tl.exp(m - m_new) + tl.sum(tl.exp(z - m_new), axis=0)
        sum_z += tl.where(mask, z, 0.0)
        m = m_new
    t = tl.load(TARGET + row) - start
    in_shard = (t >= 0) & (t < local_vocab)
    z_t = tl.load(z_row + t, mask=in_shard, other=0.0).to(tl.float32)
    tl.store(STATS + row, m)
    tl.store(STATS + M + row, s)
    tl.store(STATS + 2 * M + row, tl.sum(sum_z, axis=0))
    tl.store(STATS + 3 * M + row, z_t)


@triton.jit
def _ce_bwd(Z, DZ, TARGET, LSE, SCALE, stride_z, stride_dz, n_real, local_vocab, start, smooth_per_entry,
            target_weight, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    z_row = Z + row * stride_z
    dz_row = DZ + row * stride_dz
    lse = tl.load(LSE + row)
    scale = tl.load(SCALE + row)  # incoming gradient, 0 for ignored tokens
    t = tl.load(TARGET + row) - start
    for off in range(0, local_vocab, BLOCK):
        cols = off + tl.arange(0, BLOCK)
        real = cols < n_real
        z = tl.load(z_row + cols, mask=real, other=-float("inf")).to(tl.float32)
        g = tl.exp(z - lse) - smooth_per_entry - tl.where(cols == t, target_weight, 0.0)
        g = tl.where(real, g * scale, 0.0)
        tl.store(dz_row + cols, g.to(DZ.dtype.element_ty), mask=cols < local_vocab)


class CrossEntropyFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, target, ignore_index, label_smoothing, vocab_size, group, inplace_backward):
        tp_size, tp_rank, group = tp_layout(group)
        local_vocab = logits.shape[-1]
        start = tp_rank * local_vocab
        vocab_size = vocab_size if vocab_size is not None else local_vocab * tp_size
        n_real = max(0, min(local_vocab, vocab_size - start))
        z2 = launch.as_rows(logits, local_vocab)
        tgt = target.reshape(-1).contiguous()
        rows = z2.shape[0]

        stats = torch.empty((4, rows), dtype=torch.float32, device=logits.device)
        block = launch.block_size(local_vocab)
        if rows:
            launch.run(_ce_fwd, (rows,), z2, tgt, stats, rows, z2.stride(0), n_real, local_vocab, start, BLOCK=block,
                       num_warps=launch.num_warps(block))
        m_local, s_local, sum_z, z_t = stats.unbind(0)
        m = m_local.clone()
        if tp_size > 1:
            comm.all_reduce(m, group, op=dist.ReduceOp.MAX)
        in_shard = (tgt >= start) & (tgt < start + local_vocab)
        sum_shifted = sum_z - n_real * m if n_real > 0 else torch.zeros_like(sum_z)
        # exp(m_local - m) rescales this shard's sum to the global max (0 for an all-padding shard)
        sums = torch.stack([torch.where(in_shard, z_t - m, 0.0), s_local * torch.exp(m_local - m), sum_shifted])
        if tp_size > 1:
            comm.all_reduce(sums, group)
        target_logit, sum_exp, sum_shifted = sums.unbind(0)

        loss, log_z, ignored = loss_from_sums(target_logit, sum_exp, sum_shifted, tgt, ignore_index,
                                              label_smoothing, vocab_size)

        ctx.save_for_backward(z2, tgt, m + log_z, ignored)
        ctx.layout = (n_real, local_vocab, start, vocab_size, label_smoothing)
        ctx.shape, ctx.inplace, ctx.block = logits.shape, inplace_backward, block
        return loss.view(target.shape)

    @staticmethod
    def backward(ctx, grad_loss):
        z2, tgt, lse, ignored = ctx.saved_tensors
        n_real, local_vocab, start, vocab_size, eps = ctx.layout
        scale = grad_loss.reshape(-1).float().masked_fill(ignored, 0.0).contiguous()
        grad = z2 if ctx.inplace else torch.empty(z2.shape, dtype=z2.dtype, device=z2.device)
        rows = z2.shape[0]
        if rows:
            launch.run(_ce_bwd, (rows,), z2, grad, tgt, lse, scale, z2.stride(0), grad.stride(0), n_real,
                       local_vocab, start, eps / vocab_size, 1.0 - eps, BLOCK=ctx.block,
                       num_warps=launch.num_warps(ctx.block))
        if ctx.inplace:  # the logits now hold their gradient: anyone else who saved them must fail loudly
            torch.autograd.graph.increment_version(z2)
        return grad.view(ctx.shape), None, None, None, None, None, None


def cross_entropy(logits_shard, target, ignore_index=-100, label_smoothing=0.0, vocab_size=None, group=None,
                  inplace_backward=False):
    return CrossEntropyFunction.apply(logits_shard, target, ignore_index, label_smoothing, vocab_size, group,
                                      inplace_backward)


INTERPRETED = not isinstance(_ce_fwd, triton.runtime.JITFunction)
