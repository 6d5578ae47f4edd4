"""Cross-entropy over vocab-sharded logits, without ever gathering the full vocabulary.

Two collectives per call: an all-reduce (max) of one scalar per token, and one all-reduce (sum) of three
scalars per token (target logit, sum of exponentials, sum of logits for label smoothing).

Label smoothing follows torch.nn.functional.cross_entropy: the smoothing mass eps is spread over the *full*
vocabulary V (the real one, padding excluded), so
    loss = (1 - eps) * (logZ - z_target) + eps * (logZ - sum_j z_j / V).
Megatron-LM (issue #737) divides by the local shard's vocab size instead, which is wrong for tp > 1.

z-loss (PaLM; OLMo 2's pretraining): `z_loss` * logZ^2 is added to every trained token's loss (logZ the
log-sum-exp of its logits, the real vocabulary); it keeps logZ near 0. Its gradient is 2 z_loss logZ softmax.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from . import comm
from .mappings import tp_layout


def loss_from_sums(target_logit, sum_exp, sum_shifted, target, ignore_index: int, label_smoothing: float,
                   vocab_size: int, z_loss: float = 0.0, row_max=None):
    """Per-token loss from the all-reduced sums (all relative to the global row max `row_max`): the target
    logit, the sum of exponentials and the sum of real logits. Returns (loss, log Z relative to the max,
    ignored mask); shared by the torch path, the Triton kernel's wrapper and the fused linear cross-entropy.
    `row_max` is needed only for the z-loss (which takes the absolute log Z)."""
    log_z = sum_exp.log()
    loss = log_z - target_logit
    if label_smoothing > 0:
        loss = (1.0 - label_smoothing) * loss + label_smoothing * (log_z - sum_shifted / vocab_size)
    if z_loss:
        loss = loss + z_loss * (row_max + log_z).square()
    ignored = target == ignore_index
    return loss.masked_fill(ignored, 0.0), log_z, ignored


class _VocabParallelCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, target, ignore_index, label_smoothing, vocab_size, group, z_loss):
        tp_size, tp_rank, group = tp_layout(group)
        local_vocab = logits.shape[-1]
        start = tp_rank * local_vocab
        vocab_size = vocab_size if vocab_size is not None else local_vocab * tp_size

        z = logits.to(torch.promote_types(logits.dtype, torch.float32))  # fp32, or fp64 logits kept (parity tests)
        n_real_local = max(0, min(local_vocab, vocab_size - start))
        if n_real_local < local_vocab:  # padded vocab entries never take part
            z = z.clone()
            z[..., n_real_local:] = float("-inf")

        z_max = z.max(dim=-1).values
        if tp_size > 1:
            comm.all_reduce(z_max, group, op=dist.ReduceOp.MAX)
        shifted = z - z_max.unsqueeze(-1)

        in_shard = (target >= start) & (target < start + local_vocab)
        local_target = (target - start).masked_fill(~in_shard, 0)
        target_logit = shifted.gather(-1, local_target.unsqueeze(-1)).squeeze(-1).masked_fill(~in_shard, 0.0)
        exp = shifted.exp()
        sums = torch.stack([target_logit, exp.sum(-1), shifted[..., :n_real_local].sum(-1)], dim=0)
        if tp_size > 1:
            comm.all_reduce(sums, group)
        target_logit, sum_exp, sum_shifted = sums[0], sums[1], sums[2]

        loss, log_z, ignored = loss_from_sums(target_logit, sum_exp, sum_shifted, target, ignore_index,
                                              label_smoothing, vocab_size, z_loss, z_max)

        exp.div_(sum_exp.unsqueeze(-1))  # softmax, reused for the gradient
        if z_loss:  # d(z_loss logZ^2)/dz = 2 z_loss logZ softmax: folded into the softmax once
            exp.mul_((1.0 + 2.0 * z_loss * (z_max + log_z)).unsqueeze(-1))
        ctx.save_for_backward(exp, in_shard, local_target, ignored)
        ctx.label_smoothing, ctx.vocab_size, ctx.n_real_local = label_smoothing, vocab_size, n_real_local
        ctx.in_dtype = logits.dtype
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        softmax, in_shard, local_target, ignored = ctx.saved_tensors
        eps = ctx.label_smoothing
        grad = softmax
        grad.scatter_add_(-1, local_target.unsqueeze(-1),
                          -(1.0 - eps) * in_shard.unsqueeze(-1).to(grad.dtype))
        if eps > 0:
            grad[..., : ctx.n_real_local] -= eps / ctx.vocab_size
        grad.mul_((grad_loss * (~ignored)).unsqueeze(-1))
        return grad.to(ctx.in_dtype), None, None, None, None, None, None


def vocab_parallel_cross_entropy(logits_shard: torch.Tensor, target: torch.Tensor, ignore_index: int = -100,
                                 label_smoothing: float = 0.0, vocab_size: int | None = None,
                                 group=None, z_loss: float = 0.0) -> torch.Tensor:
    """Per-token loss (shape of `target`, 0 where ignored) from this rank's vocab shard `[..., V'/tp]`.

    `vocab_size` is the real vocabulary when the shards are padded (entries past it are excluded from the
    softmax and the smoothing); by default every entry is real. Average the result over the tokens that are
    not ignored to get torch's `reduction="mean"`. `z_loss` > 0 adds z_loss * logZ^2 per trained token.
    """
    check_loss_args(logits_shard.shape[:-1], target.shape, label_smoothing, z_loss)
    return _VocabParallelCrossEntropy.apply(logits_shard, target, ignore_index, label_smoothing, vocab_size, group,
                                            z_loss)


def check_loss_args(rows_shape, target_shape, label_smoothing: float, z_loss: float) -> None:
    """The argument checks every cross-entropy entry point shares (one error line each)."""
    if not 0.0 <= label_smoothing < 1.0:
        raise ValueError(f"label_smoothing must be in [0, 1), got {label_smoothing}")
    if not z_loss >= 0.0:
        raise ValueError(f"z_loss must be >= 0, got {z_loss}")
    if tuple(rows_shape) != tuple(target_shape):
        raise ValueError(f"logits {tuple(rows_shape)} and target {tuple(target_shape)} do not match")
