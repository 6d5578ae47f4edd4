"""ZeRO-3 weights: each data-parallel rank holds only its owned segments of the weights, and a layer's weights are
all-gathered just before the layer runs (forward, and again before its backward) and freed after.

The layout is the optimizer's (tpzoo.train.optim): one flat layout of this rank's parameters (late ones last),
cut into buckets, dp rank d owning its 1/dp of every bucket (the segments the ZeRO-1/2 optimizer state and
gradient shard already use). Under ZeRO-3 the flat weight buffer is gone; what stays is

- `shard`: the model-dtype weights of the owned segments, end to end (padded / dp elements), the only copy of the
  weights between uses. The optimizer's update writes it (it *is* the fp32 master with fp32 weights).
- the late buckets in full (`late`): the parameters finalize_grads still changes after the backward
  (sequence-parallel norms, replicated kv heads, tied copies; laid out last) are read outside any single layer,
  so they stay gathered, like their gradients under ZeRO-2. `refresh()` all-gathers them after each update.
- a parameter of two units (a tied embedding and head on one stage) or of none stays gathered too (a resident
  unit);
- one gathering unit per layer (a Transformer block, the embedding, the positions, the final norm, the head: the
  children of a chunk, a ModuleDict's/ModuleList's children each on its own). A unit's buffer holds every bucket
  its (non-late) parameters touch, end to end; its parameters are views into it. Between uses the buffer's
  storage is resized to zero bytes (FSDP's trick): the views, and the tensors autograd saved that point at them,
  keep pointing at the same storage, which a gather refills before it is read again.

When a unit is gathered (hooks on its module):
- forward pre-hook: gather it (or wait for its prefetch) and start the next unit's gather (asynchronously);
- forward post-hook: free it, and hook its output's gradient; that hook, which fires just before the unit's
  backward, gathers it again, starts the previous unit's gather and frees the units whose backward is over;
- recomputation (activation checkpointing re-runs the forward inside the backward) finds the unit gathered by
  its backward hook and leaves it so; zero-bubble's W needs activations and output gradients only, so the units
  stay freed until W;
- `keep=True` (pipelines: the option to keep a stage gathered for the step): nothing is freed before the
  optimizer's `release_all()`, so each unit is gathered once per step instead of once per micro-batch and pass.

Every dp replica runs the same units in the same order, so they issue the same all-gathers in the same order.
The gradients go through the ZeRO-2 path unchanged (tpzoo.parallel.grad_shards).
"""
from __future__ import annotations

import bisect
import time
import weakref

import torch
import torch.nn as nn

from . import comm


def _in_backward() -> bool:
    return torch._C._current_graph_task_id() != -1


def unit_modules(chunk: nn.Module) -> list[nn.Module]:
    """The gathering units of a model chunk in forward order: its children, a container's children each on
    their own (a Transformer: embed, pos_embed, every layer, final_norm, lm_head)."""
    out = []
    for child in chunk.children():
        if isinstance(child, (nn.ModuleDict, nn.ModuleList)):
            out += list(child.children())
        else:
            out.append(child)
    return out


class FlatReader:
    """Ranges of the flat layout read straight from the parameters as they are now (their storage kept until the
    reader is dropped, whatever .data they are given meanwhile), so sharding never builds the whole flat buffer."""

    def __init__(self, params, offsets, dtype, device):
        self.tensors = [p.detach().reshape(-1) for p in params]
        self.offsets, self.dtype, self.device = list(offsets), dtype, device

    def __call__(self, lo: int, hi: int, dtype=None) -> torch.Tensor:
        out = torch.zeros(hi - lo, dtype=dtype or self.dtype, device=self.device)  # padding reads as zeros
        i = max(bisect.bisect_right(self.offsets, lo) - 1, 0)
        while i < len(self.tensors) and self.offsets[i] < hi:
            o, t = self.offsets[i], self.tensors[i]
            a, b = max(o, lo), min(o + t.numel(), hi)
            if a < b:
                out[a - lo:b - lo] = t[a - o:b - o]
            i += 1
        return out


class _WeakLink:
    """An attribute held by weak reference (None when unset or gone). Units link to their neighbours both ways;
    strong links would make each pair a reference cycle holding its modules, so a dropped model's memory would
    wait for Python's cyclic GC (ParamShards.units owns every unit)."""

    def __set_name__(self, owner, name: str) -> None:
        self.slot = "_" + name

    def __get__(self, obj, objtype=None):
        if obj is None:
            return self
        ref = getattr(obj, self.slot, None)
        return ref() if ref is not None else None

    def __set__(self, obj, value) -> None:
        setattr(obj, self.slot, weakref.ref(value) if value is not None else None)


class Unit:
    """One gathering unit: its module, the buckets its parameters lie in and its buffer over them."""

    prev = _WeakLink()
    next = _WeakLink()

    def __init__(self, module, keys: list[int], buckets, dtype, device, resident: bool = False):
        self.module, self.keys, self.resident = module, keys, resident
        self.base, pos = {}, 0
        for k in keys:
            self.base[k] = pos
            pos += buckets[k][1] - buckets[k][0]
        self.numel = pos
        self.buffer = torch.empty(pos, dtype=dtype, device=device)
        self.nbytes = self.buffer.untyped_storage().nbytes()
        self.pending: list | None = None
        self.live = True  # storage allocated (gathered, or a gather in flight)
        self.prefetch = False  # gathered by a prefetch not yet used
        self.prev = self.next = None  # neighbours in forward order, in the same chunk (weakly: _WeakLink)


def _call(shards_ref, method, unit_ref, *args):
    """A module hook's call of `method` (a ParamShards function) on its shards and unit, both weakly held: nothing
    once the optimizer that owns them is gone."""
    shards, unit = shards_ref(), unit_ref()
    if shards is not None and unit is not None:
        method(shards, unit, *args)


class ParamShards:
    """ZeRO-3 weights of a DistributedAdamW (see the module docstring).

    params, offsets, buckets, owned: the optimizer's flat layout, buckets and owned segments ((lo, hi, position)
    per bucket, end to end); late: which parameters are late; modules: the model chunks (gathering units are
    their children); read: a FlatReader of the weights as they are (model dtype), each range read once here, so
    no rank ever holds the whole flat buffer; padded: the layout's size; group: a callable returning the dp(-cp)
    group, looked up when first needed; keep: free nothing before release_all()."""

    def __init__(self, params, offsets, buckets, owned, late, modules, read: FlatReader, padded: int, group, *,
                 keep: bool = False):
        self.buckets, self.owned, self._group, self.keep = buckets, owned, group, keep
        self.dtype, self.device = read.dtype, read.device
        n_owned = owned[-1][2] + owned[-1][1] - owned[-1][0]
        self.shard = torch.empty(n_owned, dtype=self.dtype, device=self.device)
        for lo, hi, pos in owned:
            self.shard[pos:pos + hi - lo] = read(lo, hi)
        offset = {id(p): o for p, o in zip(params, offsets)}
        late_ids = {id(p) for p in params if late(p)}
        # Late buckets: from the first one holding a late parameter to the end of the buffer, kept in full.
        late_start = min((o for p, o in zip(params, offsets) if id(p) in late_ids), default=padded)
        self.late_keys = [k for k, (s, e) in enumerate(buckets) if e > late_start]
        self.late_from = buckets[self.late_keys[0]][0] if self.late_keys else padded
        self.late = read(self.late_from, padded)

        def touched(ps):
            ks = set()
            for p in ps:
                o = offset[id(p)]
                ks.update(k for k, (s, e) in enumerate(buckets) if s < o + p.numel() and e > o)
            return sorted(ks)

        self.units: list[Unit] = []
        # A parameter two units use (a tied embedding and head on one stage) stays gathered, like the late ones.
        users: dict[int, int] = {}
        for chunk in modules:
            for mod in unit_modules(chunk):
                for p in mod.parameters():
                    users[id(p)] = users.get(id(p), 0) + 1
        placed: set[int] = set(late_ids) | {i for i, n in users.items() if n > 1}
        with torch.no_grad():
            for chunk in modules:
                prev = None
                for mod in unit_modules(chunk):
                    ps = [p for p in mod.parameters() if id(p) in offset and id(p) not in placed]
                    if not ps:
                        continue
                    unit = self._add_unit(mod, ps, touched(ps), read, offset)
                    self.release(unit)  # filled from the reader; gathered again when first used
                    placed.update(id(p) for p in ps)
                    unit.prev = prev
                    if prev is not None:
                        prev.next = unit
                    prev = unit
            # Parameters outside every unit, or in two, stay gathered, like the late ones.
            rest = [p for p in params if id(p) not in late_ids and (id(p) not in placed or users.get(id(p), 0) > 1)]
            if rest:
                self._add_unit(None, rest, touched(rest), read, offset, resident=True)
            for p in params:
                if id(p) in late_ids:
                    o = offset[id(p)] - self.late_from
                    p.data = self.late[o:o + p.numel()].view(p.shape)
        self.peak = 0  # most bytes of unit buffers alive at once (tests, the plan's working set)
        # gathers started, and how many of them were prefetches a later ensure() found in flight or done
        self.gathers = self.prefetched = 0
        self.prefetching = True  # off: every gather waited on when the layer needs it (benchmarks)
        self.wait_s = 0.0  # host seconds ensure() waited for gathers (benchmarks, CPU: gloo waits block)
        self._hooks = []
        # The hooks reach this object and the unit through weak references: a strong one would close a cycle
        # (module -> hook -> unit -> module) that kept a dropped model's memory until Python's cyclic GC ran.
        me = weakref.ref(self)
        for u in self.units:
            if u.module is not None:
                unit = weakref.ref(u)
                self._hooks.append(u.module.register_forward_pre_hook(
                    lambda m, a, unit=unit: _call(me, ParamShards._pre_forward, unit)))
                self._hooks.append(u.module.register_forward_hook(
                    lambda m, a, out, unit=unit: _call(me, ParamShards._post_forward, unit, out)))

    def _add_unit(self, mod, ps, keys, read, offset, resident=False) -> Unit:
        unit = Unit(mod, keys, self.buckets, self.dtype, self.device, resident)
        for k in keys:
            s, e = self.buckets[k]
            unit.buffer[unit.base[k]:unit.base[k] + e - s] = read(s, e)
        for p in ps:
            o = offset[id(p)]
            k = next(k for k in keys if self.buckets[k][0] <= o < self.buckets[k][1])
            at = unit.base[k] + o - self.buckets[k][0]  # buckets of a unit are consecutive in the buffer
            p.data = unit.buffer[at:at + p.numel()].view(p.shape)
        self.units.append(unit)
        return unit

    # -- gather / free ----------------------------------------------------------------------------------------
    def _start(self, u: Unit) -> None:
        """Allocate u's storage and start the all-gather of each of its buckets from the owned segments."""
        u.buffer.untyped_storage().resize_(u.nbytes)
        u.live, group = True, self._group()
        self.gathers += 1
        u.pending = []
        for k in u.keys:
            s, e = self.buckets[k]
            lo, hi, pos = self.owned[k]
            u.pending.append(comm.all_gather_into_start(u.buffer[u.base[k]:u.base[k] + e - s],
                                                        self.shard[pos:pos + hi - lo], group))
        self.peak = max(self.peak, self.gathered_bytes())

    def prefetch(self, u: Unit | None) -> None:
        if u is not None and not u.live and self.prefetching:
            self._start(u)
            u.prefetch = True

    def ensure(self, u: Unit) -> None:
        """u gathered (waits for its prefetch, or gathers now)."""
        if not u.live:
            self._start(u)
        elif u.prefetch:
            self.prefetched += 1
        u.prefetch = False
        if u.pending:
            t0 = time.perf_counter()
            for w in u.pending:
                w.wait()
            self.wait_s += time.perf_counter() - t0
        u.pending = None

    def release(self, u: Unit) -> None:
        if u.resident or not u.live:
            return
        if u.pending:  # a prefetch still writing into the storage
            for w in u.pending:
                w.wait()
            u.pending = None
        u.buffer.untyped_storage().resize_(0)
        u.live = u.prefetch = False

    def release_all(self) -> None:
        for u in self.units:
            self.release(u)

    def gathered_bytes(self) -> int:
        return sum(u.nbytes for u in self.units if u.live and not u.resident)

    # -- hooks ------------------------------------------------------------------------------------------------
    def _pre_forward(self, u: Unit) -> None:
        self.ensure(u)
        if not _in_backward():  # (a recomputation inside the backward walks forward: no prefetch)
            self.prefetch(u.next)

    def _post_forward(self, u: Unit, out) -> None:
        if _in_backward():  # recomputation: the backward that asked for it reads the weights next
            return
        if torch.is_grad_enabled():
            outs = out if isinstance(out, (tuple, list)) else (out,)
            for t in outs:
                if isinstance(t, torch.Tensor) and t.requires_grad:
                    t.register_hook(lambda g, u=u: self._pre_backward(u))
        if not self.keep:
            self.release(u)

    def _pre_backward(self, u: Unit) -> None:
        """u's output gradient is complete: u's backward is next, the units after it are done."""
        if not self.keep:
            for other in self.units:
                if other is not u and other is not u.prev:
                    self.release(other)
        self.ensure(u)
        self.prefetch(u.prev)

    # -- after an update, for readers -------------------------------------------------------------------------
    def refresh(self) -> None:
        """After the optimizer wrote `shard`: drop every gathered copy, re-gather the late buckets (and resident
        parameters) from the new shards."""
        self.release_all()
        group = self._group()
        pending = []
        for k in self.late_keys:
            s, e = self.buckets[k]
            lo, hi, pos = self.owned[k]
            pending.append(comm.all_gather_into_start(self.late[s - self.late_from:e - self.late_from],
                                                      self.shard[pos:pos + hi - lo], group))
        for u in self.units:
            if u.resident:
                u.live = False
                self._start(u)
                pending += u.pending
                u.pending = None
        for w in pending:
            w.wait()

    def full(self, padded: int, host: bool = False) -> torch.Tensor:
        """The whole flat weight buffer (model dtype), all-gathered bucket by bucket (collective over dp). `host`:
        in host memory, one bucket at a time through the device (a checkpoint writer copies to the host anyway,
        and the device may not have room for a second copy of the weights)."""
        group = self._group()
        if host and self.device.type != "cpu":
            out = torch.empty(padded, dtype=self.dtype, device="cpu")
            for (s, e), (lo, hi, pos) in zip(self.buckets, self.owned):
                tmp = torch.empty(e - s, dtype=self.dtype, device=self.device)
                out[s:e].copy_(comm.all_gather_into_start(tmp, self.shard[pos:pos + hi - lo], group).wait())
            return out
        out = torch.empty(padded, dtype=self.dtype, device=self.device)
        pending = [comm.all_gather_into_start(out[s:e], self.shard[pos:pos + hi - lo], group)
                   for (s, e), (lo, hi, pos) in zip(self.buckets, self.owned)]
        for w in pending:
            w.wait()
        return out

    def nbytes(self) -> int:
        """What stays allocated between uses: the owned shard, the late buckets, resident units."""
        return (self.shard.nbytes + self.late.nbytes
                + sum(u.nbytes for u in self.units if u.resident))

    def remove(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks = []
