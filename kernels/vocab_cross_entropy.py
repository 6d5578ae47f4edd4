"""Vocab-parallel cross-entropy in Triton: the semantics of tpzoo.parallel.vocab_parallel_cross_entropy.

Forward: one streaming pass over each row of this rank's logits shard (one program per row, the vocabulary in
blocks, online max/sum-exp) gives per-row fp32 statistics: local max, sum of exp relative to it, sum of the
real logits and the target logit. Everything else is per-row torch arithmetic and the same two TP
all-reduces as the reference (max; then [target logit, sum exp, sum logits]). The forward saves the logits
(no copy) and one fp32 per row (log-sum-exp).

Backward: one pass per row writes softmax (1 + 2 z_loss logZ) - (1 - eps) onehot - eps / V (0 on padded
entries) times the incoming per-token gradient, in the logits' dtype: into a new buffer, or into the logits
buffer itself with inplace_backward. No fp32 copy of the logits exists at any point.

`row_stats` and `write_grad` run the two kernels on a block of rows alone: the fused linear cross-entropy
(fused_linear_cross_entropy.py) calls them on each chunk of logits it computes.

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
            target_weight, z_loss, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    z_row = Z + row * stride_z
    dz_row = DZ + row * stride_dz
    lse = tl.load(LSE + row)
    scale = tl.load(SCALE + row)  # incoming gradient, 0 for ignored tokens
    soft = 1.0 + 2.0 * z_loss * lse  # the z-loss's gradient is 2 z_loss logZ softmax
    t = tl.load(TARGET + row) - start
    for off in range(0, local_vocab, BLOCK):
        cols = off + tl.arange(0, BLOCK)
        real = cols < n_real
        z = tl.load(z_row + cols, mask=real, other=-float("inf")).to(tl.float32)
        g = tl.exp(z - lse) * soft - smooth_per_entry - tl.where(cols == t, target_weight, 0.0)
        g = tl.where(real, g * scale, 0.0)
        tl.store(dz_row + cols, g.to(DZ.dtype.element_ty), mask=cols < local_vocab)


def row_stats(z2: torch.Tensor, target: torch.Tensor, n_real: int, start: int) -> torch.Tensor:
    """[4, rows] fp32 of the rows of `z2` ([rows, local_vocab], unit column stride): the max over the real
    entries, the sum of exp relative to it, the sum of the real logits, the target logit (0 when the target is
    in another shard)."""
    rows, local_vocab = z2.shape
    stats = torch.empty((4, rows), dtype=torch.float32, device=z2.device)
    block = launch.block_size(local_vocab)
    if rows:
        launch.run(_ce_fwd, (rows,), z2, target, stats, rows, z2.stride(0), n_real, local_vocab, start, BLOCK=block,
                   num_warps=launch.num_warps(block))
    return stats


def write_grad(z2: torch.Tensor, out: torch.Tensor, target: torch.Tensor, lse: torch.Tensor, scale: torch.Tensor,
               n_real: int, start: int, label_smoothing: float, vocab_size: int, z_loss: float) -> torch.Tensor:
    """out[r] = (softmax(z2[r]) (1 + 2 z_loss lse[r]) - eps/V - (1 - eps) onehot) * scale[r], 0 on padded
    entries, in out's dtype; `out` may be `z2` itself. lse: the rows' absolute log-sum-exp (fp32); scale: fp32,
    0 for ignored rows."""
    rows, local_vocab = z2.shape
    block = launch.block_size(local_vocab)
    if rows:
        launch.run(_ce_bwd, (rows,), z2, out, target, lse, scale, z2.stride(0), out.stride(0), n_real, local_vocab,
                   start, label_smoothing / vocab_size, 1.0 - label_smoothing, float(z_loss), BLOCK=block,
                   num_warps=launch.num_warps(block))
    return out


class CrossEntropyFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, target, ignore_index, label_smoothing, vocab_size, group, inplace_backward, z_loss):
        tp_size, tp_rank, group = tp_layout(group)
        local_vocab = logits.shape[-1]
        start = tp_rank * local_vocab
        vocab_size = vocab_size if vocab_size is not None else local_vocab * tp_size
        n_real = max(0, min(local_vocab, vocab_size - start))
        z2 = launch.as_rows(logits, local_vocab)
        tgt = target.reshape(-1).contiguous()

        m_local, s_local, sum_z, z_t = row_stats(z2, tgt, n_real, start).unbind(0)
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
                                              label_smoothing, vocab_size, z_loss, m)

        ctx.save_for_backward(z2, tgt, m + log_z, ignored)
        ctx.layout = (n_real, start, vocab_size, label_smoothing, z_loss)
        ctx.shape, ctx.inplace = logits.shape, inplace_backward
        return loss.view(target.shape)

    @staticmethod
    def backward(ctx, grad_loss):
        z2, tgt, lse, ignored = ctx.saved_tensors
        n_real, start, vocab_size, eps, z_loss = ctx.layout
        scale = grad_loss.reshape(-1).float().masked_fill(ignored, 0.0).contiguous()
        grad = z2 if ctx.inplace else torch.empty(z2.shape, dtype=z2.dtype, device=z2.device)
        write_grad(z2, grad, tgt, lse, scale, n_real, start, eps, vocab_size, z_loss)
        if ctx.inplace:  # the logits now hold their gradient: anyone else who saved them must fail loudly
            torch.autograd.graph.increment_version(z2)
        return grad.view(ctx.shape), None, None, None, None, None, None, None


def cross_entropy(logits_shard, target, ignore_index=-100, label_smoothing=0.0, vocab_size=None, group=None,
                  inplace_backward=False, z_loss=0.0):
    return CrossEntropyFunction.apply(logits_shard, target, ignore_index, label_smoothing, vocab_size, group,
                                      inplace_backward, z_loss)


INTERPRETED = not isinstance(_ce_fwd, triton.runtime.JITFunction)
