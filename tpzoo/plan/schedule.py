"""What a pipeline rank holds at its peak, and the pipeline bubble, from tpzoo's own schedules.

The in-flight counts are not formulas: they replay the action list that tpzoo.pipeline.plan() gives the rank
(F, B and, for zero-bubble, W per chunk and micro-batch), so they are exactly what the engine keeps:
  - a chunk's activations from its F until its backward (B; W for zero-bubble, which keeps the graph for W);
  - zero-bubble only: from B until W the gradient of the chunk's output (the received [b, s, h] gradient, or
    on the last model stage the logits' gradient).
For reference, this reproduces Korthikanti et al.'s counts: 1F1B holds p micro-batches on the first stage,
interleaving (1 + (p - 1)/(p v)) times that, GPipe all m. Past its warm-up a schedule repeats its steady state,
so the replay stops at 2 p v + p micro-batches (steady_micro_batches; the large batches of a search would
otherwise replay thousands of actions per rank).
"""
from __future__ import annotations

import functools

from .spec import Layout

State = tuple[tuple[int, ...], tuple[int, ...]]  # (activations held per chunk, output gradients held per chunk)


def steady_micro_batches(schedule: str, pp: int, m: int, v: int = 1) -> int:
    """m, or fewer micro-batches with the same candidate peaks: past its warm-up (under 2 p v + p micro-batches
    for 1F1B, zero-bubble and interleaving) a schedule repeats its steady state, and more micro-batches add no new
    peak (tests/test_plan_floor.py compares the replays). GPipe holds them all: m."""
    cap = 2 * pp * v + pp
    if schedule == "gpipe" or m <= cap:
        return m
    return cap + (-cap % pp if schedule == "interleaved" else 0)  # (interleaving: m stays a multiple of pp)


def held_states(schedule: str, rank: int, pp: int, m: int, v: int = 1) -> tuple[State, ...]:
    """The candidate peaks of rank `rank`: what it holds just before each action that frees something (B, or
    W for zero-bubble), pruned to the states no other one dominates."""
    return replay_held_states(schedule, rank, pp, steady_micro_batches(schedule, pp, m, v), v)


@functools.lru_cache(maxsize=4096)
def replay_held_states(schedule: str, rank: int, pp: int, m: int, v: int = 1) -> tuple[State, ...]:
    """held_states from the replay of all m micro-batches."""
    from tpzoo.pipeline import plan

    actions = plan(schedule if pp > 1 else "1f1b", rank, pp, m, v)
    split = any(a.kind == "W" for a in actions)
    frees = "W" if split else "B"
    acts, grads = [0] * v, [0] * v
    states: set[State] = set()
    for a in actions:
        c = a.chunk
        if a.kind == frees:
            states.add((tuple(acts), tuple(grads)))
            acts[c] -= 1
            grads[c] -= split
        elif a.kind == "F":
            acts[c] += 1
        else:  # zero-bubble B: the output gradient waits for W
            grads[c] += 1
    kept: list[State] = []  # largest first: a dominated state is dominated by one already kept
    for st in sorted(states, key=lambda x: -sum(x[0] + x[1])):
        if not any(_dominates(k, st) for k in kept):
            kept.append(st)
    return tuple(kept)


def _dominates(a: State, b: State) -> bool:
    return all(x >= y for x, y in zip(a[0] + a[1], b[0] + b[1]))


def peak_bytes(states: tuple[State, ...], act_bytes: list[int], grad_bytes: list[int]) -> int:
    """Most bytes held at once, given each chunk's bytes per micro-batch of activations and kept gradient."""
    return max(sum(n * b for n, b in zip(acts, act_bytes)) + sum(n * b for n, b in zip(grads, grad_bytes))
               for acts, grads in states)


def peak_micro_batches(layout: Layout, m: int, stage: int) -> int:
    """Most chunk-micro-batches whose activations stage `stage` holds at once (tpzoo.pipeline.peak_inflight)."""
    return max(sum(acts) for acts, _ in held_states(layout.schedule, stage, layout.pp, m, layout.virtual_stages))


def bubble_time(layout: Layout, m: int, forward: float, backward_input: float, backward_weights: float) -> float:
    """Idle time of the slowest rank in one step, given one micro-batch's F, B (input gradient) and W (weight
    gradients) times on a stage: (p - 1)(F + B + W) for 1F1B and GPipe, / v for the interleaved schedule,
    (p - 1)(F + B) - min(m - 1, p - 1) W for zero-bubble ZB-H1 (Qi et al. 2023: (p - 1)(F + B - W) once
    m >= p). Equal to what tpzoo.pipeline.simulate gives for these schedules (tests/test_plan_search.py)."""
    p, v = layout.pp, layout.virtual_stages
    if p == 1:
        return 0.0
    if layout.schedule == "zb":
        return (p - 1) * (forward + backward_input) - min(m - 1, p - 1) * backward_weights
    return (p - 1) * (forward + backward_input + backward_weights) / (v if layout.schedule == "interleaved" else 1)
