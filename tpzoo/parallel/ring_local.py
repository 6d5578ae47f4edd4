"""Ring attention's schedule for every cp rank inside one process: the benchmark against one fused SDPA
(scripts/bench/cp_ring.py --device) and single-device checks of the block kernels (tests/test_cuda.py).

Every rank's forward, then every rank's backward, runs one rank after another with ring attention's own loops
(ring_forward / ring_backward) and block kernel; the ring's transfers are replaced by `LocalExchange`, which hands
each rank the K|V block it would have received and adds the dK|dV it would have passed on into the owner's total.
The work is then exactly what the cp ranks compute together, minus the transfers.
"""
from __future__ import annotations

import torch

from .ring_attention import KV_TAG, ring_backward, ring_forward


class LocalExchange:
    """The ring's exchange for rank r when every rank runs in this process, one after another: the i-th K|V
    receive is rank (r - i)'s block; a dK|dV send adds the block's gradient into its owner's total (then zeroes the
    buffer the rank keeps accumulating into), so the totals are complete once every rank has run its backward."""

    def __init__(self, kv_blocks: list, dkv_totals: list | None, rank: int):
        self.kv, self.totals, self.rank = kv_blocks, dkv_totals, rank
        self.kv_sends = self.dkv_sends = 0

    def start(self, t, tag):
        cp = len(self.kv)
        if tag == KV_TAG:
            self.kv_sends += 1
            return self.kv[(self.rank - self.kv_sends) % cp]
        self.totals[(self.rank - self.dkv_sends) % cp] += t  # the owner of the block this dK|dV belongs to
        self.dkv_sends += 1
        return t.zero_()

    @staticmethod
    def wait(pending):
        return pending


def ring_schedule(q: list, kv: list, d_out: list, scale: float, kernel: str, window: int | None = None):
    """out, dq, dk, dv of every rank ([cp] lists of the load-balanced shards) from the cp ranks' blocks: q[r],
    d_out[r] [b, h, 2c, d], kv[r] [2, b, kv_heads, 2c, d] (K and V stacked)."""
    cp, dk = len(q), kv[0].shape[-1]
    packed = [torch.cat([t[0], t[1]], dim=-1) for t in kv]  # K|V as the ring passes them on (ring_attention._pack)
    totals = [torch.zeros(t.shape, dtype=torch.promote_types(t.dtype, torch.float32), device=t.device)
              for t in packed]
    saved = [ring_forward(q[r], kv[r][0], kv[r][1], LocalExchange(packed, None, r), r, cp, scale, window, kernel)
             for r in range(cp)]
    dq = [ring_backward(d_out[r], q[r], kv[r][0], kv[r][1], out, lse, states, LocalExchange(packed, totals, r), r,
                        cp, scale, window, kernel)[0] for r, (out, lse, states) in enumerate(saved)]
    return ([s[0] for s in saved], dq, [t[..., :dk].to(q[0].dtype) for t in totals],
            [t[..., dk:].to(q[0].dtype) for t in totals])
