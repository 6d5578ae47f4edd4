"""Learning-rate schedule: linear warmup, then cosine decay to `min_lr` at the run's last step.

A pure function of the step, so a resumed run continues exactly the curve of an uninterrupted one.
"""
from __future__ import annotations

import math


def lr_at(step: int, *, lr: float, min_lr: float, warmup_steps: int, total_steps: int) -> float:
    """Learning rate of optimizer step `step` (0-based) of a run of `total_steps` steps."""
    if warmup_steps > 0 and step < warmup_steps:
        return lr * (step + 1) / warmup_steps  # never 0: the first step already moves the weights
    decay_steps = total_steps - warmup_steps
    if decay_steps <= 1:
        return lr
    progress = min(1.0, (step - warmup_steps) / (decay_steps - 1))  # reaches min_lr on the last step
    return min_lr + 0.5 * (lr - min_lr) * (1.0 + math.cos(math.pi * progress))
