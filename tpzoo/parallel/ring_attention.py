"""Ring attention: causal self-attention over a sequence split across the context-parallel (cp) ranks.

Layout (load-balanced, Megatron-Core / Llama 3): the (padded) sequence is cut into 2N chunks of c tokens for N cp
ranks, and rank r holds chunks r and 2N-1-r, in that order (tpzoo.parallel.context_parallel cuts the batches).
Every rank then does the same causal work: a rank early in the sequence also holds a chunk late in it.

Forward: the K/V of every rank travel once around the ring (one batched isend/irecv per step, to rank r+1 and from
rank r-1), the transfer of the next block overlapped with the attention of the one at hand. Each block gives a
partial output and its log-sum-exp; partials merge exactly with the log-sum-exp rule. With the load-balanced order
only three block shapes occur (the diagonal and the causal skipping of the other ranks' halves):
    step 0 (own K/V):        all 2c queries x all 2c keys, causal mask by global position
    K/V of an earlier rank:  all 2c queries x the first c keys (its second chunk lies in every query's future)
    K/V of a later rank:     the last c queries x all 2c keys (our first chunk precedes both of its chunks)
so each step after the first costs half the diagonal step.

Backward (flash-attention style, from the saved output and log-sum-exp): K/V go around the ring again, and with
them the dK/dV accumulated for that block, which ends at its owner after N transfers.

Analytical volume per layer and rank (counted by tpzoo.parallel.comm under "send"/"recv" on the cp group):
    forward  N-1 sends of K|V (2 * b * kv_heads * 2c * head_dim elements, the activations' dtype)
    backward N-1 sends of K|V and N sends of dK|dV (same elements, fp32 or wider).

Grouped-query attention: K/V travel with their kv heads only and are expanded to the query heads per block; the
gradients of the expanded heads are summed back. (Under TP, the attention token mixer already holds the kv heads its query
heads use, replicated or split.) Sliding windows mask by global position. Packed documents (`doc_ids` [b, S] of the
whole padded sequence, natural order, held by every rank): each block also masks the query/key pairs of different
documents (every rank picks its queries' and the block owner's ids from the whole sequence's: nothing more
travels); such blocks run the torch math with that mask.

Per block (`block_forward` / `block_backward`, the seam for fused kernels): a fused attention that returns the
log-sum-exp and takes the merged output and log-sum-exp in its backward (so the backward of a block against the
global softmax is the kernel's own, as in flash attention's own ring implementations), chosen once per call by
`choose_kernel`: on CUDA PyTorch's flash attention (fp16/bf16, sm80+, head dim a multiple of 8 up to 256), else its
memory-efficient attention (fp32 too; its log-sum-exp comes padded to a multiple of 32 rows, trimmed here and
padded back for its backward); on CPU torch's CPU flash kernel; else exact torch math that materializes one block's
scores. `fused=False` forces the torch math (tests run both). The kernels see whole blocks only, so each block is
classified from its positions alone (`block_visibility`, host integers, no device sync): every pair visible (the
kernel without a mask), causal by local index (the diagonal block; the kernel's own causal mask), no pair visible
(a sliding window that ends before the block: skipped, its K/V passed on), or cut by a sliding window (torch math
with the explicit mask: a window that binds inside a block is the one case without a fused kernel). Soft-capped
scores (Gemma 2) are refused by the caller (models/kinds/attention_core.py: --cp-mode a2a).

Attention sinks (gpt-oss: one learned logit per head that joins every row's softmax with no value): once the
ring has merged every block, the sink merges as one more block whose output is zero and whose log-sum-exp is the
sink (`merge_sinks`: out * sigmoid(lse - sink), lse = logaddexp(lse, sink)). The backward's blocks already take
the merged output and log-sum-exp, so q, k and v need nothing more; the sink's gradient is
-sum over rows of exp(sink - lse) * rowsum(dO * O) (`sink_grad`), this rank's rows only: the sinks are
replicated over cp, and their gradients are summed with the other replicated weights' over dp x cp. Under TP
each rank passes the sinks of its own heads.

Values may be narrower than queries and keys (multi-head latent attention: v_head_dim != qk_head_dim): the torch
math takes them as they are; for a fused block kernel (which needs one head dim) V travels zero-padded to the
query width, and the padded columns of the output (zero) and of dV are dropped.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from . import comm
from .eager import eager_apply
from .attention_kernels import FUSED, choose_kernel

KV_TAG, DKV_TAG = 41, 42  # two exchanges may be in flight between the same pair of ranks in the backward


def local_positions(chunk: int, cp: int, cp_rank: int, device) -> torch.Tensor:
    """Global positions [2c] of the tokens rank cp_rank holds: chunks cp_rank and 2*cp-1-cp_rank of c tokens."""
    first = torch.arange(chunk, device=device) + cp_rank * chunk
    return torch.cat([first, first + (2 * cp - 1 - 2 * cp_rank) * chunk])


def _span(rank: int, cp: int, chunk: int, part: slice) -> tuple[int, int]:
    """(lowest, highest) global position among rank's tokens [part] (whole chunks: all, the first or the second)."""
    first, second = rank * chunk, (2 * cp - 1 - rank) * chunk
    lo = second if part.start == chunk else first
    hi = first + chunk - 1 if part.stop == chunk else second + chunk - 1
    return lo, hi


def block_visibility(cp_rank: int, owner: int, cp: int, chunk: int, window: int | None) -> str:
    """How this rank's queries see rank `owner`'s keys in their ring step, from positions alone: "all" (every
    pair), "causal" (causal by local index: the diagonal block, the window never binding), "none" (a sliding window
    ends before every key) or "mask" (a sliding window cuts through the block: explicit mask)."""
    rows, cols = _block_slices(owner, cp_rank, chunk)
    q_lo, q_hi = _span(cp_rank, cp, chunk, rows)
    k_lo, k_hi = _span(owner, cp, chunk, cols)
    farthest = q_hi - k_lo  # (off the diagonal every key precedes every query)
    if owner == cp_rank:
        return "causal" if window is None or farthest < window else "mask"
    if window is None or farthest < window:
        return "all"
    return "none" if q_lo - k_hi >= window else "mask"


def _block_slices(step_owner: int, cp_rank: int, chunk: int) -> tuple[slice, slice]:
    """(query rows, key columns) of the local queries that can see any key of rank step_owner's block."""
    if step_owner == cp_rank:
        return slice(None), slice(None)
    if step_owner < cp_rank:
        return slice(None), slice(0, chunk)
    return slice(chunk, None), slice(None)


def _mask(qpos: torch.Tensor, kpos: torch.Tensor, window: int | None, causal: bool, doc_ids=None,
          ) -> torch.Tensor | None:
    """True where query i may see key j (None: every pair); with doc_ids (the whole sequence's) [b, 1, q, k]:
    only pairs of one document."""
    if not causal and window is None and doc_ids is None:
        return None
    mask = kpos.unsqueeze(0) <= qpos.unsqueeze(1)
    if window is not None:
        mask &= qpos.unsqueeze(1) - kpos.unsqueeze(0) < window
    if doc_ids is not None:
        mask = (mask & (doc_ids[:, qpos].unsqueeze(2) == doc_ids[:, kpos].unsqueeze(1))).unsqueeze(1)
    return mask


def _expand(t: torch.Tensor, groups: int) -> torch.Tensor:
    """kv heads -> query heads (kv head i serves query heads i*groups .. i*groups+groups-1, as SDPA's enable_gqa)."""
    return t if groups == 1 else t.repeat_interleave(groups, dim=1)


def _fold(t: torch.Tensor, groups: int) -> torch.Tensor:
    """The gradient of _expand: sum the query heads' copies back onto their kv head."""
    if groups == 1:
        return t
    b, h, s, d = t.shape
    return t.view(b, h // groups, groups, s, d).sum(2)


def block_forward(q, k, v, scale: float, causal: bool, mask, kernel: str):
    """(out, lse, state) of one block, out and lse in the accumulation dtype, lse [b, h, sq]; causal: the diagonal
    block (local index order is position order there), mask: the explicit mask of the torch path; state: what the
    kernel's backward needs beyond the merged output and log-sum-exp (attention_kernels.py)."""
    if kernel == "torch":
        return (*block_attention(q, k, v, scale, mask), None)
    dv = v.shape[-1]
    out, lse, state = FUSED[kernel].forward(q, k, _widen(v, q.shape[-1]), scale, causal)
    return out[..., :dv].to(_acc(q)), lse.to(_acc(q)), state


def block_backward(d_out, q, k, v, out, lse, delta, scale: float, causal: bool, mask, kernel: str, state=None):
    """(dq, dk, dv) of one block given the merged output and log-sum-exp of its query rows: the block's share of
    the gradients of the whole attention (P = exp(S - lse) with the global lse)."""
    if kernel != "torch":
        dt, d, dv = q.dtype, q.shape[-1], v.shape[-1]
        grads = FUSED[kernel].backward(_widen(d_out.to(dt), d), q, k, _widen(v, d), _widen(out.to(dt), d),
                                       lse.contiguous(), scale, causal, state)
        return grads[0].to(_acc(q)), grads[1].to(_acc(q)), grads[2][..., :dv].to(_acc(q))
    qb, kb, vb = (t.to(_acc(q)) for t in (q, k, v))
    scores = torch.matmul(qb, kb.transpose(-1, -2)) * scale
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    probs = torch.exp(scores - _finite(lse).unsqueeze(-1))
    d_out = d_out.to(_acc(q))
    d_scores = probs * (torch.matmul(d_out, vb.transpose(-1, -2)) - delta.unsqueeze(-1)) * scale
    return (torch.matmul(d_scores, kb), torch.matmul(d_scores.transpose(-1, -2), qb),
            torch.matmul(probs.transpose(-1, -2), d_out))


def block_attention(q, k, v, scale: float, mask) -> tuple[torch.Tensor, torch.Tensor]:
    """(out [b, h, sq, d], lse [b, h, sq], both at least fp32) of softmax(q k^T * scale) v over one block of keys.
    A row with no visible key has lse = -inf and out = 0 (it merges as nothing)."""
    scores = torch.matmul(q.to(_acc(q)), k.to(_acc(q)).transpose(-1, -2)) * scale
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)
    probs = torch.exp(scores - _finite(lse).unsqueeze(-1))
    return torch.matmul(probs, v.to(_acc(q))), lse


def _widen(t: torch.Tensor, d: int) -> torch.Tensor:
    """t zero-padded on the last dim to d (a fused kernel's one head dim; narrower values only)."""
    return t if t.shape[-1] == d else F.pad(t, (0, d - t.shape[-1]))


def merge_sinks(out, lse, sinks):
    """Fold per-head sink logits [heads] into a finished attention (in place on out [b, h, s, dv]; returns the
    new lse): a block with output 0 and log-sum-exp `sink`."""
    sink = sinks.to(lse.dtype).view(1, -1, 1)
    new_lse = torch.logaddexp(lse, sink)
    out.mul_(torch.exp(lse - new_lse).unsqueeze(-1))
    return new_lse


def sink_grad(d_out, out, lse, sinks) -> torch.Tensor:
    """d loss / d sinks [heads] from this rank's rows: -sum_(b, rows) exp(sink - lse) * rowsum(dO * O), with the
    output and lse that include the sinks."""
    delta = (d_out.to(lse.dtype) * out.to(lse.dtype)).sum(-1)
    prob = torch.exp(sinks.to(lse.dtype).view(1, -1, 1) - lse)
    return -(prob * delta).sum(dim=(0, 2)).to(sinks.dtype)


def _pack(k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """K|V in one tensor [b, kv_heads, s, dk + dv] (one transfer per ring step; dv may differ from dk)."""
    return torch.cat([k, v], dim=-1)


def _acc(t: torch.Tensor) -> torch.dtype:
    """Accumulation dtype: fp32 for half precisions, else the input's own (fp64 stays fp64 for exact tests)."""
    return torch.promote_types(t.dtype, torch.float32)


def _finite(lse: torch.Tensor) -> torch.Tensor:
    return torch.where(torch.isinf(lse), torch.zeros_like(lse), lse)


def merge(out, lse, block_out, block_lse):
    """Log-sum-exp merge of two partial attentions over disjoint key sets (in place on out; returns new lse)."""
    new_lse = torch.logaddexp(lse, block_lse)
    safe = _finite(new_lse)
    out.mul_(torch.exp(lse - safe).unsqueeze(-1)).add_(block_out * torch.exp(block_lse - safe).unsqueeze(-1))
    return new_lse


class _Ring:
    """One neighbour exchange on the cp ring: send to rank r+1, receive from rank r-1 (global ranks)."""

    def __init__(self, group, ranks: list[int], cp_rank: int):
        self.group, n = group, len(ranks)
        self.next, self.prev = ranks[(cp_rank + 1) % n], ranks[(cp_rank - 1) % n]

    def start(self, t: torch.Tensor, tag: int):
        out = torch.empty_like(t)
        reqs = comm.batch_send_recv([(t, self.next, tag)], [(out, self.prev, tag)], group=self.group, wait=False)
        return out, reqs, t  # t kept alive until the send is waited on

    @staticmethod
    def wait(pending):
        out, reqs, _ = pending
        for r in reqs:
            r.wait()
        return out


def ring_forward(q, k, v, exchange, cp_rank: int, cp: int, scale: float, window, kernel: str, doc_ids=None,
                 sinks=None):
    """One rank's forward over the ring: (out in q's dtype, lse, each step's kernel state). `exchange` passes
    K/V on (start(t, tag) -> pending, wait(pending) -> the tensor from the previous rank): the cp ring, or the
    one-process stand-in of ring_local.py. doc_ids: packed documents; sinks [heads]: attention sinks (the
    module docstring); the lse returned then includes them."""
    chunk, groups = q.shape[2] // 2, q.shape[1] // k.shape[1]
    states = []  # per step: the fused kernel's state for the backward
    pos = local_positions(chunk, cp, cp_rank, q.device)
    # [b, s, h, d] in memory (seen as [b, h, s, d]): the layout SDPA returns, so that the caller's
    # "b h s d -> b s (h d)" for the output projection is a view, not a copy
    b, h, s, _ = q.shape
    out = torch.empty(b, s, h, v.shape[-1], dtype=_acc(q), device=q.device).transpose(1, 2)
    lse = None
    dk = k.shape[-1]
    kv = _pack(k, v)
    for step in range(cp):
        pending = exchange.start(kv, KV_TAG) if step < cp - 1 else None  # overlapped with this block
        owner = (cp_rank - step) % cp
        rows, cols = _block_slices(owner, cp_rank, chunk)
        seen, how, mask = _block_plan(pos, rows, cols, owner, cp_rank, cp, chunk, window, kernel, doc_ids)
        states.append(None)
        if seen != "none":
            b_out, b_lse, states[-1] = block_forward(
                q[:, :, rows], _expand(kv[:, :, cols, :dk], groups), _expand(kv[:, :, cols, dk:], groups), scale,
                seen == "causal", mask, how)
            if step == 0:  # the diagonal block covers every row (each sees at least itself): it starts the sums
                out.copy_(b_out)
                lse = b_lse
            else:
                lse[:, :, rows] = merge(out[:, :, rows], lse[:, :, rows], b_out, b_lse)
        if pending is not None:
            kv = exchange.wait(pending)
    if sinks is not None:
        lse = merge_sinks(out, lse, sinks)
    return out.to(q.dtype), lse, states  # (the same tensor in fp32)


def ring_backward(grad_out, q, k, v, out, lse, states, exchange, cp_rank: int, cp: int, scale: float, window,
                  kernel: str, doc_ids=None):
    """One rank's backward over the ring: (dq, dk, dv). K/V travel again, and with them the dK/dV accumulated for
    their block, which ends at its owner after cp transfers."""
    chunk, groups = q.shape[2] // 2, q.shape[1] // k.shape[1]
    pos = local_positions(chunk, cp, cp_rank, q.device)
    # dO stays in the activations' dtype for the fused kernels (the torch math widens its block's rows)
    d_out = grad_out
    delta = None  # rowsum(dO * O), the softmax backward term of the torch math (made once, if a block needs it)
    dq = torch.zeros(q.shape, dtype=_acc(q), device=q.device)
    dk = k.shape[-1]
    kv = _pack(k, v)
    dkv = torch.zeros(kv.shape, dtype=_acc(q), device=q.device)
    dkv_pending = None
    for step in range(cp):
        kv_pending = exchange.start(kv, KV_TAG) if step < cp - 1 else None
        owner = (cp_rank - step) % cp
        rows, cols = _block_slices(owner, cp_rank, chunk)
        seen, how, mask = _block_plan(pos, rows, cols, owner, cp_rank, cp, chunk, window, kernel, doc_ids)
        if seen != "none":
            if how == "torch" and delta is None:
                delta = (d_out.to(_acc(q)) * out.to(_acc(q))).sum(-1)
            dq_b, dk_b, dv_b = block_backward(
                d_out[:, :, rows], q[:, :, rows], _expand(kv[:, :, cols, :dk], groups),
                _expand(kv[:, :, cols, dk:], groups), out[:, :, rows], lse[:, :, rows],
                None if delta is None else delta[:, :, rows], scale, seen == "causal", mask, how, states[step])
            dq[:, :, rows] += dq_b
        if dkv_pending is not None:  # the dK/dV the previous ranks accumulated for this block
            dkv = exchange.wait(dkv_pending)
        if seen != "none":
            dkv[:, :, cols, :dk] += _fold(dk_b, groups)
            dkv[:, :, cols, dk:] += _fold(dv_b, groups)
        dkv_pending = exchange.start(dkv, DKV_TAG)  # to the next rank; after cp sends, back at its owner
        if kv_pending is not None:
            kv = exchange.wait(kv_pending)
    dkv = exchange.wait(dkv_pending)
    return dq.to(q.dtype), dkv[..., :dk].to(k.dtype), dkv[..., dk:].to(v.dtype)


class RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, group, ranks, cp_rank, scale, window, fused, doc_ids, sinks):
        kernel = choose_kernel(q, fused)
        if v.shape[-1] > q.shape[-1]:  # values wider than queries: the kernels' one head dim cannot hold them
            kernel = "torch"
        result, lse, states = ring_forward(q, k, v, _Ring(group, ranks, cp_rank), cp_rank, len(ranks), scale,
                                           window, kernel, doc_ids, sinks)
        # The output in the activations' dtype is what the backward needs (as flash attention keeps it): the one
        # the output projection keeps anyway, so ring attention saves nothing beyond what SDPA saves.
        ctx.save_for_backward(q, k, v, result, lse, sinks)
        ctx.group, ctx.ranks, ctx.cp_rank, ctx.scale, ctx.window = group, ranks, cp_rank, scale, window
        ctx.kernel, ctx.states, ctx.doc_ids = kernel, states, doc_ids
        return result

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, out, lse, sinks = ctx.saved_tensors
        grads = ring_backward(grad_out, q, k, v, out, lse, ctx.states, _Ring(ctx.group, ctx.ranks, ctx.cp_rank),
                              ctx.cp_rank, len(ctx.ranks), ctx.scale, ctx.window, ctx.kernel, ctx.doc_ids)
        d_sinks = sink_grad(grad_out, out, lse, sinks) if sinks is not None and ctx.needs_input_grad[10] else None
        return (*grads, None, None, None, None, None, None, None, d_sinks)


def _block_plan(pos, rows, cols, owner: int, cp_rank: int, cp: int, chunk: int, window, kernel: str, doc_ids=None):
    """(visibility, kernel, explicit mask or None) of one ring step's block: a block a sliding window cuts through,
    or any block of packed documents, runs the torch math with its mask, every other one the call's kernel."""
    seen = block_visibility(cp_rank, owner, cp, chunk, window)
    if kernel != "torch" and seen != "mask" and doc_ids is None:
        return seen, kernel, None
    kpos = local_positions(chunk, cp, owner, pos.device)
    return seen, "torch", _mask(pos[rows], kpos[cols], window, owner == cp_rank, doc_ids)


def ring_attention(q, k, v, group, ranks: list[int], cp_rank: int, *, scale: float | None = None,
                   window: int | None = None, fused: bool | str | None = None,
                   doc_ids: torch.Tensor | None = None, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """Causal attention of this rank's queries q [b, h, 2c, d] over every cp rank's keys/values ([b, kv_heads,
    2c, d] here, v's head dim may differ), the tokens in the load-balanced order; `ranks` are the cp group's global
    ranks. fused: None, the fastest block kernel this device has (attention_kernels.choose_kernel); False, the
    torch math; a kernel name (attention_kernels.FUSED) to force one. doc_ids [b, 2c * cp]: the whole sequence's
    documents (natural order), attention within each. sinks [heads]: this rank's heads' attention sinks."""
    if q.shape[2] % 2:
        raise ValueError(f"ring attention: the local sequence ({q.shape[2]}) must hold two equal chunks")
    if q.shape[1] % k.shape[1]:
        raise ValueError(f"ring attention: {q.shape[1]} query heads are not a multiple of {k.shape[1]} kv heads")
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    if doc_ids is not None and tuple(doc_ids.shape) != (q.shape[0], q.shape[2] * len(ranks)):
        raise ValueError(f"ring attention: doc_ids {tuple(doc_ids.shape)} are not the whole sequence's "
                         f"({q.shape[0]}, {q.shape[2] * len(ranks)})")
    if sinks is not None and tuple(sinks.shape) != (q.shape[1],):
        raise ValueError(f"ring attention: sinks {tuple(sinks.shape)} are not one per query head ({q.shape[1]})")
    return eager_apply(RingAttention, q, k, v, group, list(ranks), cp_rank, scale, window, fused, doc_ids, sinks)
