"""Deterministic, data-parallel, exactly resumable batches over a map-style dataset, prefetched on a thread.

Order. Epoch ``e`` visits the dataset's samples in the permutation drawn from ``numpy.random.default_rng([seed,
e])`` (or in index order with ``shuffle=False``). Every rank computes the same permutation. The permutation is
cut into *global micro-batches* of ``micro_batch_size * dp_size`` samples; data-parallel rank ``r`` takes the
``r``-th slice of ``micro_batch_size`` of each, so ranks see disjoint samples and together cover every sample of
the epoch except the tail that does not fill a whole global micro-batch (dropped, so every rank yields the same
number of batches and no rank waits on a collective the others never reach; a different tail each epoch).

State. The position is ``(epoch, consumed)``: ``consumed`` counts *global* samples (all ranks) taken in this
epoch, so it is the same number on every rank and a checkpoint needs only rank 0's copy. ``state_dict()``
describes what the consumer has received (batches prefetched but not yet taken do not count), and a new loader
given ``load_state_dict(state)`` yields exactly the batches an uninterrupted loader would have yielded next. A
state may be loaded with another ``dp_size`` / ``micro_batch_size`` when ``consumed`` is a multiple of the new
global micro-batch.

Batches are host (CPU) tensors, pinned with ``pin_memory=True`` so the copy to a GPU can overlap compute.

Prefetch. With ``prefetch > 0`` a daemon thread fills a bounded queue of ready batches; ``wait_seconds`` is the
time the consumer spent blocked waiting for a batch and ``wait_fraction`` that time over the wall time since the
loader started (or since ``reset_wait_stats()``), for logging whether the input pipeline keeps up.
"""
from __future__ import annotations

import queue
import threading
import time
import weakref
from typing import Callable

import numpy as np
import torch

from tpzoo.errors import ConfigError, DataError

__all__ = ["PrefetchingLoader", "ResumableLoader", "micro_batches_per_step", "collate_long"]

_END = object()


def micro_batches_per_step(global_batch_size: int, micro_batch_size: int, dp_size: int) -> int:
    """Micro-batches each data-parallel rank runs per optimizer step (gradient-accumulation steps)."""
    if min(global_batch_size, micro_batch_size, dp_size) < 1:
        raise ConfigError(f"batch sizes must be positive: global={global_batch_size} micro={micro_batch_size} "
                         f"dp={dp_size}")
    per_step = micro_batch_size * dp_size
    if global_batch_size % per_step:
        raise ConfigError(f"global batch size {global_batch_size} is not divisible by micro_batch_size "
                         f"{micro_batch_size} x dp_size {dp_size} = {per_step}")
    return global_batch_size // per_step


def collate_long(samples: list[dict]) -> dict[str, torch.Tensor]:
    """Stack per-sample numpy arrays into ``[batch, ...]`` int64 tensors, key by key (floating arrays stay fp32: a
    distillation cache's log-probabilities)."""
    def stacked(k):
        a = np.stack([s[k] for s in samples])
        return a.astype(np.float32 if a.dtype.kind == "f" else np.int64, copy=False)

    return {k: torch.from_numpy(stacked(k)) for k in samples[0]}


class PrefetchingLoader:
    """The machinery every resumable loader shares: a position, batches made from it (synchronously or on a
    prefetch thread filling a bounded queue), wait statistics, pinned memory, close().

    A subclass sets ``self.pos`` (an immutable value: where the next batch starts) and implements
    ``_make_batch(pos) -> (batch, next_pos)`` and ``_finished(pos)``. ``self.pos`` always describes what the
    consumer has received: batches the thread made but the consumer has not taken do not count.
    """

    def __init__(self, prefetch: int, collate: Callable[[list[dict]], dict], pin_memory: bool):
        self.prefetch, self.collate = prefetch, collate
        # Pinned (page-locked) host batches let the trainer's copy to a GPU run asynchronously (non_blocking).
        self.pin_memory = pin_memory
        self._thread, self._queue, self._stop = None, None, None
        self.reset_wait_stats()

    def _make_batch(self, pos):
        raise NotImplementedError

    def _finished(self, pos) -> bool:
        raise NotImplementedError

    def _collate(self, samples: list[dict]) -> dict:
        batch = self.collate(samples)
        if self.pin_memory:
            batch = {k: v.pin_memory() if isinstance(v, torch.Tensor) else v for k, v in batch.items()}
        return batch

    def _seek(self, pos) -> None:
        """Continue from ``pos`` (a state being loaded): batches already prefetched are dropped."""
        self._stop_thread()
        self.pos = pos

    # -- iteration ------------------------------------------------------------------------------------------
    def _start_thread(self) -> None:
        self._queue, self._stop = queue.Queue(maxsize=self.prefetch), threading.Event()
        self._thread = threading.Thread(target=_produce, args=(weakref.ref(self), self.pos, self._queue, self._stop),
                                        name="tpzoo-data-prefetch", daemon=True)
        self._thread.start()

    def _stop_thread(self) -> None:
        if self._thread is None:
            return
        self._stop.set()
        while self._thread.is_alive():
            try:  # unblock a producer waiting on a full queue
                self._queue.get_nowait()
            except queue.Empty:
                pass
            self._thread.join(timeout=0.05)
        self._thread = self._queue = self._stop = None

    def __iter__(self):
        return self

    def __next__(self) -> dict:
        if self.prefetch <= 0:
            t0 = time.perf_counter()
            if self._finished(self.pos):
                raise StopIteration
            batch, self.pos = self._make_batch(self.pos)
            self.wait_seconds += time.perf_counter() - t0
            return batch
        if self._thread is None:
            if self._finished(self.pos):
                raise StopIteration
            self._start_thread()
        t0 = time.perf_counter()
        item = self._queue.get()
        self.wait_seconds += time.perf_counter() - t0
        if item is _END:
            self._stop_thread()
            raise StopIteration
        if isinstance(item, BaseException):
            self._stop_thread()
            raise item
        batch, self.pos = item
        return batch

    def reset_wait_stats(self) -> None:
        """Restart the clock for ``wait_seconds`` / ``wait_fraction`` (e.g. after each logging interval)."""
        self.wait_seconds = 0.0
        self._clock_start = time.perf_counter()

    @property
    def wait_fraction(self) -> float:
        """Share of wall time since the last reset that the consumer spent waiting for data."""
        elapsed = time.perf_counter() - self._clock_start
        return self.wait_seconds / elapsed if elapsed > 0 else 0.0

    def close(self) -> None:
        self._stop_thread()

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self):
        if getattr(self, "_stop", None) is not None:  # a dropped loader: its producer sees this and exits
            self._stop.set()


class ResumableLoader(PrefetchingLoader):
    """Batches of ``dataset`` (``len()`` and ``dataset[i] -> dict of arrays``) for one data-parallel rank.

    An iterator: ``next(loader)`` returns ``collate([dataset[i] for i in this rank's micro-batch])``. It runs
    for ``num_epochs`` epochs, or forever with ``num_epochs=None`` (a training loop stops by step count).
    Call ``close()`` (or use it as a context manager) to stop the prefetch thread early.
    """

    def __init__(self, dataset, micro_batch_size: int, *, dp_rank: int = 0, dp_size: int = 1, seed: int = 0,
                 shuffle: bool = True, num_epochs: int | None = None, prefetch: int = 2,
                 collate: Callable[[list[dict]], dict] = collate_long, pin_memory: bool = False):
        check_dp_rank(dp_rank, dp_size, micro_batch_size)
        super().__init__(prefetch, collate, pin_memory)
        self.dataset, self.micro_batch_size = dataset, micro_batch_size
        self.dp_rank, self.dp_size, self.seed, self.shuffle = dp_rank, dp_size, seed, shuffle
        self.num_epochs = num_epochs
        self.num_samples = len(dataset)
        self.global_micro_batch = micro_batch_size * dp_size
        self.samples_per_epoch = self.num_samples // self.global_micro_batch * self.global_micro_batch
        if self.samples_per_epoch == 0:
            raise DataError(f"dataset has {self.num_samples} samples, fewer than one global micro-batch "
                             f"(micro_batch_size {micro_batch_size} x dp_size {dp_size})")
        self.pos = (0, 0)  # (epoch, global samples consumed in it)
        self._order_epoch, self._order = None, None

    @property
    def epoch(self) -> int:
        return self.pos[0]

    @property
    def consumed(self) -> int:
        return self.pos[1]

    # -- order ----------------------------------------------------------------------------------------------
    def epoch_order(self, epoch: int) -> np.ndarray:
        """The global sample order of ``epoch`` (the same on every rank)."""
        if self.shuffle:
            return np.random.default_rng([self.seed, epoch]).permutation(self.num_samples)
        return np.arange(self.num_samples)

    def _order_for(self, epoch: int) -> np.ndarray:
        if self._order_epoch != epoch:  # cached: one permutation per epoch, built by whichever thread asks
            self._order, self._order_epoch = self.epoch_order(epoch), epoch
        return self._order

    def _normalize(self, epoch: int, consumed: int) -> tuple[int, int]:
        if consumed + self.global_micro_batch > self.samples_per_epoch:
            return epoch + 1, 0
        return epoch, consumed

    def _make_batch(self, pos):
        """(batch, position after it) for the global micro-batch starting at ``pos = (epoch, consumed)``."""
        epoch, consumed = pos
        start = consumed + self.dp_rank * self.micro_batch_size
        indices = self._order_for(epoch)[start:start + self.micro_batch_size]
        batch = self._collate([self.dataset[int(i)] for i in indices])
        return batch, self._normalize(epoch, consumed + self.global_micro_batch)

    def _finished(self, pos) -> bool:
        return self.num_epochs is not None and pos[0] >= self.num_epochs

    def __len__(self) -> int:
        """Batches per epoch on this rank."""
        return self.samples_per_epoch // self.global_micro_batch

    # -- state ----------------------------------------------------------------------------------------------
    @property
    def consumed_samples(self) -> int:
        """Global samples consumed since the start of training (all epochs, all ranks)."""
        return self.epoch * self.samples_per_epoch + self.consumed

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "consumed_in_epoch": self.consumed, "consumed_samples": self.consumed_samples,
                "seed": self.seed, "shuffle": self.shuffle, "num_samples": self.num_samples}

    def load_state_dict(self, state: dict) -> None:
        check_state(state, self, ("seed", "shuffle", "num_samples"), "epoch")
        epoch, consumed = int(state["epoch"]), int(state["consumed_in_epoch"])
        if consumed % self.global_micro_batch:
            raise ConfigError(f"cannot resume at sample {consumed} of epoch {epoch}: not a multiple of "
                             f"micro_batch_size x dp_size = {self.global_micro_batch}")
        self._seek(self._normalize(epoch, consumed))


def check_dp_rank(dp_rank: int, dp_size: int, micro_batch_size: int) -> None:
    if not 0 <= dp_rank < dp_size:
        raise ValueError(f"dp_rank {dp_rank} is not in [0, dp_size={dp_size})")
    if micro_batch_size < 1:
        raise ValueError(f"micro_batch_size must be positive, got {micro_batch_size}")


def check_state(state: dict, loader, keys, required: str) -> None:
    """Refuse a loader state another kind of loader saved (a mixture's for one corpus, or the reverse), or one
    whose data or order changed since the checkpoint (naming the key and both values)."""
    if required not in state:
        theirs = "a weighted mixture's" if "mixture" in state else "a single corpus's"
        raise DataError(f"the checkpoint's data-loader state is {theirs}, but this run's data is "
                        f"{'a weighted mixture' if required == 'mixture' else 'one corpus'}: the data changed "
                        f"since the checkpoint")
    for key in keys:
        if key in state and state[key] != getattr(loader, key):
            raise DataError(f"loader state has {key}={state[key]!r} but this loader has "
                             f"{getattr(loader, key)!r}: the data or its order changed since the checkpoint")


def _produce(loader_ref, pos, q: queue.Queue, stop: threading.Event) -> None:
    """The prefetch thread: batches from ``pos`` onwards into ``q`` until stopped or finished.

    It holds the loader only through a weak reference while it waits on the queue, so a loader dropped without
    close() is still collected (and its ``__del__`` stops this thread).
    """
    try:
        while not stop.is_set():
            loader = loader_ref()
            if loader is None:
                return
            if loader._finished(pos):
                item = _END
            else:
                batch, pos = loader._make_batch(pos)
                item = (batch, pos)
            del loader
            _put(q, item, stop)
            if item is _END:
                return
    except BaseException as e:  # handed to the consumer, which re-raises it
        _put(q, e, stop)


def _put(q: queue.Queue, item, stop: threading.Event) -> None:
    while not stop.is_set():  # time out now and then to notice a stop request
        try:
            q.put(item, timeout=0.1)
            return
        except queue.Full:
            continue
