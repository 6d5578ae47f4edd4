"""The pipeline executor: one function runs a schedule's actions for training, eval and generation.

    execute(chunks, microbatches, dims, step, schedule="1f1b", forward_only=False)

`step` (a StepFunctions) says what one micro-batch computes on one chunk; the executor decides the order (the
schedule's actions for this rank), moves activations and gradients between stages (tagged point-to-point, no
shape handshake), runs the backward passes and records a timeline. Training (`forward_backward` below: the
language-model loss), eval (tpzoo.evaluation) and generation (tpzoo.generation, with a cache per chunk) are
three StepFunctions over this one loop. What a step's chunks pass on beside the activation (auxiliary sums of
some layer kinds, `StepFunctions.carry`) travels with it, opaque to the executor.
"""
from __future__ import annotations

import contextlib
import time

import torch

from tpzoo.errors import ConfigError
from tpzoo.parallel import comm
from tpzoo.parallel.data_parallel import grad_pass
from tpzoo.parallel.dims import ParallelDims
from tpzoo.parallel.state import get_dims

from . import schedule_1f1b, schedule_gpipe, schedule_interleaved, schedule_zero_bubble
from .actions import Action, ScheduleError
from .p2p import BACKWARD, FORWARD, StageComm
from .partition import as_chunks
from .stage import StageRunner, StepFunctions

_NO_PASS = contextlib.nullcontext()
SCHEDULES = {"gpipe": schedule_gpipe, "1f1b": schedule_1f1b, "interleaved": schedule_interleaved,
             "zb": schedule_zero_bubble}


def forward_order(p: int, m: int, v: int) -> list[Action]:
    """Forward-only order for any m: micro-batches in groups of p, each group through chunk 0, then chunk 1, ...
    (interleaving's forward order), so every stage streams micro-batches and nothing waits in a cycle."""
    out = []
    for g in range(0, m, p):
        out += [Action("F", c, mb) for c in range(v) for mb in range(g, min(g + p, m))]
    return out


def plan(schedule: str, rank: int, p: int, m: int, v: int, forward_only: bool = False) -> list[Action]:
    """This rank's ordered actions."""
    if schedule not in SCHEDULES:
        raise ConfigError(f"unknown schedule {schedule!r}; choose one of {sorted(SCHEDULES)}")
    if forward_only:
        return forward_order(p, m, v)
    if p == 1:
        # One stage: no pipeline to fill, every schedule is the plain loop (one micro-batch alive at a time).
        acts = []
        for mb in range(m):
            acts += [Action("F", c, mb) for c in range(v)] + [Action("B", c, mb) for c in reversed(range(v))]
        return acts
    if v > 1 and schedule != "interleaved":
        raise ScheduleError(f"schedule {schedule!r} runs one model chunk per rank, got {v}: build the chunks "
                            f"with virtual_stages=1 or use schedule='interleaved'")
    return SCHEDULES[schedule].actions(rank, p, m, v)


def activation_shape(chunks, microbatches, dims: ParallelDims) -> tuple:
    """Shape of the activations between stages, from the micro-batch shape alone (every rank knows it)."""
    shape = tuple(microbatches[0]["input_ids"].shape)
    for i, batch in enumerate(microbatches):
        for key in ("input_ids", "labels"):
            if key in batch and tuple(batch[key].shape) != shape:
                raise ValueError(f"micro-batch {i}: {key} has shape {tuple(batch[key].shape)}, expected {shape} "
                                 f"(every micro-batch of a step must have the same shape)")
    b, s = shape
    chunk = chunks[0]
    # Checked here, on every rank, before any transfer: a stage that raised alone would leave its neighbours
    # waiting for a message that never comes.
    if chunk.sequence_parallel and s % dims.tp:
        raise ConfigError(f"sequence parallelism: sequence length {s} is not divisible by tp={dims.tp}; pad the "
                         f"sequence or turn sequence parallelism off")
    s_local = s // dims.tp if chunk.sequence_parallel else s
    return (b, s_local, chunk.cfg.hidden_size)


def execute(chunks, microbatches: list[dict], dims: ParallelDims | None, step: StepFunctions, *,
            schedule: str = "1f1b", forward_only: bool = False) -> dict:
    """Run every micro-batch through this rank's chunks in the schedule's order (collective over the pipeline).
    Returns timeline [(kind, micro-batch, t_start, t_end)] of this rank's compute (perf_counter seconds; kind F,
    B (the whole backward, or only the input gradient for "zb") and W) and peak_inflight."""
    if not microbatches:
        raise ValueError("the pipeline executor needs at least one micro-batch")
    dims = get_dims(dims)
    p, rank, v, m = dims.pp, dims.pp_rank, len(chunks), len(microbatches)
    actions = plan(schedule, rank, p, m, v, forward_only)
    param = next(q for q in chunks[0].parameters() if q.is_floating_point())
    carry = step.carry(chunks[0], microbatches[0]) if step.carry is not None else {}
    stage_comm = StageComm(dims, v, m, activation_shape(chunks, microbatches, dims), param.dtype, param.device,
                           carry=carry)
    runners = [StageRunner(c, i, stage_comm, microbatches, step, forward_only=forward_only)
               for i, c in enumerate(chunks)]
    split = any(a.kind == "W" for a in actions)
    # The actions that produce weight gradients (B, or W under zero-bubble) run inside grad_pass, the last one of
    # each chunk marked: a GradBuffer reduces gradients bucket by bucket as they become final
    # (tpzoo.parallel.data_parallel).
    grad_kind = None if forward_only else "W" if split else "B"
    last_grads = {a.chunk: i for i, a in enumerate(actions) if a.kind == grad_kind}
    timeline, peak = [], 0
    with torch.set_grad_enabled(not forward_only):
        for i, a in enumerate(actions):
            _post_recvs(actions[i: i + 2], runners, stage_comm)  # this action's input and the next one's
            runner = runners[a.chunk]
            data = runner.wait_input(a.kind, a.microbatch)
            t0 = time.perf_counter()
            with grad_pass(runner.params, last_grads.get(a.chunk) == i) if a.kind == grad_kind else _NO_PASS:
                if a.kind == "F":
                    runner.forward(a.microbatch, data)
                elif a.kind == "B":
                    (runner.backward_input if split else runner.backward)(a.microbatch, data)
                else:
                    runner.backward_weights(a.microbatch)
            timeline.append((a.kind, a.microbatch, t0, time.perf_counter()))
            peak = max(peak, sum(r.inflight for r in runners))
    stage_comm.finish()
    return {"timeline": timeline, "peak_inflight": peak}


def _post_recvs(actions: list[Action], runners: list[StageRunner], stage_comm: StageComm) -> None:
    for a in actions:
        r = runners[a.chunk]
        if a.kind == "F" and not r.first:
            stage_comm.post_recv(FORWARD, a.chunk, a.microbatch)
        elif a.kind == "B" and not r.last:
            stage_comm.post_recv(BACKWARD, a.chunk, a.microbatch)


def pipeline_forward(model_or_chunks, input_ids: torch.Tensor, labels: torch.Tensor | None = None,
                     dims: ParallelDims | None = None):
    """One forward of one batch through every pipeline stage (the executor, forward only): on the last stage
    the per-token loss (with labels) or the logits shard, None on the other stages."""
    chunks = as_chunks(model_or_chunks)
    dims = dims or chunks[0].dims
    batch = {"input_ids": input_ids} if labels is None else {"input_ids": input_ids, "labels": labels}
    result = {}

    def last(mb, output, batch):
        result["out"] = output

    execute(chunks, [batch], dims, lm_step(None, last), forward_only=True)
    return result.get("out")


# -- the language-model loss: training and eval ------------------------------------------------------------------

def lm_step(loss, last) -> StepFunctions:
    """The StepFunctions of the language-model loss for {"input_ids"[, "labels"][, "position_ids"][, "doc_ids"]
    [, "token_mask"]} micro-batches: each chunk's forward on tpzoo.models.Inputs of its part of the batch (ids on
    the first model stage, labels on the last; positions, documents and the token mask on every stage: each one's
    layers need them), with `loss` (tpzoo.models.LossOptions; None: the defaults) on the last stage, whose output
    `last(microbatch, output, batch)` consumes. A labelled batch through a model split into chunks carries the
    auxiliary sums the chunks ask for (Transformer.carried_aux, models/aux.py)."""
    from tpzoo.models import Inputs, LossOptions

    loss = loss or LossOptions()

    def carry(chunk, batch) -> dict:
        if "labels" not in batch or (chunk.pre_process and chunk.post_process):
            return {}
        return chunk.carried_aux(loss)

    def forward(index, chunk, batch, received):
        hidden, sums = received if isinstance(received, tuple) else (received, None)
        if sums is None and chunk.pre_process and carry(chunk, batch):
            sums = {}  # the first stage starts the sums
        last = not chunk.post_process
        skip = {"input_ids": not chunk.pre_process, "labels": last, "mtp_ids": last, "mtp_labels": last}
        inputs = Inputs.from_batch({k: v for k, v in batch.items() if not skip.get(k)}, chunk.device,
                                   hidden=hidden, aux=sums)
        return chunk(inputs, loss=loss)

    return StepFunctions(forward, last, carry)


class LossSum:
    """Last stage: sums the per-token losses on the device (no host sync per micro-batch) and returns the
    backward's starting point, the scaled sum. `reports`: losses the head's forward reports per trained token
    (Transformer.aux_reports: "mtp_loss", a layer kind's trained auxiliary loss such as the sparse attention
    indexer's KL), summed too, weighted by each micro-batch's trained tokens (the trainer divides by the step's, as
    for the loss)."""

    def __init__(self, device, scale: float | None, head=None, reports: tuple = ()):
        self.total = torch.zeros((), dtype=torch.float64, device=device)
        self.scale, self.head, self.reports = scale, head, tuple(reports)
        self.reported = torch.zeros(len(self.reports), dtype=torch.float64, device=device)

    def __call__(self, mb, per_token, batch):
        self.total += per_token.detach().double().sum()
        if self.reports:
            n = (batch["labels"] != -100).sum().to(self.reported.device).double()
            self.reported += torch.stack([self.head.aux_reports[r].detach().double() for r in self.reports]) * n
        # The caller's scale (1 / tokens of the global batch) makes the accumulated gradient that of the global
        # mean loss, whatever the split into micro-batches and ranks.
        return None if self.scale is None else per_token.sum() * self.scale

    def shared(self, dims: ParallelDims) -> tuple[float, dict[str, float]]:
        """The sum and the reported sums on every pipeline rank (only the last stage computed them)."""
        total = torch.cat([self.total.reshape(1), self.reported])
        if dims.pp > 1:
            total = comm.broadcast(total.clone(), src=dims.pp_peer(dims.pp - 1), group=dims.pp_group)
        total = total.tolist()
        return total[0], dict(zip(self.reports, total[1:]))


def trained_reports(chunk) -> tuple:
    """The reports of the auxiliary losses a model chunk's kinds train with (models/aux.py rules that train)."""
    return tuple(name for _, rule in sorted(chunk.aux_rules.items()) if rule.trains(chunk.cfg)
                 for name in rule.reports)


def forward_backward(chunks, microbatches: list[dict], dims: ParallelDims | None = None, *,
                     schedule: str = "1f1b", forward_only: bool = False, loss_scale: float = 1.0,
                     loss=None) -> dict:
    """Forward (and backward, unless forward_only) of every micro-batch through this rank's chunks: the
    language-model loss through `execute`.

    Gradients accumulate (scaled by loss_scale) into each parameter's gradient (main_grad when a GradBuffer is
    attached); call finalize_grads afterwards. Returns loss_sum (per-token losses summed over the micro-batches,
    unscaled, the same on every pipeline rank), tokens (non-ignored labels), reports (the auxiliary losses the
    model trains with, as the head chunk reports them, times each micro-batch's tokens, summed; on every pipeline
    rank), timeline and peak_inflight.
    loss: the tpzoo.models.LossOptions of the last stage (label smoothing, z-loss, the fused head; aux_losses=False
    for a held-out loss: the language model's alone; mtp: multi-token prediction's depths run, their mean loss
    reported as "mtp_loss", held out too)."""
    dims = get_dims(dims)
    reports = ("mtp_loss",) if loss is not None and loss.mtp is not None else ()
    if not forward_only and (loss is None or loss.aux_losses):  # + the kinds' trained auxiliary losses, logged
        reports += trained_reports(chunks[0])
    head = next((c for c in chunks if c.post_process), None)
    losses = LossSum(chunks[0].device, None if forward_only else loss_scale, head, reports)
    out = execute(chunks, microbatches, dims, lm_step(loss, losses), schedule=schedule, forward_only=forward_only)
    tokens = int(sum((b["labels"] != -100).sum() for b in microbatches))
    loss_sum, reported = losses.shared(dims)
    return {"loss_sum": loss_sum, "tokens": tokens, "reports": reported, **out}
