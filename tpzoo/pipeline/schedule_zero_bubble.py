"""ZB-H1 (Qi et al. 2023, "Zero Bubble Pipeline Parallelism"): 1F1B with the backward split in two.

B computes only the gradient with respect to the stage input, which is all the previous stage waits for; W (the
weight gradients) has no downstream consumer, so it can wait. Stage r holds back r of its W passes: they fill
the drain bubble at the end, and the critical path through the pipeline carries B instead of B+W. The in-flight
activations stay at most p per stage, like 1F1B's first stage. Bubble: (p-1)(T_F + T_B - T_W) instead of
(p-1)(T_F + T_B + T_W)."""
from __future__ import annotations

from .actions import Action


def actions(rank: int, p: int, m: int, v: int = 1) -> list[Action]:
    warmup = min(p - rank - 1, m)
    lag = rank  # W passes this stage may owe at once: stage r is p-r-1 forwards ahead, so p in flight at most
    out = [Action("F", 0, mb) for mb in range(warmup)]
    forwards, backwards, weights = warmup, 0, 0
    while backwards < m:
        if forwards < m:
            out.append(Action("F", 0, forwards))
            forwards += 1
        out.append(Action("B", 0, backwards))
        backwards += 1
        if backwards - weights > lag or forwards == m:  # cool-down: one W in each gap between the backwards
            out.append(Action("W", 0, weights))
            weights += 1
    return out + [Action("W", 0, mb) for mb in range(weights, m)]
