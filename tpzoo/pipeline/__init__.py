"""Pipeline parallelism: stage partitioning, model chunks, schedules and the gradient reductions of a step.

    chunks = build_model_chunks(cfg, sequence_parallel=True, virtual_stages=2)   # after tpzoo.init_parallel
    out = forward_backward(chunks, microbatches, schedule="interleaved", loss_scale=1 / global_tokens)
    finalize_grads(chunks)                                                       # then clip, optimizer.step()

Schedules: "gpipe", "1f1b", "interleaved", "zb" (ZB-H1); see docs/parallelism.md.
"""
from .actions import Action, ScheduleError, bubble_fractions, peak_inflight, simulate, validate
from .engine import SCHEDULES, forward_backward, plan
from .grads import finalize_grads, sum_tied_embedding_grads
from .partition import PartitionError, build_model_chunks, partition_layers

__all__ = ["Action", "PartitionError", "SCHEDULES", "ScheduleError", "bubble_fractions", "build_model_chunks",
           "finalize_grads", "forward_backward", "partition_layers", "peak_inflight", "plan", "simulate",
           "sum_tied_embedding_grads", "validate"]
