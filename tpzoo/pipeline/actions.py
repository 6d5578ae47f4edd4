"""A schedule is, for every pipeline rank, an ordered list of actions; this module checks and simulates them.

Actions: F (forward of one micro-batch through one model chunk), B (backward: the input gradient, plus the weight
gradients unless the schedule splits them off) and W (the deferred weight gradients, zero-bubble only). The
schedule modules only decide the order; `tpzoo.pipeline.engine` executes it, and the order alone determines the
dependencies (F of stage k needs F of stage k-1, B of stage k needs B of stage k+1), so the same lists can be
simulated here with unit costs: that is how the tests check that a schedule cannot deadlock and how the
benchmark gets the theoretical bubble next to the measured one.
"""
from __future__ import annotations

from dataclasses import dataclass

from tpzoo.errors import UserError


@dataclass(frozen=True)
class Action:
    kind: str        # "F", "B" or "W"
    chunk: int       # index into this rank's chunks (model stage chunk*pp + rank)
    microbatch: int

    def __repr__(self) -> str:
        return f"{self.kind}{self.microbatch}" + (f".{self.chunk}" if self.chunk else "")


class ScheduleError(UserError, ValueError):
    """A schedule that cannot run: wrong micro-batch count for it, or an order that would deadlock."""


def validate(actions_per_rank: list[list[Action]], p: int, v: int, m: int) -> None:
    """Every rank runs F and B (and W, if any) exactly once per (chunk, micro-batch), B after F, W after B."""
    for r, actions in enumerate(actions_per_rank):
        seen = {}
        for i, a in enumerate(actions):
            if (a.kind, a.chunk, a.microbatch) in seen:
                raise ScheduleError(f"rank {r}: {a} appears twice")
            seen[(a.kind, a.chunk, a.microbatch)] = i
        split = any(a.kind == "W" for a in actions)
        for c in range(v):
            for mb in range(m):
                f, b, w = (seen.get((k, c, mb)) for k in "FBW")
                if f is None or b is None or (split and w is None):
                    raise ScheduleError(f"rank {r}: chunk {c} micro-batch {mb} is missing an action")
                if not f < b or (split and not b < w):
                    raise ScheduleError(f"rank {r}: chunk {c} micro-batch {mb} runs out of order")


def simulate(actions_per_rank: list[list[Action]], p: int, v: int,
             cost: dict | list[dict] | None = None) -> list[list[tuple[Action, float, float]]]:
    """Start and end time of every action when each rank runs its list in order as soon as its inputs exist
    (communication free). `cost`: {kind: duration}, or one such dict per rank; default F=1, B=2 (F=B=W=1
    when the backward is split). Raises ScheduleError if the ranks would wait on each other forever."""
    split = any(a.kind == "W" for acts in actions_per_rank for a in acts)
    cost = cost or ({"F": 1.0, "B": 1.0, "W": 1.0} if split else {"F": 1.0, "B": 2.0, "W": 0.0})
    costs = cost if isinstance(cost, list) else [cost] * p
    last_stage = p * v - 1
    done: dict = {}  # (kind, model stage, micro-batch) -> end time
    cursor = [0] * p
    clock = [0.0] * p
    out = [[] for _ in range(p)]
    remaining = sum(len(a) for a in actions_per_rank)
    while remaining:
        progressed = False
        for r in range(p):
            while cursor[r] < len(actions_per_rank[r]):
                a = actions_per_rank[r][cursor[r]]
                stage = a.chunk * p + r
                if a.kind == "F":
                    dep = ("F", stage - 1, a.microbatch) if stage > 0 else None
                elif a.kind == "B":
                    dep = ("B", stage + 1, a.microbatch) if stage < last_stage else ("F", stage, a.microbatch)
                else:
                    dep = ("B", stage, a.microbatch)
                if dep is not None and dep not in done:
                    break
                start = max(clock[r], done[dep] if dep is not None else 0.0)
                clock[r] = start + costs[r][a.kind]
                done[(a.kind, stage, a.microbatch)] = clock[r]
                out[r].append((a, start, clock[r]))
                cursor[r] += 1
                remaining -= 1
                progressed = True
        if not progressed:
            stuck = {r: actions_per_rank[r][cursor[r]] for r in range(p) if cursor[r] < len(actions_per_rank[r])}
            raise ScheduleError(f"schedule deadlocks: ranks wait forever at {stuck}")
    return out


def bubble_fractions(timelines: list[list[tuple]]) -> list[float]:
    """Idle time of each rank over its busy time, within the span of the whole pipeline (first start to last
    end over all ranks): the quantity the (p-1)/m formula describes. Events end with (start, end): simulate()'s
    (action, start, end) or forward_backward's timeline (kind, micro-batch, start, end)."""
    t0 = min(e[-2] for tl in timelines for e in tl)
    t1 = max(e[-1] for tl in timelines for e in tl)
    out = []
    for tl in timelines:
        busy = sum(e[-1] - e[-2] for e in tl)
        out.append((t1 - t0 - busy) / busy)
    return out


def peak_inflight(actions: list[Action]) -> int:
    """Most (chunk, micro-batch) forward activations held at once: from F until the last backward action."""
    frees = "W" if any(a.kind == "W" for a in actions) else "B"
    held = peak = 0
    for a in actions:
        if a.kind == "F":
            held += 1
            peak = max(peak, held)
        elif a.kind == frees:
            held -= 1
    return peak
