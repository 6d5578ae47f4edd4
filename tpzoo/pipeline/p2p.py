"""Point-to-point transfers between pipeline stages, with shapes known in advance (no shape handshake).

Every message has a tag that names it uniquely within one forward_backward call: (direction, receiving model
stage, micro-batch). gloo pairs messages by tag; NCCL ignores tags and pairs the sends and receives of two ranks
in the order they are posted. The executor posts each receive when the action before the one that needs it
runs, and every schedule's actions are ordered so that a rank receives from a peer in the order that peer sends
to it, also on a pipeline of two ranks (activations and gradients between the same pair in both directions) and
with interleaving (several chunks over the same ring).

Messages from rank a to rank b travel on their own two-rank group (`ParallelDims.p2p_group(a, b)`): NCCL runs a
group's batches one after another and a send may wait for its receive, so on one shared group a receive posted
ahead would block the sends queued behind it (1F1B on two ranks deadlocks that way). Strict collective mode
checks both the order and this serialization on gloo (tpzoo/parallel/strict.py; every pipeline test runs under
it).

Sends are non-blocking (waited at the end of the call, or when they are known done) and receives are posted
ahead of need, so a rank only ever blocks on data it really needs: if the schedule's order is acyclic (checked
by `actions.simulate`), the pipeline cannot deadlock, and transfers overlap with compute.

Auxiliary sums (models/aux.py: what a layer kind needs summed over every stage, opaque here): with `carry`, a
dict {key: size}, every message is a pair (activation, {key: fp32 vector of that size}) in both directions (the
sums forward, their gradients backward), sent as 1 + len(carry) tensors of one batched send (tags: _tag, then
the same plus k * _tags for the k-th key in sorted order).
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from tpzoo.parallel import comm
from tpzoo.parallel.dims import ParallelDims

FORWARD, BACKWARD = 0, 1
_WARMED_UP: set = set()  # NCCL: p2p channels whose communicator a collective of both members has created


class StageComm:
    def __init__(self, dims: ParallelDims, num_chunks: int, num_microbatches: int, shape: tuple,
                 dtype: torch.dtype, device, carry: dict | None = None):
        self.p, self.rank = dims.pp, dims.pp_rank
        self.v, self.m = num_chunks, num_microbatches
        self.last_stage = self.p * self.v - 1
        self.shape, self.dtype, self.device = tuple(shape), dtype, device
        self.carry = dict(sorted((carry or {}).items()))  # key -> size of each auxiliary vector (module docstring)
        self._tags = 2 * (self.last_stage + 1) * self.m  # the activations' tags; the auxiliary ones come after
        self.dims = dims
        self.ranks = dims.ranks("pp") if self.p > 1 else None
        self._posted: dict = {}  # (direction, stage, mb) -> (buffer, request or None)
        self._sends: list = []   # (request, tensor): keep each sent tensor alive until its send completes
        self._local: dict = {}   # messages between two chunks of this rank (pp == 1): no transport needed
        if self.p > 1:
            self._warm_up(device)

    def _warm_up(self, device) -> None:
        """NCCL creates a communicator lazily, and batched point-to-point ops may only be the first use of a group
        if all its ranks take part: one tiny all-reduce on each of this rank's channels comes first, in one
        order on every rank (the pipeline ring's ordered pairs, sorted), so the pairs warm up without a cycle."""
        me, n = self.dims.rank, len(self.ranks)
        pairs = sorted({pair for i in range(n) for pair in ((self.ranks[i], self.ranks[(i + 1) % n]),
                                                             (self.ranks[(i + 1) % n], self.ranks[i]))})
        for src, dst in pairs:
            if me in (src, dst):
                group = self.dims.p2p_group(src, dst)
                if dist.get_backend(group) == "nccl" and group not in _WARMED_UP:
                    comm.all_reduce(torch.zeros(1, device=self.device), group)
                    _WARMED_UP.add(group)

    def stage_of(self, chunk: int) -> int:
        return chunk * self.p + self.rank

    def _tag(self, direction: int, stage: int, mb: int) -> int:
        return (direction * (self.last_stage + 1) + stage) * self.m + mb

    def _peer(self, stage: int) -> int:
        """Global rank holding model stage `stage`."""
        return self.ranks[stage % self.p]

    # -- receiving ------------------------------------------------------------------------------------------
    def post_recv(self, direction: int, chunk: int, mb: int) -> None:
        """Start receiving the input of chunk's forward (direction FORWARD) or backward (BACKWARD) for mb."""
        stage = self.stage_of(chunk)
        key = (direction, stage, mb)
        if key in self._posted or self.p == 1:
            return
        src = stage - 1 if direction == FORWARD else stage + 1
        peer, tag = self._peer(src), self._tag(direction, stage, mb)
        bufs = [torch.empty(self.shape, dtype=self.dtype, device=self.device)]
        bufs += [torch.empty(size, dtype=torch.float32, device=self.device) for size in self.carry.values()]
        reqs = comm.batch_send_recv([], [(b, peer, tag + i * self._tags) for i, b in enumerate(bufs)],
                                    self.dims.p2p_group(peer, self.dims.rank), wait=False)
        self._posted[key] = (self._message(bufs), reqs)

    def _message(self, tensors: list):
        """The activation, or (activation, {key: vector}) when auxiliary sums travel."""
        if not self.carry:
            return tensors[0]
        return tensors[0], dict(zip(self.carry, tensors[1:]))

    def recv(self, direction: int, chunk: int, mb: int) -> torch.Tensor:
        """The activation (FORWARD) or gradient (BACKWARD) that chunk needs for mb; blocks until it arrives."""
        stage = self.stage_of(chunk)
        if self.p == 1:
            return self._local.pop((direction, stage, mb))
        self.post_recv(direction, chunk, mb)
        buf, reqs = self._posted.pop((direction, stage, mb))
        for req in reqs:
            req.wait()
        return buf

    # -- sending --------------------------------------------------------------------------------------------
    def send(self, direction: int, chunk: int, mb: int, t: torch.Tensor) -> None:
        """Send chunk's output activation (FORWARD, to the next stage) or input gradient (BACKWARD, to the
        previous stage) for mb, without waiting."""
        stage = self.stage_of(chunk)
        dst = stage + 1 if direction == FORWARD else stage - 1
        aux = []
        if self.carry:  # (activation, {key: vector}): the vectors stay fp32 whatever the activations' dtype
            t, sums = t
            if sorted(sums) != list(self.carry):
                raise RuntimeError(f"pipeline stage {stage}: auxiliary sums {sorted(sums)}, expected "
                                   f"{list(self.carry)}")
            aux = [sums[k].detach().float().contiguous() for k in self.carry]
            for k, vec in zip(self.carry, aux):
                if vec.shape != (self.carry[k],):
                    raise RuntimeError(f"pipeline stage {stage}: auxiliary sum {k!r} of shape {tuple(vec.shape)}, "
                                       f"expected ({self.carry[k]},)")
        t = t.detach().to(self.dtype).contiguous()
        if tuple(t.shape) != self.shape:
            raise RuntimeError(f"pipeline stage {stage} produced shape {tuple(t.shape)}, expected {self.shape}")
        if self.p == 1:
            self._local[(direction, dst, mb)] = self._message([t, *aux])
            return
        peer, tag = self._peer(dst), self._tag(direction, dst, mb)
        sends = [(x, peer, tag + i * self._tags) for i, x in enumerate([t, *aux])]
        for req in comm.batch_send_recv(sends, [], self.dims.p2p_group(self.dims.rank, peer), wait=False):
            self._sends.append((req, sends))
        self._sends = [(r, x) for r, x in self._sends if not r.is_completed()]

    def finish(self) -> None:
        """Wait for every send still in flight (the receivers have consumed everything by the end of a step)."""
        for req, _ in self._sends:
            req.wait()
        self._sends.clear()
        if self._posted or self._local:
            raise RuntimeError(f"pipeline messages left unconsumed: {sorted(self._posted) + sorted(self._local)}")
