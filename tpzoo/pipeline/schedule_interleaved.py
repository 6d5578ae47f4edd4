"""Interleaved 1F1B (Narayanan et al. 2021, Megatron-LM): each rank holds v model chunks, so a micro-batch
crosses the ranks v times and the fill/drain bubble shrinks v-fold, to (p-1)/(m v), for v times more
point-to-point traffic.

Micro-batches go through in groups of p: forwards of chunk 0 for micro-batches 0..p-1, then chunk 1 for the same
group, ..., then the next group; backwards mirror this from the last chunk. Stage r warms up with
2(p-r-1) + (v-1)p forwards (Megatron's count), then alternates one forward with one backward."""
from __future__ import annotations

from .actions import Action, ScheduleError


def _order(k: int, p: int, v: int, backward: bool) -> tuple[int, int]:
    """(chunk, micro-batch) of the k-th forward (or backward) pass of a rank."""
    group, idx = divmod(k, p * v)
    chunk = idx // p
    return (v - 1 - chunk if backward else chunk), group * p + idx % p


def actions(rank: int, p: int, m: int, v: int = 2) -> list[Action]:
    if m % p:
        raise ScheduleError(f"the interleaved schedule needs the number of micro-batches ({m}) to be a multiple "
                            f"of the pipeline size ({p})")
    total = m * v
    warmup = min((p - rank - 1) * 2 + (v - 1) * p, total)
    fwd = [Action("F", *_order(k, p, v, backward=False)) for k in range(total)]
    bwd = [Action("B", *_order(k, p, v, backward=True)) for k in range(total)]
    out = fwd[:warmup]
    for i in range(total - warmup):
        out += [fwd[warmup + i], bwd[i]]
    return out + bwd[total - warmup:]
