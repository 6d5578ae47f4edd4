"""ZeRO-2 gradients: reduce-scattered into this rank's shard as buckets fill, no full-size fp32 gradient buffer.

The layout, the buckets and the shard are the GradBuffer's (tpzoo.parallel.data_parallel): dp rank d owns its 1/dp
of every bucket, and its fp32 shard (`shard_grad`, padded/dp elements) is where the step's summed gradients
accumulate. What differs is where a gradient goes between autograd and that shard:

- Every pass that produces weight gradients (each micro-batch's backward, or zero-bubble's W) runs inside
  `grad_pass`. A gradient autograd hands over is added into a bucket-sized fp32 staging buffer, and its 16-bit
  .grad freed (with gradient-accumulation fusion a linear layer accumulates its weight's gradient into the
  staging buffer itself when the weight lies inside one bucket: `fused_target`). When the pass has delivered
  every gradient of a bucket it touches, the bucket's reduce-scatter starts (asynchronously, buckets of a pass in
  a fixed order: from the end of the buffer, so every replica issues the same collectives in the same order);
  what is left starts when the pass ends. So micro-batches are summed by the reduce-scatters (as DeepSpeed's
  ZeRO-2 and FSDP do), one collective per bucket and micro-batch: m times the communication of ZeRO-1 for m
  micro-batches, for (dp-1)/dp of the gradient memory.
- Accumulation without a second buffer: before a bucket's gradients go in, its staging buffer's own segment
  (this rank's 1/dp) is set to what the shard already holds for it. A reduce-scatter sums the segment over the
  replicas, so rank d receives sum over replicas of this pass's gradients + its own running sum, written straight
  into shard_grad.
- A staging buffer lives from a bucket's first gradient of the pass until its reduce-scatter completes; a bucket
  starts a new pass's staging only after its previous reduce-scatter is waited on (it reads the shard).
- Late buckets (holding parameters that finalize_grads still changes: SP-replicated norms, replicated kv heads,
  tied embedding copies; laid out last) keep full fp32 storage and `main_grad` views, as in the GradBuffer, and
  are reduce-scattered by `finish`, after finalize_grads. Their size is what ZeRO-2 keeps beyond 4/dp bytes per
  parameter (docs/plan.md).

Without overlap every reduce-scatter is waited on as soon as it starts (at the end of each pass). Across replicas
(`cross`, tpzoo.parallel.data_parallel) the shard is all-reduced over the replicas once, in `finish`: one
exchange over the slow link per step, whatever the number of micro-batches.
"""
from __future__ import annotations

import time

import torch

from . import comm
from .data_parallel import GradBuffer


class ShardedGradBuffer(GradBuffer):
    """ZeRO-2: a GradBuffer without the full-size fp32 buffer (see the module docstring). `overlap`: start each
    bucket's reduce-scatter as soon as its pass delivered its gradients (else at the pass's end, waited on)."""

    def __init__(self, params, *, device, pad_to: int, dp_rank: int, overlap: bool = True, **kw):
        self.dp_rank, self.overlap = dp_rank, overlap
        super().__init__(params, device=device, pad_to=pad_to, **kw)

    def _allocate(self) -> None:
        # Full storage only from the first late bucket on; other parameters have no main_grad.
        self.late_start = next((s for (s, _), late in zip(self.buckets, self.late) if late), self.padded)
        self.data = torch.zeros(self.padded - self.late_start, dtype=torch.float32, device=self.device)
        for p, o in zip(self.params, self.offsets):
            if o >= self.late_start:
                p.main_grad = self.data[o - self.late_start:o - self.late_start + p.numel()].view(p.shape)
        self.shard_grad = torch.zeros(self.padded // self.pad_to, dtype=torch.float32, device=self.device)
        self._offset = {id(p): o for p, o in zip(self.params, self.offsets)}
        self._staging: dict[int, torch.Tensor] = {}
        self._in_pass: dict[int, int] | None = None

    def _segment(self, k: int) -> tuple[int, int, int]:
        """(own segment's start and end inside bucket k, its position in shard_grad)."""
        s, e = self.buckets[k]
        n = (e - s) // self.pad_to
        return self.dp_rank * n, (self.dp_rank + 1) * n, s // self.pad_to

    def zero(self) -> None:
        self._drain()
        self.data.zero_()
        self.shard_grad.zero_()
        for p in self.params:
            p.grad = None
        self._staging.clear()
        self._group, self._pending = None, {}
        self.started, self.overlapped = [], 0

    def begin(self, group, *, shard: bool = True) -> None:
        self._group, self._shard = group, True
        self.started, self.overlapped = [], 0

    # -- gradients in ---------------------------------------------------------------------------------------
    def accumulate(self, param, grad: torch.Tensor) -> None:
        o, g = self._offset[id(param)], grad.reshape(-1)
        for k in self._of_param[id(param)]:
            s, e = self.buckets[k]
            a, b = max(o, s), min(o + param.numel(), e)
            if self.late[k]:
                self.data[a - self.late_start:b - self.late_start].add_(g[a - o:b - o])
            else:
                self._stage(k)[a - s:b - s].add_(g[a - o:b - o])

    def fused_target(self, param) -> torch.Tensor | None:
        """Where a fused layer accumulates param's gradient: its main_grad in the late buckets, else its slice of
        the bucket's staging buffer when it lies in one bucket; None across buckets (staging buffers are apart)."""
        main = getattr(param, "main_grad", None)
        ks = self._of_param[id(param)]
        if main is not None or len(ks) != 1:
            return main
        o, s = self._offset[id(param)], self.buckets[ks[0]][0]
        return self._stage(ks[0])[o - s:o - s + param.numel()].view(param.shape)

    def delivered(self, param) -> None:
        for k in self._of_param[id(param)]:
            if not self.late[k] and self._in_pass is not None and k in self._in_pass:
                self._in_pass[k] -= 1
        self._start_ready()

    def _stage(self, k: int) -> torch.Tensor:
        buf = self._staging.get(k)
        if buf is None:
            if k in self._pending:  # the previous reduce-scatter of this bucket writes the shard we read
                self._pending.pop(k)[0].wait()
            s, e = self.buckets[k]
            lo, hi, pos = self._segment(k)
            buf = self._staging[k] = torch.zeros(e - s, dtype=torch.float32, device=self.device)
            buf[lo:hi] = self.shard_grad[pos:pos + hi - lo]  # this rank's running sum rides along (docstring)
        return buf

    def pass_begins(self, params, last: bool) -> None:
        counts: dict[int, int] = {}
        for p in params:
            for k in self._of_param.get(id(p), ()):
                if not self.late[k]:
                    counts[k] = counts.get(k, 0) + 1
        self._in_pass = counts
        self._order = sorted(counts, reverse=True)  # from the end of the buffer, the order backward runs

    def pass_ends(self) -> None:
        self._start_ready(flush=True)
        self._in_pass = None
        if not self.overlap:
            self._drain()

    def _start_ready(self, flush: bool = False) -> None:
        """Start the pass's buckets in order while the next one has all its gradients (all of them: flush)."""
        if self._in_pass is None or self._group is None or not (self.overlap or flush):
            return
        while self._order and (flush or self._in_pass[self._order[0]] <= 0):
            k = self._order.pop(0)
            if k in self._staging:
                self._launch(k)

    def _launch(self, k: int) -> None:
        lo, hi, pos = self._segment(k)
        buf = self._staging.pop(k)
        self.started.append((k, time.perf_counter()))
        work = comm.reduce_scatter_into_start(self.shard_grad[pos:pos + hi - lo], buf, self._group)
        self._pending[k] = (work, buf)  # the staging buffer lives until the collective is done

    def _drain(self) -> None:
        for k in sorted(self._pending, reverse=True):
            self._pending.pop(k)[0].wait()

    # -- the step's reduction ------------------------------------------------------------------------------
    def finish(self) -> torch.Tensor:
        """After finalize_grads: start what is still staged (a pass outside grad_pass) and the late buckets,
        wait for everything; returns this rank's fp32 shard of the summed gradients."""
        self.overlapped = len(self.started)
        for k in sorted(self._staging, reverse=True):
            self._launch(k)
        for k in reversed(range(len(self.buckets))):
            if self.late[k]:
                s, e = self.buckets[k]
                lo, hi, pos = self._segment(k)
                self.started.append((k, time.perf_counter()))
                src = self.data[s - self.late_start:e - self.late_start]
                self._pending[k] = (comm.reduce_scatter_into_start(self.shard_grad[pos:pos + hi - lo], src,
                                                                   self._group), None)
        self._drain()
        if comm.group_size(self.cross) > 1:
            comm.all_reduce_start(self.shard_grad, self.cross).wait()
        self._group = None
        return self.shard_grad

    def reduce(self, group, *, shard: bool = True) -> torch.Tensor:
        if self._group is None:
            self.begin(group)
        return self.finish()

    def nbytes(self) -> int:
        """The late buckets' full storage plus the shard (staging buffers come and go with the passes)."""
        return self.data.nbytes + self.shard_grad.nbytes
