"""When no layout fits: the flag that would make one fit, found quickly.

Candidates, in order: a higher ZeRO level (--zero 1, 2, 3), full recomputation when the search was held to another
mode, then more GPUs (2x to 16x; at each, the ZeRO level asked, then --zero 1 if that was off). A candidate is tried
only when its lowest memory floor (plan/bound.py: micro-batches of one sequence, full recomputation, sequence
parallelism) is under the GPU's memory; then its layouts are estimated in order of floor until one fits (at most
MAX_TRIES of them), so a hopeless candidate costs an enumeration, not an estimate.
"""
from __future__ import annotations

import dataclasses

from tpzoo.errors import ConfigError
from tpzoo.models.config import ModelConfig

from .estimate import GIB, Estimate, estimate
from .search import LayoutFloors, enumerate_layouts
from .spec import ClusterSpec, TrainingSpec

MAX_TRIES = 64


def lowest_floor(cfg: ModelConfig, cluster: ClusterSpec, training: TrainingSpec, **only) -> float:
    """The smallest memory floor of any layout of this search (inf: no valid layout)."""
    floors = LayoutFloors(cfg, training, cluster)
    floors.limit = -1.0  # keep nothing, remember the lowest floor of every group
    enumerate_layouts(cfg, cluster, training, 1, keep=floors.keep, **{**only, "recompute": only.get("recompute")
                                                                       or "full"})
    return min((f for f, _ in floors.ruled.values()), default=float("inf"))


def first_fit(cfg: ModelConfig, cluster: ClusterSpec, training: TrainingSpec, max_micro_batch: int,
              **only) -> Estimate | None:
    """A layout of this search that fits, looking at the lowest floors first; None if none of MAX_TRIES does."""
    floors = LayoutFloors(cfg, training, cluster)
    layouts = sorted(enumerate_layouts(cfg, cluster, training, max_micro_batch, keep=floors.keep, **only),
                     key=floors.floor)
    for lay in layouts[:MAX_TRIES]:
        est = estimate(cfg, lay, cluster, training)
        if est.fits:
            return est
    return None


def _candidates(cluster: ClusterSpec, training: TrainingSpec, only: dict):
    zero = training.zero_level
    for level in range(zero + 1, 4):
        yield f"--zero {level}", cluster, dict(zero=level, zero1=False), only
    if only.get("recompute") not in (None, "full"):
        yield "--recompute full", cluster, {}, {**only, "recompute": "full"}
    for k in (2, 4, 8, 16):  # the fewest GPUs first
        for zero_flag in ([{}] + ([dict(zero=1, zero1=False)] if not zero else [])):
            gpus = cluster.gpus * k
            flag = f"--gpus {gpus}" + (" --zero 1" if zero_flag else "")
            yield flag, dataclasses.replace(cluster, gpus=gpus), zero_flag, only


def fit_hint(cfg: ModelConfig, cluster: ClusterSpec, training: TrainingSpec, max_micro_batch: int = 64,
             **only) -> str:
    """One line: which flag would make a layout fit (and that layout), or that none of the candidates does."""
    limit = cluster.gpu_memory_gib * GIB
    for flag, cl, changes, search_only in _candidates(cluster, training, only):
        try:
            tr = dataclasses.replace(training, **changes)
            if lowest_floor(cfg, cl, tr, **search_only) > limit:
                continue
            est = first_fit(cfg, cl, tr, max_micro_batch, **search_only)
        except (ValueError, ConfigError):  # a combination the trainer refuses (ZeRO-3 with LoRA, ...)
            continue
        if est is not None:
            return (f"{flag} would make it fit: e.g. {est.layout.label()}, {est.memory.total / GIB:.1f} GiB of "
                    f"{cluster.gpu_memory_gib:g}")
    floor = lowest_floor(cfg, cluster, training, **only)
    return (f"nothing tried fits (higher --zero, full recomputation, up to 16x the GPUs): at best a GPU needs "
            f"{floor / GIB:.1f} GiB here for the weights, gradients, optimizer state and one micro-batch")
