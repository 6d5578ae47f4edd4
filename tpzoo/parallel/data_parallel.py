"""Main gradients in fp32 and their data-parallel reduction: the one place gradients are summed over replicas.

Megatron-style mixed precision: every parameter gets `main_grad`, an fp32 view into one flat buffer. A hook that
runs as soon as autograd has accumulated a parameter's gradient adds it into `main_grad` and frees `.grad`, so
micro-batch gradients accumulate in fp32 (no 16-bit rounding, however many micro-batches) and no 16-bit gradient
is kept between them: a bf16 step holds 2 (weights) + 4 (main grads) + 12 (fp32 master, Adam moments) = 18
bytes per parameter, as Megatron's does.

The data-parallel reduction is a SUM over the replicas (the training loop scales each micro-batch's loss by
1 / tokens of the global batch, so the sum is the gradient of the global mean loss), in fp32, bucket by bucket:
an all-reduce of each bucket, or under ZeRO a reduce-scatter that leaves each rank the fp32 sum of its 1/dp of
every bucket. Every replica lays out the same parameters in the same order, so the buffers line up element for
element.

Buckets and overlap. The flat buffer is cut into buckets of `bucket_elems` (a multiple of dp, so each splits
evenly; a bucket may cut through a parameter). With overlap on (`begin`), a bucket's reduction starts,
asynchronously, as soon as every parameter in it has received its last gradient of the step: the executor arms a
chunk's parameters for its last backward pass (`grad_pass(last=True)`; with pipelining, the last micro-batch's
backward of that chunk, or zero-bubble's last W), and their hooks then mark them final. Buckets start in a fixed
order (from the end of the buffer, the order backward produces gradients), so every replica issues the same
collectives in the same order. `finish` starts what is left and waits; the optimizer waits only for what is
still in flight.

Late parameters. Gradients that another reduction still changes after the backward (finalize_grads: replicated
parameters summed over tp under sequence parallelism, kv heads replicated over tp ranks, tied embedding copies)
are not final when their hooks run. They are laid out last, and the buckets holding them are reduced by
`finish`, after finalize_grads (sums commute, but a reduce-scattered bucket keeps only this rank's part).

Across replicas (`cross`: hierarchical data parallelism, tpzoo.train.diloco with --sync-every 1): `group` is then
the replica's own dp x cp ranks, and `finish` also sums the reduced gradients over the replicas, sending over the
slow link only what each rank owns: every bucket is reduce-scattered inside the replica (also without ZeRO), the
rank's shard all-reduced across the replicas (one call), and, without ZeRO, all-gathered back inside the replica.
ZeRO keeps its shards: the optimizer state is sharded inside a replica and replicated across them.

Gradient-accumulation fusion (`fuse`, on by default): the linear layers accumulate their weight gradients straight
into `fused_target(param)` (the main gradient) and autograd delivers None; the same hook then only marks the
parameter delivered (tpzoo.parallel.wgrad).
"""
from __future__ import annotations

import contextlib
import time
import weakref

import torch

from . import comm
from .dims import SELF_GROUP
from .utils import param_spec
from .wgrad import grad_buffer_of, hooks_see_fused_grads

DEFAULT_BUCKET_ELEMS = 1 << 24  # 64 MiB of fp32 per collective call


def is_late(param, tp: int | None = None, pp: int | None = None) -> bool:
    """Whether finalize_grads still changes this parameter's gradient after the backward passes. With the
    layout's tp and pp known, only where it does (SP and kv-head replicas need tp > 1, tied copies pp > 1)."""
    spec = param_spec(param)
    multi_tp, multi_pp = tp is None or tp > 1, pp is None or pp > 1
    return bool((multi_tp and getattr(param, "sequence_parallel", False))
                or (multi_pp and getattr(param, "tied_group", None))
                or (multi_tp and spec.dim is not None and spec.replicas and max(spec.replicas) > 1))


def _grad_ready(param: torch.Tensor) -> None:
    """Post-accumulate hook: hand autograd's gradient to the buffer (fp32) and free the 16-bit .grad (None when
    every use of the parameter accumulated its gradient itself: gradient-accumulation fusion)."""
    grad_buffer_of(param).add(param, param.grad)
    param.grad = None


def accumulate_grad(param: torch.Tensor, grad: torch.Tensor | None) -> None:
    """Add a gradient computed outside autograd's accumulation (zero-bubble's W pass) where the parameter keeps
    its gradient: its GradBuffer when one is attached, else .grad. None: the pass delivered it already (fused into
    the buffer) or had none for it; a GradBuffer still learns that the pass is done with the parameter."""
    buf = grad_buffer_of(param)
    if buf is not None:
        buf.add(param, grad)
    elif grad is None:
        return
    elif param.grad is None:
        param.grad = grad.clone()  # a copy: autograd may hand the same tensor to two parameters
    else:
        param.grad.add_(grad)


@contextlib.contextmanager
def grad_pass(params, last: bool):
    """The pipeline executor runs every pass that produces weight gradients (B, or zero-bubble's W) inside this;
    `last`: the chunk's last such pass of the step, after which its gradients are final. No-op without a
    GradBuffer."""
    buffers = {id(b): b for b in (grad_buffer_of(p) for p in params) if b is not None}
    for b in buffers.values():
        b.pass_begins(params, last)
    yield
    for b in buffers.values():
        b.pass_ends()


def flat_layout(params, pad_to: int = 1, late=is_late) -> tuple[list, list[int], int, int]:
    """(each distinct Parameter once, the `late` ones last; its offset in a flat buffer; elements; elements padded
    to a multiple of pad_to): the layout the GradBuffer and the optimizer's flat buffers share."""
    unique = list({id(p): p for p in params}.values())
    unique = [p for p in unique if not late(p)] + [p for p in unique if late(p)]
    offsets, off = [], 0
    for p in unique:
        offsets.append(off)
        off += p.numel()
    return unique, offsets, off, -(-max(off, 1) // pad_to) * pad_to


def bucket_ranges(padded: int, pad_to: int, bucket_elems: int) -> list[tuple[int, int]]:
    """Flat ranges of the buckets: `bucket_elems` rounded up to a multiple of pad_to (the last one shorter)."""
    size = -(-max(bucket_elems, 1) // pad_to) * pad_to
    return [(s, min(s + size, padded)) for s in range(0, padded, size)]


def shard_segments(buckets: list[tuple[int, int]], dp: int, rank: int) -> list[tuple[int, int]]:
    """The flat ranges dp rank `rank` owns under ZeRO: its 1/dp of every bucket (what a reduce-scatter of the
    bucket leaves it). Laid end to end they are its shard, padded/dp elements: bucket (s, e) lands at s/dp."""
    out = []
    for s, e in buckets:
        n = (e - s) // dp
        out.append((s + rank * n, s + (rank + 1) * n))
    return out


def _detach(hooks, params, ref) -> None:
    """A dropped GradBuffer's parameters back to plain .grad: its hooks removed, and its main_grad views where
    no later buffer has taken the parameter over."""
    for h in hooks:
        h.remove()
    for p in (w() for w in params):
        if p is not None and getattr(p, "_grad_buffer", None) is ref:
            del p._grad_buffer
            if hasattr(p, "main_grad"):
                del p.main_grad


class GradBuffer:
    """fp32 main gradients of `params` (each distinct Parameter once, late ones last) in one flat buffer on
    `device`, padded to a multiple of `pad_to` (the dp size, so ZeRO can split every bucket evenly). Keep a
    reference to it (DistributedAdamW keeps its own) for as long as it is to collect gradients: the parameters
    hold it only weakly, and once it is dropped they are plain parameters again."""

    def __init__(self, params, *, device, pad_to: int = 1, bucket_elems: int = DEFAULT_BUCKET_ELEMS, late=is_late,
                 fuse: bool = True):
        self.params, self.offsets, self.numel, self.padded = flat_layout(params, pad_to, late)
        # gradient-accumulation fusion: layers accumulate into fused_target() (needs the hook to see it)
        self.fuse = fuse and hooks_see_fused_grads()
        self.pad_to, self.device = pad_to, device
        self.buckets = bucket_ranges(self.padded, pad_to, bucket_elems)
        size = self.buckets[0][1]
        self.late = [False] * len(self.buckets)
        self._of_param = {}  # id(param) -> indices of the buckets it lies in
        for p, o in zip(self.params, self.offsets):
            ks = list(range(o // size, (o + p.numel() - 1) // size + 1)) if p.numel() else []
            self._of_param[id(p)] = ks
            for k in ks:
                self.late[k] = self.late[k] or late(p)
        self._group, self._pending, self.shard_grad = None, {}, None
        self.cross = SELF_GROUP  # the optimizer sets it: the group the reduced gradients are summed over as well
        self.started, self.overlapped = [], 0
        self._allocate()
        hooks, ref = [], weakref.ref(self)  # weak: the buffer holds its parameters (wgrad.grad_buffer_of)
        for p in self.params:
            p.grad = None
            p._grad_buffer = ref
            hooks.append(p.register_post_accumulate_grad_hook(_grad_ready))
        # Dropped (its owner, the optimizer, gone) or remove()d: the parameters go back to plain autograd gradients.
        self._release = weakref.finalize(self, _detach, hooks, [weakref.ref(p) for p in self.params], ref)
        self.armed: set[int] = set()

    def _allocate(self) -> None:
        self.data = torch.zeros(self.padded, dtype=torch.float32, device=self.device)
        for p, o in zip(self.params, self.offsets):
            p.main_grad = self.data[o:o + p.numel()].view(p.shape)

    def add(self, param, grad: torch.Tensor | None) -> None:
        """A pass delivered param's gradient: `grad` (any dtype) added into it, or None (fused: already in)."""
        if grad is not None:
            self.accumulate(param, grad)
        self.delivered(param)

    def accumulate(self, param, grad: torch.Tensor) -> None:
        param.main_grad.add_(grad)

    def fused_target(self, param) -> torch.Tensor | None:
        """The fp32 tensor (param's shape) a fused layer accumulates param's gradient into now."""
        return param.main_grad

    def pass_begins(self, params, last: bool) -> None:
        if last:  # what these parameters receive now is their last gradient of the step
            self.armed.update(id(p) for p in params)

    def pass_ends(self) -> None:
        pass

    def zero(self) -> None:
        self.data.zero_()
        for p in self.params:
            p.grad = None
        self.armed.clear()
        self._group, self._pending = None, {}

    # -- the reduction ------------------------------------------------------------------------------------
    def begin(self, group, *, shard: bool = False) -> None:
        """Start of a step's backward passes (after zero()): reduce each bucket over `group` as soon as its
        gradients are final (see the module docstring), all-reduced, or with `shard` reduce-scattered."""
        self._group, self._shard = group, shard
        # across replicas every bucket is reduce-scattered inside the replica first, with ZeRO or without
        self._scatter = (shard or comm.group_size(self.cross) > 1) and comm.group_size(group) > 1
        self._waiting = [0] * len(self.buckets)
        for ks in self._of_param.values():
            for k in ks:
                self._waiting[k] += 1
        self._final: set[int] = set()
        self._next = len(self.buckets) - 1  # buckets start from the end of the buffer, in order
        self.started: list[tuple[int, float]] = []  # (bucket, perf_counter) at each start: tests, benchmarks
        self.overlapped = 0  # buckets started during the backward passes (before finish)
        if self._scatter and self.shard_grad is None:
            self.shard_grad = torch.empty(self.padded // comm.group_size(group), dtype=torch.float32,
                                          device=self.device)

    def delivered(self, param) -> None:
        """A pass delivered param's gradient into param.main_grad (hook): with the chunk armed, it is final."""
        if self._group is None or id(param) not in self.armed or id(param) in self._final:
            return
        self._final.add(id(param))
        for k in self._of_param[id(param)]:
            self._waiting[k] -= 1
        while self._next >= 0 and (self.late[self._next] or self._waiting[self._next] == 0):
            if not self.late[self._next]:
                self._start(self._next)
            self._next -= 1

    def _start(self, k: int) -> None:
        s, e = self.buckets[k]
        self.started.append((k, time.perf_counter()))
        if self._scatter:
            p = comm.group_size(self._group)
            out = self.shard_grad[s // p:e // p]
            self._pending[k] = comm.reduce_scatter_into_start(out, self.data[s:e], self._group)
        else:
            self._pending[k] = comm.all_reduce_start(self.data[s:e], self._group)

    def finish(self) -> torch.Tensor:
        """After finalize_grads: start every bucket not started yet (late ones, and any whose parameters got no
        gradient in an armed pass), from the end of the buffer, then wait for all. Returns the whole buffer
        (all-reduced), or under ZeRO this rank's shard (fp32, its 1/dp of every bucket end to end)."""
        self.overlapped = len(self._pending)
        for k in reversed(range(len(self.buckets))):
            if k not in self._pending:
                self._start(k)
        for k in reversed(range(len(self.buckets))):
            self._pending[k].wait()
        if comm.group_size(self.cross) > 1:
            self._across_replicas()
        self._group, self._pending = None, {}
        self.armed.clear()
        if self._shard and self._scatter:
            return self.shard_grad
        return self.data

    def _across_replicas(self) -> None:
        """Sum what this rank holds of the reduced gradients over the replicas (one all-reduce), then without ZeRO
        all-gather the buckets back inside the replica."""
        if not self._scatter:  # one rank per replica: its whole buffer crosses
            comm.all_reduce_start(self.data, self.cross).wait()
            return
        comm.all_reduce_start(self.shard_grad, self.cross).wait()
        if not self._shard:
            p = comm.group_size(self._group)
            pending = [comm.all_gather_into_start(self.data[s:e], self.shard_grad[s // p:e // p], self._group)
                       for s, e in self.buckets]
            for w in pending:
                w.wait()

    def reduce(self, group, *, shard: bool = False) -> torch.Tensor:
        """Sum the main gradients over `group` (the data(-context)-parallel ranks) now, every bucket at once
        (no overlap). Returns the whole buffer, or with `shard` this rank's 1/size of every bucket (fp32)."""
        if comm.group_size(group) == 1 and comm.group_size(self.cross) == 1:
            return self.data
        self.begin(group, shard=shard)
        return self.finish()

    def nbytes(self) -> int:
        return self.data.nbytes

    def remove(self) -> None:
        """Detach from the parameters (their gradients go back to plain .grad), as dropping it does."""
        self._release()
