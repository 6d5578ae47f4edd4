"""Functions torch.compile must not trace: the collectives (Dynamo has no rule for asynchronous ones, and
tpzoo's keep the asynchronous contract and strict mode: ARCHITECTURE.md) and the FP8 projections (their own fused
kernels, and a weight cache that is Python state). Under regional compilation (tpzoo.train.compile) each call of
one is a graph break and runs as written.

`@eager` marks such a function at no cost: nothing of torch.compile is imported (importing it costs a second per
process, and most runs never compile). `enable()`, called when compilation is set up, wraps each marked function
in torch.compiler.disable; until then the mark is one dictionary lookup per call.
"""
from __future__ import annotations

import functools

_DISABLED: dict = {}   # a marked function -> its torch.compiler.disable wrapper (after enable())
_MARKED: list = []


def eager(fn):
    """Mark `fn` as never traced by torch.compile (see the module docstring)."""
    @functools.wraps(fn)
    def call(*args, **kwargs):
        return _DISABLED.get(fn, fn)(*args, **kwargs)

    _MARKED.append(fn)
    return call


@eager
def eager_apply(function, *args):
    """`function.apply(*args)` for an autograd Function with a collective inside: under torch.compile one graph
    break here, and none of the Function's own frames is compiled (each would be once per tensor shape, recompiling
    until torch's limit sends the block back to eager)."""
    return function.apply(*args)


def enable() -> None:
    """Make every marked function a graph break for torch.compile (idempotent)."""
    import torch

    for fn in _MARKED:
        if fn not in _DISABLED:
            _DISABLED[fn] = torch.compiler.disable(fn)
