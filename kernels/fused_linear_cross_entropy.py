"""Fused LM head + vocab-parallel cross-entropy: the logits of all the tokens never exist, forward or backward.

The unfused head computes logits [tokens, V'/tp] and the loss keeps them (or an fp32 softmax) for the backward,
which writes a gradient of the same size: at 8192 tokens and a 128k vocabulary, 2 GiB per copy in bf16, the
largest activation of a 1B model. Here the head's matmul and the loss run together on chunks of tokens:

  forward, per chunk of rows h_c [c, h] (the whole sequence: gathered first under sequence parallelism)
    z = h_c W^T                       [c, V'/tp], this rank's vocab shard (Gemma 2: cap * tanh(z / cap))
    per-row statistics of z           max, sum of exp, sum of the real logits, target logit
    all-gather of the statistics      over TP, one collective per chunk (4 fp32 per token and rank)
    loss, logZ                        exactly tpzoo.parallel.vocab_parallel_cross_entropy's (smoothing, z-loss)
    d = dloss/dz, unit weight         softmax (1 + 2 z_loss logZ) - eps/V - (1 - eps) onehot; 0 when ignored
    G[c] = d W                        the hidden states' gradient, complete for these rows
    G_W += d^T h_c                    the head weight's gradient, accumulated in fp32
  then G is summed over TP (all-reduce; under SP a reduce-scatter to this rank's sequence shard).
  backward, with g the incoming gradient of the per-token loss:
    g the same for every token (the training loss, sum * scale: autograd hands over one expanded scalar):
      grad_hidden = g G, grad_W = g G_W; no matmul at all.
    otherwise (per-token weights): grad_hidden = g * G row by row (still exact); grad_W is recomputed chunk by
      chunk from the saved input and logZ (one more logits matmul), the only recomputation there is.

Why the gradients in the forward (as Liger's kernel does) rather than logits recomputed in the backward (Apple's
cut cross-entropy): the head costs three [tokens, h] x [h, V'/tp] matmuls this way, four with recomputation. At 1B
parameters and a 128k vocabulary the head is about 18% of a step's FLOPs, so recomputing its logits would cost
about 6% of the step. The price is memory held from forward to backward: G (one hidden-state tensor, what the
unfused head's input gradient would be) and G_W (the head weight's shape in fp32). Without pipelining, and on
1F1B's last stage, each micro-batch's backward follows its forward, so one G_W is alive; GPipe and zero-bubble
hold one per micro-batch in flight on the last stage (`tpzoo plan` counts it: tpzoo.plan.memory).

Chunk size (default_chunk_rows): 2 * hidden rows, a multiple of 64, at most the tokens there are. A chunk's
logits are then about twice the head weight (so the working set is a small multiple of the weight, whatever
the micro-batch), and the fp32 G_W, read and written once per chunk, is amortized over 2h rows of matmul.

Per-chunk statistics and gradient run in the Triton cross-entropy kernels (kernels/vocab_cross_entropy.py:
row_stats, write_grad; the gradient written into the logits buffer) when the dispatch seam picks Triton, in torch
(_torch_stats, _torch_grad: fp32 copies of the chunk) otherwise. Zero-bubble's split backward (grad_phase) gets
only the input gradient in B and only the weight gradient in W.

Gradient-accumulation fusion (tpzoo.parallel.wgrad): where the head weight's gradient is fused, the backward adds
g G_W (fp32) straight into its main gradient and hands autograd None, as the column/row-parallel layers do; unfused
it hands g G_W over rounded once to the weight's dtype, which the GradBuffer adds into the same main gradient. With
fp32 weights the two are the same additions, bit for bit; with 16-bit ones fusion skips that rounding (as the
fused layers' fp32-output GEMMs do on CUDA).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from tpzoo.parallel import comm
from tpzoo.parallel.cross_entropy import check_loss_args, loss_from_sums
from tpzoo.parallel.mappings import tp_layout
from tpzoo.parallel.wgrad import FUSE, SKIP, input_wanted, route, target

CHUNK_MULTIPLE = 64


def default_chunk_rows(tokens: int, hidden: int) -> int:
    """Tokens per chunk by default: 2 * hidden rounded up to a multiple of 64, at most `tokens` (see the module
    docstring for why)."""
    return max(1, min(tokens, -(-2 * hidden // CHUNK_MULTIPLE) * CHUNK_MULTIPLE))


@dataclass(frozen=True)
class _Spec:
    """Everything about one call that is not a tensor."""
    tp: int
    rank: int
    group: object
    start: int             # this rank's first vocab id
    n_real: int            # real (unpadded) entries of this rank's shard
    vocab_size: int        # the real vocabulary
    ignore_index: int
    label_smoothing: float
    z_loss: float
    softcap: float | None
    sequence_dim: int | None  # the dim of the input holding this rank's sequence shard (SP at tp > 1), else None
    rows: int              # tokens per chunk
    kernels: object        # the Triton module (vocab_cross_entropy) or None for torch


# -- one chunk ---------------------------------------------------------------------------------------------------

def _logits(h_c: torch.Tensor, weight: torch.Tensor, spec: _Spec):
    """(logits of the chunk, tanh of the uncapped logits / cap or None): the head's output as the unfused
    path computes it (the same matmul, the soft cap in the model dtype)."""
    z = F.linear(h_c, weight)
    if spec.softcap is None:
        return z, None
    t = z.div_(spec.softcap).tanh_()
    return t * spec.softcap, t


def _torch_stats(z: torch.Tensor, target: torch.Tensor, n_real: int, start: int) -> torch.Tensor:
    """kernels/vocab_cross_entropy.row_stats in torch: [4, rows] fp32 (max over real entries, sum of exp
    relative to it, sum of real logits, target logit or 0 when the target is in another shard)."""
    rows, local_vocab = z.shape
    real = z[:, :n_real].float()
    if n_real:
        m = real.max(-1).values
        s = (real - m.unsqueeze(-1)).exp_().sum(-1)
        sum_z = real.sum(-1)
    else:  # a shard made only of padding
        m = torch.full((rows,), float("-inf"), device=z.device)
        s = sum_z = torch.zeros(rows, device=z.device)
    local = target - start
    in_shard = (local >= 0) & (local < local_vocab)
    z_t = z.gather(1, local.clamp(0, local_vocab - 1).unsqueeze(-1)).squeeze(-1).float().masked_fill(~in_shard, 0.0)
    return torch.stack([m, s, sum_z, z_t])


def _torch_grad(z: torch.Tensor, target: torch.Tensor, lse: torch.Tensor, scale: torch.Tensor, spec: _Spec):
    """kernels/vocab_cross_entropy.write_grad in torch: (softmax (1 + 2 z_loss lse) - eps/V - (1 - eps) onehot)
    * scale per row, 0 on padded entries, in z's dtype."""
    local_vocab, eps = z.shape[1], spec.label_smoothing
    p = (z.float() - lse.unsqueeze(-1)).exp_()
    if spec.z_loss:
        p.mul_((1.0 + 2.0 * spec.z_loss * lse).unsqueeze(-1))
    if eps:
        p[:, :spec.n_real].sub_(eps / spec.vocab_size)
    p[:, spec.n_real:] = 0.0
    local = target - spec.start
    in_shard = (local >= 0) & (local < local_vocab)
    p.scatter_add_(1, local.clamp(0, local_vocab - 1).unsqueeze(-1), (-(1.0 - eps) * in_shard.float()).unsqueeze(-1))
    return p.mul_(scale.unsqueeze(-1)).to(z.dtype)


def _loss_and_lse(z: torch.Tensor, target: torch.Tensor, spec: _Spec):
    """(per-token loss, absolute log-sum-exp, ignored mask) of a chunk: this rank's statistics, all-gathered over
    TP, combined at the global max."""
    if spec.kernels is not None:
        stats = spec.kernels.row_stats(z, target, spec.n_real, spec.start)
    else:
        stats = _torch_stats(z, target, spec.n_real, spec.start)
    if spec.tp > 1:
        stats = comm.all_gather(stats, spec.group, dim=0)
    m, s, sum_z, z_t = stats.view(spec.tp, 4, -1).unbind(1)  # each [tp, rows]
    top = m.max(0).values
    sum_exp = (s * (m - top).exp()).sum(0)  # a padding-only shard has m = -inf, s = 0: adds 0
    loss, log_z, ignored = loss_from_sums(z_t.sum(0) - top, sum_exp, sum_z.sum(0) - spec.vocab_size * top, target,
                                          spec.ignore_index, spec.label_smoothing, spec.vocab_size, spec.z_loss, top)
    return loss, top + log_z, ignored


def _logit_grad(z, tanh, target, lse, scale, spec: _Spec) -> torch.Tensor:
    """d loss / d (uncapped logits) of a chunk, weighted per row by `scale`, in z's dtype (Triton: written into
    z itself)."""
    if spec.kernels is not None:
        d = spec.kernels.write_grad(z, z, target, lse, scale, spec.n_real, spec.start, spec.label_smoothing,
                                    spec.vocab_size, spec.z_loss)
    else:
        d = _torch_grad(z, target, lse, scale, spec)
    if tanh is not None:  # d cap tanh(u / cap) / du = 1 - tanh^2
        d.mul_(tanh.square_().neg_().add_(1.0))
    return d


def _accumulate(acc: torch.Tensor, d: torch.Tensor, h_c: torch.Tensor) -> None:
    """acc (fp32) += d^T h_c. A 16-bit chunk's product comes out of the matmul in the model dtype (as the
    unfused head's whole weight gradient does) and the running sum stays fp32: no 16-bit accumulator rounded
    again after every chunk."""
    if d.dtype == acc.dtype:
        acc.addmm_(d.t(), h_c)
    else:
        acc.add_(torch.mm(d.t(), h_c))


def _gathered_rows(x: torch.Tensor, spec: _Spec) -> torch.Tensor:
    """The input as [tokens, h] rows in the target's order: under SP the whole sequence, all-gathered."""
    if spec.sequence_dim is not None:
        x = comm.all_gather(x, spec.group, dim=spec.sequence_dim)
    return x.reshape(-1, x.shape[-1])


def _chunks(n: int, rows: int):
    return ((a, min(n, a + rows)) for a in range(0, n, rows))


# -- the autograd Function ---------------------------------------------------------------------------------------

class LinearCrossEntropyFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, target, spec: _Spec, need_x: bool, need_w: bool):
        h = _gathered_rows(x, spec)
        tgt = target.reshape(-1).contiguous()
        n = h.shape[0]
        loss = torch.empty(n, dtype=torch.float32, device=h.device)
        lse = torch.empty(n, dtype=torch.float32, device=h.device) if need_w else None
        grad_h = torch.empty_like(h) if need_x else None
        grad_w = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if need_w else None
        for a, b in _chunks(n, spec.rows):
            z, tanh = _logits(h[a:b], weight, spec)
            loss_c, lse_c, ignored = _loss_and_lse(z, tgt[a:b], spec)
            loss[a:b] = loss_c
            if not (need_x or need_w):
                continue
            if lse is not None:
                lse[a:b] = lse_c
            d = _logit_grad(z, tanh, tgt[a:b], lse_c, (~ignored).float(), spec)
            if need_x:
                torch.mm(d, weight, out=grad_h[a:b])
            if need_w:
                _accumulate(grad_w, d, h[a:b])
            del z, tanh, d  # the chunk's buffers go before the next chunk's are allocated
        if need_x and spec.tp > 1:  # each rank's G covers its vocab shard: the sum over TP is the gradient
            if spec.sequence_dim is not None:
                full = list(x.shape)
                full[spec.sequence_dim] *= spec.tp
                grad_h = comm.reduce_scatter(grad_h.view(full), spec.group, dim=spec.sequence_dim)
            else:
                comm.all_reduce(grad_h, spec.group)
        ctx.spec, ctx.x_shape, ctx.w_dtype = spec, x.shape, weight.dtype
        # x, weight, target and logZ only for a recomputation of the weight gradient (per-token weights)
        ctx.save_for_backward(grad_h, grad_w, *((x, weight, tgt, lse) if need_w else (None,) * 4))
        return loss.view(target.shape)

    @staticmethod
    def backward(ctx, grad_loss):
        grad_h, grad_w, x, weight, tgt, lse = ctx.saved_tensors
        spec, way_w = ctx.spec, route(ctx, 1)  # the weight's gradient: skipped, fused or returned (wgrad)
        want_x = input_wanted(ctx)
        g = _uniform(grad_loss)
        dx = dw = None
        if want_x:
            if g is None:  # per-token weights: row by row (this rank's sequence shard under SP)
                per_token = grad_loss
                if spec.sequence_dim is not None:
                    dim = spec.sequence_dim % len(ctx.x_shape)
                    size = ctx.x_shape[dim]
                    per_token = per_token.narrow(dim, spec.rank * size, size)
                dx = grad_h.view(ctx.x_shape) * per_token.unsqueeze(-1).to(grad_h.dtype)
            else:
                dx = (grad_h * g).view(ctx.x_shape)
        main = target(ctx, 1) if way_w == FUSE else None  # fused: the fp32 gradient goes there, None to autograd
        if way_w == SKIP:
            pass
        elif g is None:  # per-token weights: recomputed, fp32
            acc = _recomputed_weight_grad(x, weight, tgt, lse, grad_loss, spec)
            if main is not None:
                main.add_(acc)
            else:
                dw = acc.to(ctx.w_dtype)
        elif main is not None:
            _add_scaled(main, grad_w, g)
        else:  # scaled in fp32, rounded once into the weight's dtype
            dw = torch.mul(grad_w, g, out=torch.empty(grad_w.shape, dtype=ctx.w_dtype, device=grad_w.device))
        return dx, dw, None, None, None, None


_ADD_BLOCK = 1 << 20  # elements per block of _add_scaled's temporary (4 MiB in fp32)


def _add_scaled(out: torch.Tensor, grad_w: torch.Tensor, g: torch.Tensor) -> None:
    """out += grad_w * g (fp32), a block of rows at a time: the same product and sum the unfused path makes (not
    a fused multiply-add, which rounds once less), with no temporary of the weight's size, and the saved G_W left
    as it is (a retained graph reuses it)."""
    rows = max(1, _ADD_BLOCK // max(1, grad_w.shape[1]))
    for a, b in _chunks(grad_w.shape[0], rows):
        out[a:b].add_(grad_w[a:b] * g)


def _uniform(grad_loss: torch.Tensor) -> torch.Tensor | None:
    """The incoming gradient as a 0-d tensor when it is the same for every token, else None. An expanded
    tensor (a sum's gradient: the training loss) says so for free; otherwise one comparison decides (one host
    synchronization, cheaper than the recomputation it may avoid: a mean's gradient is materialized)."""
    if grad_loss.numel() == 0:
        return grad_loss.new_zeros(())
    first = grad_loss[(0,) * grad_loss.dim()]
    if all(s == 0 for s in grad_loss.stride()):
        return first
    return first if bool((grad_loss == first).all()) else None


def _recomputed_weight_grad(x, weight, tgt, lse, grad_loss, spec: _Spec) -> torch.Tensor:
    """sum over tokens of g_t d_t^T h_t, chunk by chunk from the saved input (re-gathered under SP) and logZ."""
    h = _gathered_rows(x, spec)
    scale = grad_loss.reshape(-1).float().masked_fill(tgt == spec.ignore_index, 0.0)
    acc = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device)
    for a, b in _chunks(h.shape[0], spec.rows):
        z, tanh = _logits(h[a:b], weight, spec)
        _accumulate(acc, _logit_grad(z, tanh, tgt[a:b], lse[a:b], scale[a:b], spec), h[a:b])
        del z, tanh
    return acc


def linear_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, target: torch.Tensor, *,
                         ignore_index: int = -100, label_smoothing: float = 0.0, z_loss: float = 0.0,
                         softcap: float | None = None, vocab_size: int | None = None, group=None,
                         sequence_dim: int | None = None, chunk_rows: int | None = None,
                         kernels=None) -> torch.Tensor:
    """Per-token loss (target's shape, 0 where ignored) of cross_entropy(softcap(hidden @ weight.T), target)
    over TP vocab shards, without the logits of all tokens (module docstring). `kernels`: the Triton module for
    the per-chunk softmax, or None for torch (tpzoo.kernels.linear_cross_entropy chooses)."""
    tp, rank, group = tp_layout(group)
    sp_dim = sequence_dim % hidden.dim() if sequence_dim is not None and tp > 1 else None
    rows_shape = list(hidden.shape[:-1])
    if sp_dim is not None:
        if sp_dim == hidden.dim() - 1:
            raise ValueError("linear_cross_entropy: sequence_dim must not be the hidden dim")
        rows_shape[sp_dim] *= tp
    check_loss_args(rows_shape, target.shape, label_smoothing, z_loss)
    if weight.dim() != 2 or weight.shape[1] != hidden.shape[-1]:
        raise ValueError(f"linear_cross_entropy: weight {tuple(weight.shape)} does not take hidden states of "
                         f"size {hidden.shape[-1]} (expected [vocab shard, {hidden.shape[-1]}])")
    if softcap is not None and not softcap > 0:
        raise ValueError(f"softcap must be > 0 (or None), got {softcap}")
    if chunk_rows is not None and chunk_rows < 1:
        raise ValueError(f"chunk_rows must be >= 1, got {chunk_rows}")
    local_vocab = weight.shape[0]
    start = rank * local_vocab
    vocab = vocab_size if vocab_size is not None else local_vocab * tp
    rows = chunk_rows or default_chunk_rows(target.numel(), hidden.shape[-1])
    spec = _Spec(tp, rank, group, start, max(0, min(local_vocab, vocab - start)), vocab, ignore_index,
                 float(label_smoothing), float(z_loss), softcap, sp_dim, rows, kernels)
    grad = torch.is_grad_enabled()
    return LinearCrossEntropyFunction.apply(hidden, weight, target, spec, grad and hidden.requires_grad,
                                            grad and weight.requires_grad)
