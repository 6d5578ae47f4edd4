"""1F1B (PipeDream-Flush, Megatron's default): warm up, then alternate one forward with one backward.

Stage r runs p-r-1 warm-up forwards, so at most p-r micro-batches are alive at once (p on the first stage,
whatever m is), against m for GPipe. The bubble is the same as GPipe's, (p-1)/m."""
from __future__ import annotations

from .actions import Action


def actions(rank: int, p: int, m: int, v: int = 1) -> list[Action]:
    warmup = min(p - rank - 1, m)
    out = [Action("F", 0, mb) for mb in range(warmup)]
    for i in range(m - warmup):  # steady state: the forward of micro-batch warmup+i, the backward of i
        out += [Action("F", 0, warmup + i), Action("B", 0, i)]
    out += [Action("B", 0, mb) for mb in range(m - warmup, m)]  # cool-down: the backwards still owed
    return out
