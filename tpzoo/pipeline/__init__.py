"""Pipeline parallelism: stage partitioning, model chunks, schedules, the one executor, and the model-parallel
gradient reductions of a step.

    chunks = build_model_chunks(cfg, ModelLayout(dims, sequence_parallel=True), virtual_stages=2)
    out = forward_backward(chunks, microbatches, dims, schedule="interleaved", loss_scale=1 / global_tokens)
    finalize_grads(chunks, dims)                  # then the GradBuffer's DP reduction, clip, optimizer step

Schedules: "gpipe", "1f1b", "interleaved", "zb" (ZB-H1); see docs/parallelism.md. Eval and generation run through
the same executor (`execute` with their own StepFunctions).
"""
from .actions import Action, ScheduleError, bubble_fractions, peak_inflight, simulate, validate
from .engine import SCHEDULES, LossSum, execute, forward_backward, forward_order, lm_step, pipeline_forward, plan
from .grads import finalize_grads, sum_tied_grads, tied_params
from .partition import (PartitionError, as_chunks, build_model_chunks, materialize_chunks, model_stages,
                        partition_layers, tie_chunks)
from .stage import StepFunctions

__all__ = ["Action", "LossSum", "PartitionError", "SCHEDULES", "ScheduleError", "StepFunctions",
           "as_chunks", "bubble_fractions", "build_model_chunks", "execute", "finalize_grads", "forward_backward",
           "forward_order", "lm_step", "materialize_chunks", "model_stages", "partition_layers", "peak_inflight", "pipeline_forward",
           "plan",
           "simulate", "sum_tied_grads", "tie_chunks", "tied_params", "validate"]
