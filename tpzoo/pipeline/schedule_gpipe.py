"""GPipe (all forward, then all backward): the simplest schedule, and the most memory hungry.

Every stage keeps the activations of all m micro-batches until the backward phase starts. Bubble: each stage idles
for (p-1) forward and (p-1) backward slots, (p-1)/m of the useful time."""
from __future__ import annotations

from .actions import Action


def actions(rank: int, p: int, m: int, v: int = 1) -> list[Action]:
    forwards = [Action("F", 0, mb) for mb in range(m)]
    backwards = [Action("B", 0, mb) for mb in range(m)]
    return forwards + backwards
