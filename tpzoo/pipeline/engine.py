"""forward_backward: run one training step's micro-batches through this rank's chunks in a schedule's order."""
from __future__ import annotations

import time

import torch

from tpzoo.parallel import comm
from tpzoo.parallel.state import get_group_ranks, get_pp_group, get_pp_rank, get_pp_size, get_tp_size

from . import schedule_1f1b, schedule_gpipe, schedule_interleaved, schedule_zero_bubble
from .actions import Action, ScheduleError
from .p2p import BACKWARD, FORWARD, StageComm
from .stage import StageRunner

SCHEDULES = {"gpipe": schedule_gpipe, "1f1b": schedule_1f1b, "interleaved": schedule_interleaved,
             "zb": schedule_zero_bubble}


def plan(schedule: str, rank: int, p: int, m: int, v: int, forward_only: bool = False) -> list[Action]:
    """This rank's ordered actions."""
    if schedule not in SCHEDULES:
        raise ValueError(f"unknown schedule {schedule!r}; choose one of {sorted(SCHEDULES)}")
    if p == 1:
        # One stage: no pipeline to fill, every schedule is the plain loop (one micro-batch alive at a time).
        acts = []
        for mb in range(m):
            acts += [Action("F", c, mb) for c in range(v)] + [Action("B", c, mb) for c in reversed(range(v))]
    else:
        if v > 1 and schedule != "interleaved":
            raise ScheduleError(f"schedule {schedule!r} runs one model chunk per rank, got {v}: build the chunks "
                                f"with virtual_stages=1 or use schedule='interleaved'")
        acts = SCHEDULES[schedule].actions(rank, p, m, v)
    return [a for a in acts if a.kind == "F"] if forward_only else acts


def _activation_spec(chunks, microbatches) -> tuple[tuple, torch.dtype, torch.device]:
    """Shape, dtype and device of the activations between stages, from the micro-batch shape alone."""
    shape = tuple(microbatches[0]["input_ids"].shape)
    for i, batch in enumerate(microbatches):
        for key in ("input_ids", "labels"):
            if tuple(batch[key].shape) != shape:
                raise ValueError(f"micro-batch {i}: {key} has shape {tuple(batch[key].shape)}, expected {shape} "
                                 f"(every micro-batch of a step must have the same shape)")
    b, s = shape
    chunk = chunks[0]
    tp = get_tp_size()
    # Checked here, on every rank, before any transfer: a stage that raised alone would leave its neighbours
    # waiting for a message that never comes.
    if chunk.sequence_parallel and s % tp:
        raise ValueError(f"sequence parallelism: sequence length {s} is not divisible by tp={tp}; pad the "
                         f"sequence or turn sequence parallelism off")
    s_local = s // tp if chunk.sequence_parallel else s
    param = next(p for p in chunk.parameters() if p.is_floating_point())
    return (b, s_local, chunk.cfg.hidden_size), param.dtype, param.device


def forward_backward(chunks, microbatches: list[dict], *, schedule: str = "1f1b", forward_only: bool = False,
                     loss_scale: float = 1.0, label_smoothing: float = 0.0) -> dict:
    """Forward (and backward, unless forward_only) of every micro-batch through this rank's chunks.

    Gradients accumulate into .grad (scaled by loss_scale); call finalize_grads afterwards. Returns loss_sum
    (per-token losses summed over the micro-batches, unscaled, the same on every pipeline rank), tokens
    (non-ignored labels), timeline [(kind, micro-batch, t_start, t_end)] of this rank's compute (perf_counter
    seconds; kind F, B (the whole backward, or only the input gradient for "zb") and W) and peak_inflight."""
    if not microbatches:
        raise ValueError("forward_backward needs at least one micro-batch")
    p, rank, v, m = get_pp_size(), get_pp_rank(), len(chunks), len(microbatches)
    actions = plan(schedule, rank, p, m, v, forward_only)
    shape, dtype, device = _activation_spec(chunks, microbatches)
    stage_comm = StageComm(v, m, shape, dtype, device)
    runners = [StageRunner(c, i, stage_comm, microbatches, loss_scale=loss_scale, label_smoothing=label_smoothing,
                           forward_only=forward_only) for i, c in enumerate(chunks)]
    split = any(a.kind == "W" for a in actions)
    timeline, peak = [], 0
    with torch.set_grad_enabled(not forward_only):
        for i, a in enumerate(actions):
            _post_recvs(actions[i: i + 2], runners, stage_comm)  # this action's input and the next one's
            runner = runners[a.chunk]
            data = runner.wait_input(a.kind, a.microbatch)
            t0 = time.perf_counter()
            if a.kind == "F":
                runner.forward(a.microbatch, data)
            elif a.kind == "B":
                (runner.backward_input if split else runner.backward)(a.microbatch, data)
            else:
                runner.backward_weights(a.microbatch)
            timeline.append((a.kind, a.microbatch, t0, time.perf_counter()))
            peak = max(peak, sum(r.inflight for r in runners))
    stage_comm.finish()
    loss_sum = sum(r.loss_sum for r in runners)
    if p > 1:  # only the last stage computed the loss: share it with the whole pipeline
        loss_sum = comm.broadcast(loss_sum.clone(), src=get_group_ranks("pp")[-1], group=get_pp_group())
    tokens = sum(int((b["labels"] != -100).sum()) for b in microbatches)
    return {"loss_sum": float(loss_sum), "tokens": tokens, "timeline": timeline, "peak_inflight": peak}


def _post_recvs(actions: list[Action], runners: list[StageRunner], stage_comm: StageComm) -> None:
    for a in actions:
        r = runners[a.chunk]
        if a.kind == "F" and not r.first:
            stage_comm.post_recv(FORWARD, a.chunk, a.microbatch)
        elif a.kind == "B" and not r.last:
            stage_comm.post_recv(BACKWARD, a.chunk, a.microbatch)
