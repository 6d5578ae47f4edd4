"""One model chunk inside a pipeline: runs its forward, backward and weight-gradient passes for a micro-batch.

What a forward computes is the caller's (a StepFunctions: training loss, eval loss, generation logits); this
module only keeps the state between passes, per micro-batch: the stage input (a leaf that requires grad, so its
gradient can be sent back) and the stage output (on the last stage: the scalar to backpropagate); between
zero-bubble's B and W, the W still owed (see weight_grad.py).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import torch

from .p2p import BACKWARD, FORWARD, StageComm
from .weight_grad import backward_input


@dataclass
class StepFunctions:
    """The per-micro-batch callbacks of the executor (Megatron's forward_step_func, split in two):

    forward(chunk_index, chunk, batch, hidden) -> output
        run one chunk: `hidden` is the previous stage's activation (None on the first model stage, where the
        batch's input_ids enter); the output goes to the next stage, or to `last` on the last model stage.
    last(microbatch, output, batch) -> scalar tensor or None
        on the last model stage: consume the output (accumulate a loss, keep logits...) and return the scalar the
        backward starts from (None when running forward only).
    carry(chunk, batch) -> {key: size}, optional
        the auxiliary fp32 vectors that travel beside the activation between stages (the same answer on every
        stage; then `forward` receives and returns (activation, {key: vector}) pairs)."""
    forward: Callable
    last: Callable
    carry: Optional[Callable] = None


class StageRunner:
    def __init__(self, chunk, index: int, comm: StageComm, microbatches: list[dict], step: StepFunctions, *,
                 forward_only: bool):
        self.chunk, self.index, self.comm = chunk, index, comm
        self.first, self.last = chunk.pre_process, chunk.post_process
        self.microbatches, self.step, self.forward_only = microbatches, step, forward_only
        self.params = [p for p in chunk.parameters() if p.requires_grad]
        self.saved: dict[int, list] = {}  # mb -> [stage input or None, stage output, W owed (zero-bubble)]

    def wait_input(self, kind: str, mb: int):
        """Block until the message an action needs has arrived (idle time, kept out of the timeline): the
        activation for F on all but the first stage, the output gradient for B on all but the last."""
        if kind == "F" and not self.first:
            return self.comm.recv(FORWARD, self.index, mb)
        if kind == "B" and not self.last:
            return self.comm.recv(BACKWARD, self.index, mb)
        return None

    def forward(self, mb: int, x) -> None:
        batch = self.microbatches[mb]
        if x is not None and not self.forward_only:  # a tensor, or (activation, auxiliary sums)
            for t in _tensors(x):
                t.requires_grad_()
        out = self.step.forward(self.index, self.chunk, batch, x)
        if self.last:
            out = self.step.last(mb, out, batch)
        else:
            self.comm.send(FORWARD, self.index, mb, out)
        if not self.forward_only:
            self.saved[mb] = [x, out, None]

    def backward(self, mb: int, grad) -> None:
        """The whole backward from the output gradient (None on the last stage: the output is the loss): input
        gradient (sent to the previous stage) and weight gradients."""
        x, out, _ = self.saved.pop(mb)
        torch.autograd.backward(*_differentiable(out, grad))
        if x is not None:
            self.comm.send(BACKWARD, self.index, mb, _like(x, [t.grad for t in _tensors(x)]))

    def backward_input(self, mb: int, grad) -> None:
        """B of zero-bubble: only the gradient the previous stage waits for; the weight gradients are owed."""
        state = self.saved[mb]
        x, out, _ = state
        outs, grads = _differentiable(out, grad)
        if x is None:  # the first stage has no input gradient to hurry: its W is the whole backward
            state[2] = lambda: torch.autograd.backward(outs, grads, inputs=self.params)
            return
        gx, owed = backward_input(outs, grads, _tensors(x), self.params)
        self.comm.send(BACKWARD, self.index, mb, _like(x, gx))
        state[2] = owed.run

    def backward_weights(self, mb: int) -> None:
        """W of zero-bubble: accumulate the parameter gradients, then drop the micro-batch's graph."""
        _, _, owed = self.saved.pop(mb)
        owed()

    @property
    def inflight(self) -> int:
        return len(self.saved)


def _tensors(x) -> list:
    """A stage's message as a list: [activation] or [activation, *auxiliary sums in key order] (the pair
    (activation, {key: vector}) of p2p.StageComm)."""
    if isinstance(x, tuple):
        t, sums = x
        return [t, *(sums[k] for k in sorted(sums))]
    return [x]


def _differentiable(out, grad) -> tuple:
    """The outputs that carry a gradient, with theirs: an auxiliary sum may depend on no parameter before it
    (the first stage of a model whose first layers have no such kind passes on zeros)."""
    if grad is None:  # the last stage: the scalar to backpropagate
        return _tensors(out), None
    pairs = [(o, g) for o, g in zip(_tensors(out), _tensors(grad)) if o.requires_grad]
    return [o for o, _ in pairs], [g for _, g in pairs]


def _like(x, grads: list):
    """The gradients of `x`'s tensors in x's form (one tensor or the pair). An auxiliary input through which no
    gradient flowed gets zeros."""
    grads = [g if g is not None else torch.zeros_like(t) for g, t in zip(grads, _tensors(x))]
    if isinstance(x, tuple):
        return grads[0], dict(zip(sorted(x[1]), grads[1:]))
    return grads[0]
