"""Measure what a forward pass really keeps for the backward: the ground truth the plan's memory model is
tested against (and a tool to calibrate it on a new model or kernel).

Three instruments:
  live_activation_bytes(): every storage created during the forward (any op, any kernel, collectives too) that
      is still alive when the forward returns: what autograd saved, what torch.utils.checkpoint keeps for
      recomputation, and what the caller holds (the loss, a pipeline stage's output).
  saved_tensor_bytes(): the unique storages autograd saves for backward (torch.autograd.graph
      .saved_tensors_hooks; with torch 2.13 this includes the inputs a non-reentrant checkpoint keeps). The
      two agree up to what the caller holds (tests/test_plan_memory.py).
  peak_live_bytes(): the most bytes of storages created inside the block alive at once (checked after every
      op), and the largest one: a device-independent peak memory for CPU tests and benchmarks.
Parameters and whatever existed before the forward are excluded from both: pass them in `exclude`.
"""
from __future__ import annotations

import contextlib
import gc
import time

import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves


def _storage_key(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


def _new_storages(func, args, kwargs, out) -> list:
    """(tensor, weak storage reference) of an op's outputs that own a storage of their own: an output sharing
    an input's storage (a view, an in-place or out= op) allocated nothing, except lift_fresh's (the way a
    torch.tensor(...) made inside the block reaches the dispatcher: its input is that new tensor). One entry per
    storage object (not per address: a storage resized to zero bytes, as ZeRO-3 frees a gathered layer, gives its
    address to the next allocation while staying alive itself)."""
    inputs = set() if func is torch.ops.aten.lift_fresh.default else {
        StorageWeakRef(t.untyped_storage()).cdata for t in tree_leaves((args, kwargs))
        if isinstance(t, torch.Tensor) and t.device.type != "meta"}
    found = []
    for t in (out if isinstance(out, (tuple, list)) else (out,)):
        if isinstance(t, torch.Tensor) and t.device.type != "meta":
            ref = StorageWeakRef(t.untyped_storage())
            if ref.cdata not in inputs:
                found.append((t, ref))
    return found


class _LiveStorages(TorchDispatchMode):
    """Remembers (weakly) the storage of every tensor an op returns."""

    def __init__(self, exclude: set[int]):
        super().__init__()
        self.exclude = exclude
        self.seen: dict[int, tuple[StorageWeakRef, int, str]] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t, ref in _new_storages(func, args, kwargs, out):
            if _storage_key(t) not in self.exclude and ref.cdata not in self.seen:
                self.seen[ref.cdata] = (ref, t.untyped_storage().nbytes(), str(func))
        return out


class LiveBytes:
    """Result of live_activation_bytes(): `.total` bytes, `.by_op` (creating op -> bytes) once the block ends."""

    total: int = 0
    by_op: dict


@contextlib.contextmanager
def live_activation_bytes(exclude=()):
    """with live_activation_bytes(model.parameters()) as r: loss = model(x)  ->  r.total, r.by_op.

    Count only what the block creates; keep references to the outputs you hold (the loss) inside the block's
    caller, as a training step would."""
    keys = {_storage_key(t) for t in exclude}
    result = LiveBytes()
    mode = _LiveStorages(keys)
    # What exists before the block is no garbage of it: frozen, the collections below walk only the block's
    # objects (a full collection walks the whole process, a test session's modules included: 0.2 s and more).
    gc.freeze()
    try:
        with mode:
            yield result
        _settle(mode, result)
    finally:
        gc.unfreeze()


def _settle(mode, result) -> None:
    # A collective's buffers can outlive the call for a moment: gloo's worker thread drops its reference to a
    # finished work object only after the caller's wait() has returned (a thread descheduled on a busy machine
    # holds it for milliseconds). Nothing is allocated any more, so the live set only shrinks: read it until it
    # has been stable for a while (bounded).
    previous, stable_since, deadline = None, time.monotonic(), time.monotonic() + 2.0
    while True:
        gc.collect()  # reference cycles (e.g. in autograd.Function bookkeeping) are garbage, not activations
        by_op = {}
        for ref, nbytes, op in mode.seen.values():
            if not ref.expired():
                # its size now: a storage resized since (ZeRO-3 frees a gathered layer's to zero bytes) counts as is
                nbytes = torch.UntypedStorage._new_with_weak_ptr(ref.cdata).nbytes()
                by_op[op] = by_op.get(op, 0) + nbytes
        total, now = sum(by_op.values()), time.monotonic()
        if total != previous:
            previous, stable_since = total, now
        if now - stable_since >= 0.05 or now >= deadline:
            break
        time.sleep(0.005)
    result.by_op, result.total = by_op, total


class PeakBytes:
    """Result of peak_live_bytes(): `.peak` (most bytes alive at once) and `.largest` (one storage), once the
    block ends."""

    peak: int = 0
    largest: int = 0


class _PeakStorages(TorchDispatchMode):
    """After every op, the bytes of the storages created since the start that are still alive."""

    def __init__(self, result: PeakBytes):
        super().__init__()
        self.result, self.live = result, {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t, ref in _new_storages(func, args, kwargs, out):
            if ref.cdata not in self.live:
                self.live[ref.cdata] = (ref, t.untyped_storage().nbytes())
                self.result.largest = max(self.result.largest, t.untyped_storage().nbytes())
        self.live = {k: v for k, v in self.live.items() if not v[0].expired()}
        self.result.peak = max(self.result.peak, sum(n for _, n in self.live.values()))
        return out


@contextlib.contextmanager
def peak_live_bytes():
    """with peak_live_bytes() as r: loss = f(x); loss.backward()  ->  r.peak, r.largest (bytes): what the block
    allocated, at its fullest moment between two ops (an op's own scratch space inside a kernel is not seen).
    Storages that existed before the block (weights, inputs) are not counted."""
    result = PeakBytes()
    with _PeakStorages(result):
        yield result


@contextlib.contextmanager
def saved_tensor_bytes(exclude=()):
    """with saved_tensor_bytes(model.parameters()) as r: loss = model(x)  ->  r.total (unique storages)."""
    keys = {_storage_key(t) for t in exclude}
    storages: dict[int, int] = {}
    result = LiveBytes()

    def pack(t):
        key = _storage_key(t)
        if key not in keys and t.device.type != "meta":
            storages[key] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        yield result
    result.total = sum(storages.values())
    result.by_op = {}


def forward_activation_bytes(model, micro_batch: int, seq_len: int, *, hooks: bool = False, seed: int = 1,
                             loss=None) -> int:
    """Bytes one micro-batch's forward through `model` (a tpzoo Transformer chunk) leaves for its backward,
    held the way tpzoo.pipeline's engine holds them: the received input (non-first chunks, seq-sharded under
    sequence parallelism), the output (a middle chunk), or the summed loss (the last chunk, with `loss`: its
    tpzoo.models.LossOptions, e.g. fused=False)."""
    from tpzoo.models import Inputs

    g = torch.Generator(device="cpu").manual_seed(seed)
    cfg = model.cfg
    param = next(model.parameters())
    ids = torch.randint(0, cfg.vocab_size, (micro_batch, seq_len), generator=g, device="cpu").to(param.device)
    labels = torch.randint(0, cfg.vocab_size, (micro_batch, seq_len), generator=g, device="cpu").to(param.device)
    kept = [ids, labels] + list(model.parameters())
    meter = saved_tensor_bytes(kept) if hooks else live_activation_bytes(kept)
    with meter as r:
        hidden = None
        if not model.pre_process:  # what the engine receives: created now, as its receive buffer would be
            s_local = seq_len // model.dims.tp if model.sequence_parallel else seq_len
            hidden = torch.randn(micro_batch, s_local, cfg.hidden_size, generator=g, device="cpu").to(
                param.device, param.dtype)
            hidden.requires_grad_()
        inputs = Inputs(ids if model.pre_process else None, hidden, labels=labels if model.post_process else None)
        if model.post_process and model.mtp is not None and loss is not None and loss.mtp is not None:
            from tpzoo.data.mtp import mtp_targets  # multi-token prediction's inputs and targets (models/mtp.py)

            inputs.mtp_ids, inputs.mtp_labels = mtp_targets(ids, labels, cfg.mtp_depths)
        out = model(inputs, loss=loss)
        out = out.sum() if model.post_process else out
    return r.total


def tp_layer_collectives(cfg, micro_batch: int, seq_len: int, *, sequence_parallel: bool = False,
                         recompute: str = "none", dims=None) -> dict:
    """Collectives over the TP group of one forward + backward through cfg.num_layers layers (no embedding, no
    head) at `dims` (default: the default dims): {kind: (calls, elements, sent_bytes)}, the ground truth for
    the per-layer communication analysis."""
    from tpzoo.models import Inputs, ModelLayout, Stage, Transformer, apply_recompute
    from tpzoo.parallel import count_collectives

    model = apply_recompute(Transformer(cfg, ModelLayout(dims, sequence_parallel=sequence_parallel),
                                        Stage(pre_process=False, post_process=False)), recompute)
    local_seq = seq_len // model.dims.tp if sequence_parallel else seq_len
    x = torch.randn(micro_batch, local_seq, cfg.hidden_size, device=model.device, requires_grad=True)
    with count_collectives() as c:
        model(Inputs(hidden=x)).square().sum().backward()
    return {k: (s.calls, s.elements, s.sent_bytes) for (k, g), s in sorted(c.stats.items()) if g == "tp"}
