"""Activation recomputation, applied to a built model the way torchtitan applies activation checkpointing:
after construction, by wrapping modules, not by flags inside them.

    apply_recompute(chunk, "selective")   # each token mixer's parameterless `core` (attention's softmax(QK^T)V)
    apply_recompute(chunk, "full")        # each whole block: only its input is kept, the rest recomputed

The wrapper replaces the module's `forward` on the instance (torch.utils.checkpoint, non-reentrant, around the
class's own forward): the module tree and the parameter names stay exactly what they were, so checkpoints, HF
mappings, LoRA sites and ZeRO-3's gathering units see the same model. The recomputation in backward goes through
the module's call again, hooks included (ZeRO-3 gathers the block's weights there), and may run more than once
(zero-bubble's W pass walks the recomputed graph a second time). `is_recomputing()` is True while it runs, for the
rare module that changes state in its forward (a counter of expert loads must not count a token twice).
"""
from __future__ import annotations

import contextlib
import threading
import weakref

import torch
import torch.nn as nn
from torch.utils.checkpoint import checkpoint

from tpzoo.errors import ConfigError

from .inputs import Context

RECOMPUTE_MODES = ("none", "selective", "full")
_STATE = threading.local()


def is_recomputing() -> bool:
    """Whether a recomputation (activation checkpointing's second forward, during backward) is running."""
    return getattr(_STATE, "depth", 0) > 0


class _Recomputing:
    """The recomputation's context (re-enterable: a graph may be recomputed twice)."""

    def __enter__(self):
        _STATE.depth = getattr(_STATE, "depth", 0) + 1

    def __exit__(self, *exc):
        _STATE.depth -= 1


def _contexts():
    return contextlib.nullcontext(), _Recomputing()


class _Recomputed:
    """The instance `forward` of a recomputed module: the class's forward under activation checkpointing. It
    holds the module weakly (the module holds it: a strong reference would be a cycle only the cyclic GC frees)."""

    def __init__(self, module: nn.Module):
        self.function, self.module, self.direct = type(module).forward, weakref.ref(module), False

    def __call__(self, *args, **kwargs):
        module = self.module()
        if self.direct or not torch.is_grad_enabled():
            return self.function(module, *args, **kwargs)
        if torch.compiler.is_compiling():
            # Traced inside a compiled block (selective recomputation of its core under --compile): torch.compile
            # takes the checkpoint as its own operator, which admits no context_fn; a core keeps no state that
            # would need is_recomputing(), and its recomputation is part of the compiled graph.
            return checkpoint(self.function, module, *args, use_reentrant=False, **kwargs)
        # A Context's shared tensors (the rotary tables) enter as inputs of their own: the checkpoint keeps them
        # as it keeps every tensor input (saved once, as autograd's saved-tensor hooks see them).
        shared = [t for a in args if isinstance(a, Context) for t in a.shared_tensors()]
        return checkpoint(self._run, len(args), *args, *shared, use_reentrant=False, context_fn=_contexts, **kwargs)

    def compile(self) -> None:
        """torch.compile the module's own forward inside the checkpoint (regional compilation of a recomputed
        block): the checkpoint stays eager around the compiled region, so its forward and its recomputation
        run the same compiled graphs. Compiling the call instead would trace the checkpoint itself, and a graph
        break inside it (a collective, an FP8 projection) makes the recomputation save other tensors."""
        self.function = torch.compile(self.function)

    def _run(self, n: int, *args, **kwargs):
        args, module = args[:n], self.module()
        if not is_recomputing():  # the forward: the module's hooks have run already
            return self.function(module, *args, **kwargs)
        self.direct = True  # backward's second forward: through the module's call and hooks, then straight in
        try:
            return module(*args, **kwargs)
        finally:
            self.direct = False


def checkpointed(module: nn.Module) -> nn.Module:
    """`module`, whose forward now keeps only its inputs for backward and runs again there (names unchanged)."""
    module.forward = _Recomputed(module)
    return module


def apply_recompute(chunk: nn.Module, mode: str) -> nn.Module:
    """Recompute activations of a Transformer chunk in backward: "none", "selective" (the parameterless `core`
    of every token mixer that has one) or "full" (every block)."""
    if mode not in RECOMPUTE_MODES:
        raise ConfigError(f"recompute must be one of {RECOMPUTE_MODES}, got {mode!r}")
    chunk.recompute = mode
    if mode == "none":
        return chunk
    for block in chunk.blocks().values():  # (multi-token prediction's depth blocks too)
        if mode == "full":
            checkpointed(block)
        elif getattr(block.attn, "core", None) is not None:
            checkpointed(block.attn.core)
    return chunk
