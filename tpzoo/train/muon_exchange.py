"""Whole matrices for Muon under every split: each Muon parameter is orthogonalized once, by one owner rank, from
its full matrix, and the result goes back to the ranks that hold its pieces.

Where the pieces are. A parameter of this rank is a tensor-parallel shard (replicated kv heads repeated, fused parts
each split: tpzoo.parallel.sharding), and under ZeRO (optimizer state sharded over the optimizer's group: dp x cp,
or edp for expert weights) each rank holds the momentum and the reduced gradient of its 1/dp of every bucket, so a
shard's elements are spread over the dp ranks in the flat layout's segments (tpzoo.parallel.data_parallel).

Owners (Megatron-Core's layer-wise distribution): the parameters are dealt, largest Newton-Schulz cost first, to
the least loaded of tp x dp slots (tp slots without ZeRO: every dp replica repeats its tp rank's share, as its
AdamW repeats the update), so no rank orthogonalizes everything. Every rank of the stage computes the same
assignment from the same shapes. Routed experts stay at their ep rank (their optimizer's group is edp).

One step, per wave of parameters (waves: consecutive parameters of about `wave_elems` local elements, so the
Newton-Schulz of one wave runs while the next wave's pieces travel; every hop is one counted
all_to_all_v through tpzoo.parallel.comm, asynchronous, waited in the same order on every rank):
    dp hop     under ZeRO, the elements of the owned segments go to the parameter's dp owner, which assembles its
               tp shard (each element crosses once);
    tp hop     the dp owner's tp ranks send their shards to the tp owner, which rebuilds the full matrix (unshard:
               replicated kv heads counted once; a replicated weight needs no hop);
    orthogonalize  the owner's pieces (Matrices.pieces: q, k, v, gate, up, each expert) in batches of one shape;
    and back   each tp rank its shard of the result, then each dp rank its owned elements.
Everything travels in the iteration's dtype (bfloat16 by default): torch.optim.Muon casts the update to bfloat16
before its first operation, and the iteration's result is bfloat16, so nothing is rounded that one process would
not round. Per step and Muon element a
rank sends (dp - 1)/dp x 2 bytes each way over dp (ZeRO only) and, for the elements its dp rank owns, (tp - 1)/tp x
2 bytes each way over tp (tpzoo.plan's muon costs).
"""
from __future__ import annotations

import bisect
from dataclasses import dataclass

import torch

from tpzoo.parallel import comm
from tpzoo.parallel.sharding import shard, unshard

from .muon_matrices import Matrices, orthogonalize


@dataclass
class Unit:
    """One Muon parameter in the optimizer's flat layout."""
    param: torch.Tensor
    offset: int          # flat offset of this rank's shard
    matrices: Matrices
    shape: tuple         # the full (tp-unsharded) shape
    cost: float          # Newton-Schulz FLOPs of its pieces

    @property
    def numel(self) -> int:
        return self.param.numel()

    @property
    def replicated(self) -> bool:
        return self.matrices.spec.dim is None


def assign(costs: list[float], slots: int) -> list[int]:
    """The slot of each item: largest first to the least loaded slot (ties: the lower slot, then the earlier item)."""
    load, out = [0.0] * slots, [0] * len(costs)
    for i in sorted(range(len(costs)), key=lambda i: (-costs[i], i)):
        s = min(range(slots), key=lambda s: (load[s], s))
        out[i] = s
        load[s] += costs[i]
    return out


def _cat(src: torch.Tensor, runs: list[tuple[int, int]]) -> torch.Tensor:
    return torch.cat([src[a:b] for a, b in runs]) if runs else src.new_empty(0)


class MuonExchange:
    """The routes of one optimizer's Muon parameters (module docstring). `owned`: this rank's (flat start, flat end,
    position) owned segments (the whole buffer without ZeRO); `segments_of(r)`: dp rank r's owned (start, end) flat
    ranges, ordered; `sharded`: ZeRO with dp > 1 (the dp hop)."""

    def __init__(self, units: list[Unit], *, dims, group: str, dp_size: int, dp_rank: int, sharded: bool, owned,
                 segments_of, ns_steps: int, wave_elems: int, ns_dtype=torch.bfloat16):
        self.units, self.dims, self.group, self.ns_steps = units, dims, group, ns_steps
        self.ns_dtype = ns_dtype
        self.tp, self.tp_rank, self.sharded = dims.tp, dims.tp_rank, sharded
        tp = self.tp
        slots = assign([u.cost for u in units], (dp_size if sharded else 1) * tp)
        self.tp_owner = [s % tp for s in slots]
        dp_owner = [s // tp if sharded else dp_rank for s in slots]
        self.dp_owner = dp_owner
        # waves of consecutive units
        self.waves, wave, size = [], [], 0
        for i, u in enumerate(units):
            wave.append(i)
            size += u.numel
            if size >= wave_elems:
                self.waves.append(wave)
                wave, size = [], 0
        if wave:
            self.waves.append(wave)
        # the units this dp rank gathers (all of them without ZeRO), and where each sits in the gathered buffer
        mine = [i for i in range(len(units)) if dp_owner[i] == dp_rank]
        if sharded:
            self.ubuf_at, at = {}, 0
            for i in mine:
                self.ubuf_at[i], at = at, at + units[i].numel
            self.ubuf_size = at
            self._dp_routes(owned, segments_of, dp_size, dp_rank)
        else:
            self.ubuf_at = {i: units[i].offset for i in mine}  # the owned vector is the whole flat buffer
            self.ubuf_size = None
        self.mine = set(mine)

    # groups looked up when used: an optimizer can be built for a virtual rank (memory planning) without them
    @property
    def dp_group(self):
        return self.dims.group(self.group)

    @property
    def tp_group(self):
        return self.dims.tp_group

    # -- routes -----------------------------------------------------------------------------------------------
    def _dp_routes(self, owned, segments_of, dp: int, me: int) -> None:
        """Per wave: (sends[j]: runs of this rank's owned vector for dp rank j, recvs[r]: runs of the gathered
        buffer that arrive from dp rank r), both in unit order, flat order within a unit."""
        segs = [segments_of(r) for r in range(dp)]
        starts = [[a for a, _ in s] for s in segs]
        pos_of = {lo: pos for lo, _, pos in owned}

        def pieces(r: int, u: Unit) -> list[tuple[int, int]]:
            lo, hi = u.offset, u.offset + u.numel
            k = max(bisect.bisect_right(starts[r], lo) - 1, 0)
            out = []
            while k < len(segs[r]) and segs[r][k][0] < hi:
                a, b = max(segs[r][k][0], lo), min(segs[r][k][1], hi)
                if a < b:
                    out.append((a, b))
                k += 1
            return out

        self.dp_sends, self.dp_recvs = [], []
        for wave in self.waves:
            sends = [[] for _ in range(dp)]
            recvs = [[] for _ in range(dp)]
            for i in wave:
                u = self.units[i]
                for a, b in pieces(me, u):
                    seg_lo = segs[me][bisect.bisect_right(starts[me], a) - 1][0]
                    p = pos_of[seg_lo] + a - seg_lo
                    sends[self.dp_owner[i]].append((p, p + b - a))
                if self.dp_owner[i] == me:
                    for r in range(dp):
                        at = self.ubuf_at[i] - u.offset
                        recvs[r] += [(at + a, at + b) for a, b in pieces(r, u)]
            self.dp_sends.append(sends)
            self.dp_recvs.append(recvs)

    def _tp_lists(self, wave: list[int]) -> tuple[list[list[int]], list[int]]:
        """(units this dp rank sends to each tp rank, units this rank orthogonalizes) of a wave."""
        to = [[] for _ in range(self.tp)]
        for i in wave:
            if i in self.mine and not self.units[i].replicated:
                to[self.tp_owner[i]].append(i)
        return to, [i for i in wave if i in self.mine and self.tp_owner[i] == self.tp_rank]

    # -- one step ---------------------------------------------------------------------------------------------
    def start(self, vec: torch.Tensor) -> None:
        """Send the Nesterov updates (bf16, over this rank's owned vector) of every wave towards their owners."""
        self.vec, self.pending = vec, []
        if not self.sharded:
            self.ubufs = [vec] * len(self.waves)
            return
        for w in range(len(self.waves)):
            sends, recvs = self.dp_sends[w], self.dp_recvs[w]
            payload = torch.cat([_cat(vec, runs) for runs in sends])
            out = vec.new_empty(sum(b - a for runs in recvs for a, b in runs))
            self.pending.append(comm.all_to_all_v_start(out, payload, [sum(b - a for a, b in r) for r in sends],
                                                        [sum(b - a for a, b in r) for r in recvs], self.dp_group))

    def finish(self) -> torch.Tensor:
        """Wait for the pieces, orthogonalize this rank's units, send the results back: the owned vector (bf16)
        holding the orthogonalized update at every Muon position."""
        n = len(self.waves)
        if self.sharded:  # one gathered buffer: the waves fill disjoint parts of it
            ubuf = self.vec.new_empty(self.ubuf_size)
            for w in range(n):
                _deliver(self.pending[w].wait(), ubuf, [r for runs in self.dp_recvs[w] for r in runs])
            self.ubufs = [ubuf] * n
        tp_in = [self._tp_gather(w) for w in range(n)]
        tp_back = [self._orthogonalize(w, *tp_in[w]) for w in range(n)]
        for w in range(n):
            self._tp_deliver(w, tp_back[w])
        if not self.sharded:
            return self.vec
        back = []
        for w in range(n):  # the results to the dp ranks that own their elements
            sends, recvs = self.dp_recvs[w], self.dp_sends[w]  # the dp hop reversed
            payload = torch.cat([_cat(self.ubufs[w], runs) for runs in sends])
            out = self.vec.new_empty(sum(b - a for runs in recvs for a, b in runs))
            back.append(comm.all_to_all_v_start(out, payload, [sum(b - a for a, b in r) for r in sends],
                                                [sum(b - a for a, b in r) for r in recvs], self.dp_group))
        for w in range(n):
            _deliver(back[w].wait(), self.vec, [r for runs in self.dp_sends[w] for r in runs])
        self.ubufs = self.pending = None
        return self.vec

    def _tp_gather(self, w: int):
        """Start sending this dp rank's shards of wave w to their tp owners (tp 1: nothing to send)."""
        to, mine = self._tp_lists(self.waves[w])
        if self.tp == 1:
            return None, mine, [], 0
        ubuf = self.ubufs[w]
        runs = [[(self.ubuf_at[i], self.ubuf_at[i] + self.units[i].numel) for i in ids] for ids in to]
        payload = torch.cat([_cat(ubuf, r) for r in runs])
        mine_split = [i for i in mine if not self.units[i].replicated]
        per_rank = sum(self.units[i].numel for i in mine_split)
        out = ubuf.new_empty(per_rank * self.tp)
        pending = comm.all_to_all_v_start(out, payload, [sum(self.units[i].numel for i in ids) for ids in to],
                                          [per_rank] * self.tp, self.tp_group)
        return pending, mine, mine_split, per_rank

    def _orthogonalize(self, w: int, pending, mine: list[int], mine_split: list[int], per_rank: int):
        """Wave w's units of this rank orthogonalized; start sending each tp rank its shard of the results."""
        ubuf = self.ubufs[w]
        if pending is None:  # tp 1: the matrices are whole in place, and their results go back there
            views = [ubuf[self.ubuf_at[i]:self.ubuf_at[i] + self.units[i].numel].view(self.units[i].shape)
                     for i in mine]
            pieces = [p for i, v in zip(mine, views) for p in self.units[i].matrices.pieces(v)]
            if pieces:
                results = orthogonalize(pieces, self.ns_steps, self.ns_dtype)  # (its inputs stacked first)
                torch._foreach_copy_(pieces, results)
            return None, []
        received = pending.wait().view(self.tp, per_rank)
        fulls, at = {}, 0
        for i in mine_split:
            u = self.units[i]
            shards = [received[r, at:at + u.numel].view(u.param.shape) for r in range(self.tp)]
            fulls[i] = unshard(shards, u.matrices.spec, reduce="first")
            at += u.numel
        for i in mine:
            if self.units[i].replicated:
                u = self.units[i]
                fulls[i] = ubuf[self.ubuf_at[i]:self.ubuf_at[i] + u.numel].view(u.shape)
        pieces = [p for i in mine for p in self.units[i].matrices.pieces(fulls[i])]
        results = iter(orthogonalize(pieces, self.ns_steps, self.ns_dtype))
        outs = {}
        for i in mine:
            out = torch.empty(self.units[i].shape, dtype=self.ns_dtype, device=ubuf.device)
            for view in self.units[i].matrices.pieces(out):
                view.copy_(next(results))
            outs[i] = out
        # each tp rank its shard (a replicated weight: all of it), in the order of the units it gathered
        to_rank = []
        for r in range(self.tp):
            to_rank += [(outs[i] if self.units[i].replicated else shard(outs[i], self.units[i].matrices.spec, r,
                                                                         self.tp)).reshape(-1) for i in mine]
        payload = torch.cat(to_rank) if to_rank else ubuf.new_empty(0)
        expect = [[i for i in self.waves[w] if i in self.mine and self.tp_owner[i] == r] for r in range(self.tp)]
        recv = [sum(self.units[i].numel for i in ids) for ids in expect]
        size = sum(self.units[i].numel for i in mine)
        out = ubuf.new_empty(sum(recv))
        return comm.all_to_all_v_start(out, payload, [size] * self.tp, recv, self.tp_group), expect

    def _tp_deliver(self, w: int, back) -> None:
        pending, expect = back
        if pending is None:
            return
        received, ubuf = pending.wait(), self.ubufs[w]
        runs = [(self.ubuf_at[i], self.ubuf_at[i] + self.units[i].numel) for ids in expect for i in ids]
        _deliver(received, ubuf, runs)


def _deliver(received: torch.Tensor, dst: torch.Tensor, runs: list[tuple[int, int]]) -> None:
    """Copy `received` (the runs' elements end to end) into the runs of `dst`."""
    if not runs:
        return
    views = [dst[a:b] for a, b in runs]
    torch._foreach_copy_(views, list(received.split([b - a for a, b in runs])))
