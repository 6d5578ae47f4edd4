"""A CUDA out-of-memory error in training, as one line that says what to do.

The allocator's own message (how many MiB it tried to allocate, what PyTorch reserved) says nothing about the run:
which step, how much this rank held at its peak, how much `tpzoo plan` expects this layout to need, and which of
the run's flags would lower it. `out_of_memory(...)` turns the exception into a `ResourceError` (a user error: one
line, exit status 2, once per job) saying exactly that. Nothing is written on the way out: the last checkpoint
(written atomically, like every checkpoint) stays the latest, and `--resume` continues from it.
"""
from __future__ import annotations

import torch

from tpzoo.errors import UserError

OOM_ERRORS = tuple({getattr(torch, "OutOfMemoryError", torch.cuda.OutOfMemoryError), torch.cuda.OutOfMemoryError})


class ResourceError(UserError, RuntimeError):
    """The run needs more of a resource (GPU memory) than this machine has."""


def plan_peak_gib(cfg, model_cfg, dims) -> float | None:
    """What tpzoo.plan estimates this rank's pipeline stage needs at its peak (GiB, without the allocator's
    reserve), or None where the plan does not model the run."""
    try:
        from tpzoo.plan import Layout, TrainingSpec
        from tpzoo.plan.memory import stage_memory

        layout = Layout(tp=dims.tp, pp=dims.pp, dp=dims.dp, cp=dims.cp, ep=dims.ep,
                        micro_batch_size=cfg.micro_batch_size, recompute=cfg.recompute,
                        sequence_parallel=cfg.sequence_parallel, schedule=cfg.schedule,
                        virtual_stages=cfg.virtual_stages)
        kernels = "fused" if dims.device.type == "cuda" else "reference"
        training = TrainingSpec(seq_len=cfg.seq_len, global_batch_size=cfg.global_batch_size, dtype=cfg.dtype,
                                zero=cfg.zero_level, overlap_grad_reduce=cfg.overlap_grad_reduce,
                                grad_bucket_elems=cfg.grad_bucket_elems, lora_rank=cfg.lora_rank, kernels=kernels,
                                fused_linear_cross_entropy=getattr(cfg, "fused_linear_cross_entropy", True),
                                fp8=getattr(cfg, "fp8", "none"), compile=getattr(cfg, "compile", False),
                                grad_accumulation_fusion=getattr(cfg, "grad_accumulation_fusion", True))
        return stage_memory(model_cfg, layout, training, dims.pp_rank).total / 2 ** 30
    except Exception:  # noqa: BLE001 - a layout the plan does not model: the message goes without the estimate
        return None


def lowering_flags(cfg, dims) -> list[str]:
    """The run's flags that would lower its peak memory, most effective first."""
    out = []
    if cfg.micro_batch_size > 1:
        out.append(f"--micro-batch-size {cfg.micro_batch_size // 2} (activations scale with it; the global batch "
                   f"stays {cfg.global_batch_size})")
    if cfg.recompute != "full":
        out.append("--recompute " + ("selective" if cfg.recompute == "none" else "full"))
    if cfg.zero_level < (2 if getattr(cfg, "compile", False) else 3) and dims.dp * dims.cp > 1:  # not 3 compiled
        out.append(f"--zero {cfg.zero_level + 1} (shards more of the weights' state over dp)")
    out.append(f"--tp {dims.tp * 2} or --pp {dims.pp * 2} (fewer layers or smaller shards per GPU)")
    if not getattr(cfg, "fused_linear_cross_entropy", True):
        out.append("--fused-linear-cross-entropy (no full-vocabulary logits)")
    return out


def out_of_memory(exc: BaseException, step: int, cfg, model_cfg, dims) -> ResourceError:
    from .metrics import peak_memory_gb

    device = dims.device
    if device.type == "cuda":
        total = torch.cuda.get_device_properties(device).total_memory / 2 ** 30
        held = f"peak {_gib(peak_memory_gb(device))} allocated of {_gib(total)}"
    else:
        held = f"peak resident {_gib(peak_memory_gb(device))}"
    estimate = plan_peak_gib(cfg, model_cfg, dims)
    layout = (f"tp={dims.tp} cp={dims.cp} pp={dims.pp} dp={dims.dp}, micro-batch {cfg.micro_batch_size} x "
              f"{cfg.seq_len}, recompute {cfg.recompute}, zero {cfg.zero_level}, {cfg.dtype}")
    planned = (f"; tpzoo plan estimates {_gib(estimate)} for this layout (pipeline stage {dims.pp_rank})"
               if estimate is not None else "")
    return ResourceError(f"step {step}: out of GPU memory on rank {dims.rank} ({device}; {held}{planned}; "
                         f"{layout}). To lower it: " + "; ".join(lowering_flags(cfg, dims))
                         + ". The last checkpoint is intact: --resume continues from it")


def _gib(x: float) -> str:
    return f"{x:.1f} GiB" if x >= 10 else f"{x:.2f} GiB" if x >= 0.01 else f"{x * 1024:.1f} MiB"
