"""All-to-all context parallelism (DeepSpeed-Ulysses), `--cp-mode a2a`: before attention an all-to-all over the cp
group trades the sequence split for a head split (each rank then holds every token of heads/cp of its heads), the
attention runs locally on whole sequences, and a second all-to-all trades back. Per-head parameters of the attention
itself (sinks) follow the heads: `local_heads` names the ones `attend` sees. Needs the query heads on a rank
(after TP) divisible by cp; kv heads that do not divide are expanded to the query heads first.

Volume per layer and rank: forward 4 all-to-alls (q, k, v in; the output back), backward the same 4.
The gathered sequence arrives in rank order of the load-balanced chunks; it is put in natural order (a permutation
of the sequence dim) so that the local attention is the plain causal one.
"""
from __future__ import annotations

import torch

from . import comm
from .eager import eager_apply
from .ring_attention import local_positions


def _all_to_all(x: torch.Tensor, group, p: int, scatter_dim: int, gather_dim: int) -> torch.Tensor:
    """Split x into p parts along scatter_dim, part i to rank i; concatenate the received parts along gather_dim."""
    parts = torch.stack(x.chunk(p, dim=scatter_dim))  # [p, ...]: comm.all_to_all exchanges dim 0
    received = comm.all_to_all(parts, group)
    return torch.cat(received.unbind(0), dim=gather_dim)


class _Exchange(torch.autograd.Function):
    """The all-to-all that scatters dim `scatter` and gathers dim `gather`; its backward is the inverse exchange.
    Sequence -> heads: [b, h, s/p, d] -> [b, h/p, s, d] is (scatter=1, gather=2); heads -> sequence the reverse."""

    @staticmethod
    def forward(ctx, x, group, p, scatter, gather):
        ctx.args = group, p, gather, scatter  # the backward swaps the two dims
        return _all_to_all(x, group, p, scatter_dim=scatter, gather_dim=gather)

    @staticmethod
    def backward(ctx, grad):
        group, p, scatter, gather = ctx.args
        return _all_to_all(grad.contiguous(), group, p, scatter_dim=scatter, gather_dim=gather), None, None, None, None


def exchange(x: torch.Tensor, group, p: int, scatter_dim: int, gather_dim: int) -> torch.Tensor:
    """The all-to-all that splits `scatter_dim` into p parts (part i to rank i) and concatenates the parts that
    arrive along `gather_dim`; its backward is the inverse exchange. Other mixers that trade a sequence split for a
    head split use it too (models/kinds/gated_deltanet.py)."""
    return eager_apply(_Exchange, x, group, p, scatter_dim, gather_dim)


def gathered_order(chunk: int, cp: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """(order, natural) for a sequence gathered from the cp ranks' load-balanced chunks of `chunk` tokens, in rank
    order: order[j] is the position of gathered token j, `index_select(natural)` puts the gathered sequence in
    natural order and `index_select(order)` puts a natural-order one back in rank order."""
    order = torch.cat([local_positions(chunk, cp, r, "cpu") for r in range(cp)])
    return order.to(device), torch.argsort(order).to(device)


def ulysses_attention(q, k, v, group, cp: int, attend) -> torch.Tensor:
    """q [b, h, 2c, d], k/v [b, kv_heads, 2c, d] of this rank's load-balanced tokens; attend(q, k, v) is causal
    attention over a whole sequence in natural order. Returns this rank's output rows [b, h, 2c, d]."""
    h, hkv = q.shape[1], k.shape[1]
    if h % cp:
        raise ValueError(f"cp-mode a2a: {h} query heads per rank are not divisible by cp={cp}")
    if hkv % cp:  # expand kv to the query heads (as SDPA's enable_gqa pairs them), then split those
        k, v = (t.repeat_interleave(h // hkv, dim=1) for t in (k, v))
    order, natural = gathered_order(q.shape[2] // 2, cp, q.device)
    q, k, v = (exchange(t, group, cp, 1, 2).index_select(2, natural) for t in (q, k, v))
    out = attend(q, k, v)
    return exchange(out.index_select(2, order).contiguous(), group, cp, 2, 1)


def local_heads(heads: int, cp: int, cp_rank: int) -> slice:
    """The query heads (of this rank's `heads`) that `attend` sees on cp rank cp_rank: per-head parameters of the
    attention itself (gpt-oss's sinks) are sliced with it."""
    if heads % cp:
        raise ValueError(f"cp-mode a2a: {heads} query heads per rank are not divisible by cp={cp}")
    n = heads // cp
    return slice(cp_rank * n, (cp_rank + 1) * n)
