"""Counted collective primitives.

Every collective tpzoo issues goes through these functions, so `count_collectives()` can record, per kind and
process group, the number of calls, the payload and the bytes this rank puts on the wire.

Byte conventions (per rank, per call), with p the group size:
  payload_bytes: all_reduce -> the tensor; all_gather -> the gathered output; reduce_scatter -> the full input;
                 broadcast -> the tensor; send/recv -> the tensor; all_to_all -> the input.
  sent_bytes:    what a bandwidth-optimal ring sends from this rank: all_reduce 2(p-1)/p * payload,
                 all_gather and reduce_scatter (p-1)/p * payload, send the tensor, recv 0,
                 broadcast the tensor on the source rank (0 elsewhere), all_to_all (p-1)/p * payload;
                 all_to_all_v (uneven splits: expert dispatch) the rows sent to the other ranks.
This is how Megatron's papers count volume: an all-reduce costs one reduce-scatter plus one all-gather.

A group of size one (SELF_GROUP included) costs nothing and is not counted. CUDA tensors over a gloo group
(several ranks sharing one GPU, see tpzoo.parallel.device) are staged through host memory.
seconds:       host seconds this rank was blocked on the collective: the whole call of a synchronous one, the
               `wait()` of a started one (what overlap leaves exposed).

An emulated slow link (`emulate_link(group, gbps, latency_ms)`: DiLoCo's replicas on one machine,
tpzoo.train.diloco) makes every collective over that group last at least sent_bytes / bandwidth + latency from
its start: when it completes sooner, the caller sleeps the remainder (after the call, or in `wait()`), so the
emulated time is a lower bound and whatever compute ran meanwhile hides it, as a real link would.

Asynchronous by contract: a `*_start` call or `batch_send_recv(wait=False)` returns a handle whose transfer may
run (on NCCL's own stream) until `wait()`; the caller reads no output and writes no input before then, and the
handle holds every tensor involved until then (docs/design.md, "Collectives on CUDA"). Strict collective mode
(tpzoo.parallel.strict, TPZOO_STRICT_COLLECTIVES=1) enforces this on CPU.

torch.compile (tpzoo.train.compile) does not trace these functions (tpzoo.parallel.eager): each collective is a
graph break and runs as written, handles and strict mode included.
"""
from __future__ import annotations

import contextlib
import time
from collections import defaultdict
from dataclasses import dataclass

import torch
import torch.distributed as dist

from . import strict
from .dims import SELF_GROUP
from .eager import eager as _eager
from .state import group_name


@dataclass
class CollectiveStats:
    calls: int = 0
    elements: int = 0
    payload_bytes: int = 0
    sent_bytes: float = 0.0
    seconds: float = 0.0


class CollectiveCounter:
    """Counts of collectives by (kind, group name). Read `.stats`, or `.get(kind, group)`."""

    def __init__(self):
        self.stats: dict[tuple[str, str], CollectiveStats] = defaultdict(CollectiveStats)

    def record(self, kind: str, group, numel: int, element_size: int, sent_fraction: float) -> None:
        s = self.stats[(kind, group_name(group))]
        s.calls += 1
        s.elements += numel
        s.payload_bytes += numel * element_size
        s.sent_bytes += sent_fraction * numel * element_size

    def get(self, kind: str, group: str = "tp") -> CollectiveStats:
        return self.stats.get((kind, group), CollectiveStats())

    def total_calls(self) -> int:
        return sum(s.calls for s in self.stats.values())

    def summary(self) -> dict:
        """{"kind@group": calls, elements, payload and sent bytes}: what was sent, comparable between runs (the
        blocked seconds, a measurement, are in `.stats` / `.get`)."""
        return {f"{k}@{g}": {f: v for f, v in vars(s).items() if f != "seconds"}
                for (k, g), s in sorted(self.stats.items())}


_COUNTERS: list[CollectiveCounter] = []

# torch 2.13 renamed the flat collectives (*_into_tensor / *_tensor -> *_single); older releases lack the new names.
_all_gather_flat = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_flat = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


@contextlib.contextmanager
def count_collectives():
    """Context manager yielding a CollectiveCounter of every collective issued inside (nesting allowed)."""
    counter = CollectiveCounter()
    _COUNTERS.append(counter)
    try:
        yield counter
    finally:
        _COUNTERS.remove(counter)


_LINKS: dict = {}  # group -> (bytes per second, latency in seconds): emulate_link


def emulate_link(group, gbps: float | None, latency_ms: float = 0.0) -> None:
    """Make every collective over `group` last at least its sent bytes / (gbps gigabits per second) + latency_ms
    (see the module docstring); gbps None forgets the group's link."""
    if gbps is None:
        _LINKS.pop(group, None)
        return
    if gbps <= 0 or latency_ms < 0:
        raise ValueError(f"an emulated link needs a positive bandwidth and a latency >= 0, got {gbps} Gbit/s, "
                         f"{latency_ms} ms")
    _LINKS[group] = (gbps * 1e9 / 8, latency_ms / 1e3)


class _Clock:
    """A counted collective's start: what its blocked seconds are credited to, and the earliest moment it may
    complete on an emulated link."""

    __slots__ = ("key", "start", "until")

    def __init__(self, key: tuple, until: float | None):
        self.key, self.start, self.until = key, time.perf_counter(), until

    def done(self, blocked_since: float | None = None) -> None:
        """The collective completed: sleep what the emulated link still owes, credit the blocked seconds (since
        `blocked_since`, the wait's start; the call's start by default)."""
        now = time.perf_counter()
        if self.until is not None and self.start + self.until > now:
            time.sleep(self.start + self.until - now)
            now = time.perf_counter()
        for c in _COUNTERS:
            c.stats[self.key].seconds += now - (self.start if blocked_since is None else blocked_since)


def _record(kind: str, group, t: torch.Tensor, sent_fraction: float) -> _Clock | None:
    """Count a collective on every active counter; returns its clock (None when nothing times it)."""
    for c in _COUNTERS:
        c.record(kind, group, t.numel(), t.element_size(), sent_fraction)
    link = _LINKS.get(dist.group.WORLD if group is None else group) if _LINKS else None
    if not _COUNTERS and link is None:
        return None
    until = None if link is None else sent_fraction * t.numel() * t.element_size() / link[0] + link[1]
    return _Clock((kind, group_name(group)), until)


def group_size(group) -> int:
    if group is SELF_GROUP:
        return 1
    return dist.get_world_size(group)


_BACKENDS: dict = {}


def _via_host(t: torch.Tensor, group) -> bool:
    """gloo cannot run most collectives on CUDA tensors: when several ranks share one GPU (gloo chosen for CUDA,
    see tpzoo.parallel.device), tensors are staged through host memory. Never true on CPU or with NCCL."""
    if not t.is_cuda:
        return False
    key = id(group)
    if key not in _BACKENDS:
        _BACKENDS[key] = dist.get_backend(group)
    return _BACKENDS[key] == "gloo"


@_eager
def all_reduce(t: torch.Tensor, group, op=dist.ReduceOp.SUM) -> torch.Tensor:
    """In-place all-reduce; returns t."""
    p = group_size(group)
    if p == 1:
        return t
    clock = _record("all_reduce", group, t, 2 * (p - 1) / p)
    strict.check_layout("all_reduce", group, t)
    if _via_host(t, group):
        host = t.cpu()
        dist.all_reduce(host, op=op, group=group)
        t.copy_(host)
    else:
        dist.all_reduce(t, op=op, group=group)
    if clock is not None:
        clock.done()
    return t


class Pending:
    """A collective in flight (async_op): `wait()` blocks until it is done, checks strict mode's guard, copies a
    staged result (host-staged, or strict mode's private buffer) into the caller's tensor, and returns the result
    (`finish(result)` when given: a reshape, no copy). `keep`: tensors the collective reads, held until it is done
    (on CUDA the caching allocator would hand freed memory to the next allocation while NCCL still reads it)."""

    def __init__(self, work, result: torch.Tensor, copy_back: tuple | None = None, finish=None, keep=None,
                 guard: strict.Guard | None = None, clock: _Clock | None = None):
        self.work, self.result, self.copy_back, self.finish, self.keep = work, result, copy_back, finish, keep
        self.guard, self.clock = guard, clock

    @_eager
    def wait(self) -> torch.Tensor:
        if self.work is not None:
            blocked_since = time.perf_counter() if self.clock is not None else None
            self.work.wait()
            if self.clock is not None:
                clock, self.clock = self.clock, None
                clock.done(blocked_since)
            self.work = self.keep = None
            if self.guard is not None:
                guard, self.guard = self.guard, None
                guard.check()
            if self.copy_back is not None:
                self.copy_back[1].copy_(self.copy_back[0])
                self.copy_back = None
        return self.finish(self.result) if self.finish is not None else self.result


@_eager
def all_gather_start(t: torch.Tensor, group, dim: int = 0) -> Pending:
    """Start concatenating every rank's `t` along `dim` (rank order); `.wait()` returns the result."""
    p = group_size(group)
    if p == 1:
        return Pending(None, t)  # a group of one: the result is the input
    dim = dim % t.dim()
    moved = t.movedim(dim, 0).contiguous()
    out = torch.empty((p * moved.shape[0],) + tuple(moved.shape[1:]), dtype=t.dtype, device=t.device)
    pending = _into_start("all_gather", _all_gather_flat, out, moved, group)
    pending.finish = lambda r: r.movedim(0, dim)
    return pending


@_eager
def all_gather(t: torch.Tensor, group, dim: int = 0) -> torch.Tensor:
    """Concatenate every rank's `t` along `dim` (rank order)."""
    return all_gather_start(t, group, dim).wait()


@_eager
def reduce_scatter_start(t: torch.Tensor, group, dim: int = 0) -> Pending:
    """Start summing over ranks and keeping this rank's chunk of `dim`; `.wait()` returns the result."""
    p = group_size(group)
    if p == 1:
        return Pending(None, t)  # a group of one: the result is the input
    dim = dim % t.dim()
    if t.shape[dim] % p != 0:
        raise ValueError(f"reduce_scatter: dim {dim} of size {t.shape[dim]} is not divisible by group size {p}")
    moved = t.movedim(dim, 0).contiguous()
    out = torch.empty((moved.shape[0] // p,) + tuple(moved.shape[1:]), dtype=t.dtype, device=t.device)
    pending = _into_start("reduce_scatter", _reduce_scatter_flat, out, moved, group)
    pending.finish = lambda r: r.movedim(0, dim)
    return pending


@_eager
def reduce_scatter(t: torch.Tensor, group, dim: int = 0) -> torch.Tensor:
    """Sum over ranks, then keep this rank's chunk of `dim`."""
    return reduce_scatter_start(t, group, dim).wait()


@_eager
def broadcast(t: torch.Tensor, src: int, group=None) -> torch.Tensor:
    if group_size(group) == 1:
        return t
    clock = _record("broadcast", group, t, 1.0 if dist.get_rank() == src else 0.0)
    strict.check_layout("broadcast", group, t)
    if _via_host(t, group):
        host = t.cpu()
        dist.broadcast(host, src=src, group=group)
        t.copy_(host)
    else:
        dist.broadcast(t, src=src, group=group)
    if clock is not None:
        clock.done()
    return t


@_eager
def all_to_all(t: torch.Tensor, group) -> torch.Tensor:
    """Split dim 0 into p chunks, send chunk i to rank i, concatenate what arrives along dim 0."""
    p = group_size(group)
    if p == 1:
        return t
    clock = _record("all_to_all", group, t, (p - 1) / p)
    return _all_to_all_single(t, t.shape[0], group, clock)


@_eager
def all_to_all_v(t: torch.Tensor, send_splits: list[int], recv_splits: list[int], group) -> torch.Tensor:
    """Uneven all-to-all along dim 0: rows [sum(send[:i]), sum(send[:i+1])) go to rank i, recv[i] rows arrive
    from rank i. Split sizes are host ints (the caller learned them with a small all_to_all of counts)."""
    p = group_size(group)
    if p == 1:
        return t
    me = dist.get_rank(group)
    # payload: the input; sent: the rows leaving this rank
    clock = _record("all_to_all_v", group, t, (1 - send_splits[me] / t.shape[0]) if t.shape[0] else 0.0)
    return _all_to_all_single(t, sum(recv_splits), group, clock, output_split_sizes=list(recv_splits),
                              input_split_sizes=list(send_splits))


def _all_to_all_single(t: torch.Tensor, out_rows: int, group, clock: _Clock | None, **splits) -> torch.Tensor:
    """dist.all_to_all_single into a new tensor of `out_rows` rows, staged through the host where the backend
    needs it (gloo with device tensors)."""
    t = t.contiguous()
    host = _via_host(t, group)
    src = t.cpu() if host else t
    out = src.new_empty((out_rows, *t.shape[1:]))
    dist.all_to_all_single(out, src, group=group, **splits)
    if clock is not None:
        clock.done()
    return out.to(t.device) if host else out


@_eager
def batch_send_recv(sends: list[tuple], recvs: list[tuple], group=None, wait: bool = True) -> list:
    """Post point-to-point sends and receives at once (global peer ranks) and wait for them.

    Each entry is (tensor, peer) or (tensor, peer, tag): a tag tells apart several messages between the same two
    ranks on gloo. NCCL ignores tags: it pairs the sends and receives between two ranks in the order they are
    posted, so callers must post receives in the order the peer posts the matching sends (strict mode checks
    this). With `wait=False` a list of one handle is returned instead (empty if there is nothing to transfer):
    its wait() completes every transfer of the call, and it holds every tensor involved until then; schedules
    use this to overlap transfers with compute. Neither a sent tensor nor a receive buffer may be touched before
    wait()."""
    strict_on = strict.enabled()
    ops, deliver, keep, reads, writes, headers = [], [], [], [], [], []

    def post(op, t, peer, tag):
        if strict_on:  # every message untagged, as NCCL ignores tags, after a header that names its tag
            header = strict.p2p_header(tag if op is dist.isend else None, t)
            keep.append(header)
            if op is dist.irecv:
                headers.append((len(ops), header, tag, t, peer))
            ops.append(dist.P2POp(op, header, peer, group, 0))
        ops.append(dist.P2POp(op, t, peer, group, 0 if strict_on else tag))

    for entry in sends:
        t, peer, tag = (*entry, 0)[:3]
        t = t.contiguous()
        _record("send", group, t, 1.0)
        src = t.cpu() if _via_host(t, group) else t.clone() if strict_on else t  # strict: the data as at start
        keep += [t, src]
        reads.append(t)
        post(dist.isend, src, peer, tag)
    for entry in recvs:
        t, peer, tag = (*entry, 0)[:3]
        _record("recv", group, t, 0.0)
        strict.check_layout("recv", group, t)
        dst = t
        if _via_host(t, group):
            dst = torch.empty(t.shape, dtype=t.dtype, device="cpu")
        elif strict_on:
            dst = torch.empty_like(t)  # strict: the caller's buffer stays poisoned until wait()
        if dst is not t:
            deliver.append((dst, t))
        keep.append(t)
        writes.append(t)
        post(dist.irecv, dst, peer, tag)
    if not ops:
        return []
    kind = "send/recv" if sends and recvs else "send" if sends else "recv"
    if strict_on:  # NCCL runs a group's batches one after another: this one starts when the previous is done
        strict.after_previous_batch(group, kind, group_name(group))
    works = dist.batch_isend_irecv(ops)
    guard = None
    if strict_on:
        guard = strict.Guard(kind, group_name(group), reads, writes)
        guard.headers, guard.ops = headers, ops
    handle = Transfers(works, deliver, keep, guard)
    if strict_on:
        strict.batch_started(group, handle)
    if wait:
        handle.wait()
        return []
    return [handle]


class Transfers:
    """The point-to-point requests of one batch_send_recv call. wait() waits for all of them, checks strict
    mode's guard, copies staged receive buffers into the caller's tensors, and lets go of the tensors."""

    def __init__(self, works: list, deliver: list, keep: list, guard: strict.Guard | None):
        self.works, self.deliver, self.keep, self.guard = works, deliver, keep, guard
        self.transferred = False

    def transfer(self, timeout=None) -> None:
        """Wait for the requests themselves (not the caller's wait(): nothing is delivered or released)."""
        if self.transferred:
            return
        guard = self.guard
        one_each = guard is not None and len(self.works) == len(guard.ops)  # (gloo: one request per op)
        for i, w in enumerate(self.works):
            w.wait(timeout) if timeout is not None else w.wait()  # in order: a later request first can block gloo
            if one_each:
                guard.check_order(i)  # a receive's header: a clear error before a payload of the wrong size
        self.transferred = True

    def wait(self) -> bool:
        self.transfer()
        guard, self.guard = self.guard, None
        if guard is not None:
            guard.check_order(None)
            guard.check()
        for staged, dest in self.deliver:
            dest.copy_(staged)
        self.works, self.deliver, self.keep = [], [], []
        return True

    def is_completed(self) -> bool:
        """Done and delivered. In strict mode never before wait() (the worst schedule: nothing is done early)."""
        if self.guard is not None or self.deliver:
            return False
        return self.transferred or all(w.is_completed() for w in self.works)


def split_along(t: torch.Tensor, dim: int, rank: int, parts: int) -> torch.Tensor:
    """This rank's contiguous chunk of `dim` (no communication)."""
    size = t.shape[dim]
    if size % parts != 0:
        raise ValueError(f"cannot split dim {dim} of size {size} into {parts} equal parts")
    return t.narrow(dim, rank * (size // parts), size // parts).contiguous()


# -- asynchronous flat collectives (the data-parallel gradient buckets; the sequence-dim ones above use them too) ----
# Counted when started. The caller leaves the tensors untouched until wait() (the Pending holds the input).

@_eager
def all_reduce_start(t: torch.Tensor, group) -> Pending:
    """Start an in-place sum of `t` over `group`; wait() returns t."""
    p = group_size(group)
    if p == 1:
        return Pending(None, t)
    clock = _record("all_reduce", group, t, 2 * (p - 1) / p)
    strict.check_layout("all_reduce", group, t)
    if not (_via_host(t, group) or strict.enabled()):
        return Pending(dist.all_reduce(t, group=group, async_op=True), t, keep=t, clock=clock)
    # staged: the sum runs on a copy (in host memory for gloo with CUDA tensors), copied back by wait()
    staged = t.cpu() if _via_host(t, group) else t.clone()
    work = dist.all_reduce(staged, group=group, async_op=True)
    guard = strict.Guard("all_reduce", group_name(group), writes=[t], in_place=True) if strict.enabled() else None
    return Pending(work, t, (staged, t), keep=staged, guard=guard, clock=clock)


def _into_start(kind: str, collective, out: torch.Tensor, t: torch.Tensor, group, name: str | None = None,
                sent: float | None = None) -> Pending:
    """Start a flat collective from `t` into the preallocated `out`, counted as `kind`; `name`: what strict mode's
    errors call it; `sent`: the fraction of the input this rank sends (default (p-1)/p). Staged through buffers of
    its own when gloo meets CUDA (host memory) or in strict mode."""
    p = group_size(group)
    if p == 1:
        return Pending(None, out.copy_(t))
    counted = t if kind in ("reduce_scatter", "all_to_all_v") else out
    clock = _record(kind, group, counted, (p - 1) / p if sent is None else sent)
    host = _via_host(t, group)
    strict.check_layout(name or kind, group, out, t)
    if not (host or strict.enabled()):
        return Pending(collective(out, t, group=group, async_op=True), out, keep=t, clock=clock)
    device = torch.device("cpu") if host else out.device
    received = torch.empty(out.shape, dtype=out.dtype, device=device)
    src = t.to(device, copy=True)  # what the collective reads: the input as it was at start
    guard = strict.Guard(name or kind, group_name(group), reads=[t], writes=[out]) if strict.enabled() else None
    return Pending(collective(received, src, group=group, async_op=True), out, (received, out), keep=src,
                   guard=guard, clock=clock)


@_eager
def reduce_scatter_into_start(out: torch.Tensor, t: torch.Tensor, group) -> Pending:
    """Start the sum of flat `t` over `group` whose rank-th 1/p lands in flat `out`; wait() returns out."""
    return _into_start("reduce_scatter", _reduce_scatter_flat, out, t, group, "reduce_scatter_into")


@_eager
def all_gather_into_start(out: torch.Tensor, t: torch.Tensor, group) -> Pending:
    """Start concatenating every rank's flat `t` (rank order) into flat `out`; wait() returns out."""
    return _into_start("all_gather", _all_gather_flat, out, t, group, "all_gather_into")


@_eager
def all_to_all_v_start(out: torch.Tensor, t: torch.Tensor, send_splits: list[int], recv_splits: list[int],
                       group) -> Pending:
    """Start the uneven all-to-all of flat `t` into the preallocated flat `out`: t's elements
    [sum(send[:i]), sum(send[:i+1])) go to rank i, recv[i] elements arrive from rank i (in rank order). Splits are
    host ints both sides know (Muon's matrices to their owners: tpzoo.train.muon_exchange). wait() returns out."""
    p = group_size(group)
    if p == 1:
        return Pending(None, out.copy_(t))
    me = dist.get_rank(group)
    sent = (1 - send_splits[me] / t.numel()) if t.numel() else 0.0  # the elements leaving this rank

    def collective(o, i, group, async_op):
        return dist.all_to_all_single(o, i, output_split_sizes=list(recv_splits),
                                      input_split_sizes=list(send_splits), group=group, async_op=async_op)

    return _into_start("all_to_all_v", collective, out, t, group, "all_to_all_v", sent)
