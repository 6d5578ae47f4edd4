"""Main gradients in fp32 and their data-parallel reduction: the one place gradients are summed over replicas.

Megatron-style mixed precision: every parameter gets `main_grad`, an fp32 view into one flat buffer. A hook that
runs as soon as autograd has accumulated a parameter's gradient adds it into `main_grad` and frees `.grad`, so
micro-batch gradients accumulate in fp32 (no 16-bit rounding, however many micro-batches) and no 16-bit gradient
is kept between them: a bf16 step holds 2 (weights) + 4 (main grads) + 12 (fp32 master, Adam moments) = 18
bytes per parameter, as Megatron's does.

The data-parallel reduction is a SUM over the replicas (the training loop scales each micro-batch's loss by
1 / tokens of the global batch, so the sum is the gradient of the global mean loss), in fp32: an all-reduce of
the flat buffer in buckets (bounded collective buffers), or under ZeRO-1 a reduce-scatter that leaves each rank
the fp32 sum of the range it owns. Every replica lays out the same parameters in the same order, so the buffers
line up element for element.
"""
from __future__ import annotations

import torch

from . import comm

DEFAULT_BUCKET_ELEMS = 1 << 24  # 64 MiB of fp32 per all-reduce call


def _accumulate_into_main_grad(param: torch.Tensor) -> None:
    param.main_grad.add_(param.grad)
    param.grad = None


def accumulate_grad(param: torch.Tensor, grad: torch.Tensor) -> None:
    """Add a gradient computed outside autograd's accumulation (zero-bubble's W pass) where the parameter keeps
    its gradient: main_grad when a GradBuffer is attached, else .grad."""
    main = getattr(param, "main_grad", None)
    if main is not None:
        main.add_(grad)
    elif param.grad is None:
        param.grad = grad.clone()  # a copy: autograd may hand the same tensor to two parameters
    else:
        param.grad.add_(grad)


def flat_layout(params, pad_to: int = 1) -> tuple[list, list[int], int, int]:
    """(each distinct Parameter once, in order; its offset in a flat buffer; elements; elements padded to a
    multiple of pad_to): the layout the GradBuffer and the optimizer's flat buffers share."""
    unique = list({id(p): p for p in params}.values())
    offsets, off = [], 0
    for p in unique:
        offsets.append(off)
        off += p.numel()
    return unique, offsets, off, -(-max(off, 1) // pad_to) * pad_to


class GradBuffer:
    """fp32 main gradients of `params` (each distinct Parameter once, in order) in one flat buffer on `device`,
    padded to a multiple of `pad_to` (the dp size, so ZeRO-1 can split it evenly)."""

    def __init__(self, params, *, device, pad_to: int = 1):
        self.params, self.offsets, self.numel, self.padded = flat_layout(params, pad_to)
        self.data = torch.zeros(self.padded, dtype=torch.float32, device=device)
        self._hooks = []
        for p, o in zip(self.params, self.offsets):
            p.main_grad = self.data[o:o + p.numel()].view(p.shape)
            p.grad = None
            self._hooks.append(p.register_post_accumulate_grad_hook(_accumulate_into_main_grad))

    def zero(self) -> None:
        self.data.zero_()
        for p in self.params:
            p.grad = None

    def reduce(self, group, *, shard: bool = False, bucket_elems: int = DEFAULT_BUCKET_ELEMS) -> torch.Tensor:
        """Sum the main gradients over `group` (the data(-context)-parallel ranks). Returns the whole buffer
        (all-reduced in buckets), or with `shard` this rank's 1/size of it (reduce-scattered, fp32)."""
        size = comm.group_size(group)
        if size == 1:
            return self.data
        if shard:
            return comm.reduce_scatter(self.data, group)
        for start in range(0, self.padded, bucket_elems):
            comm.all_reduce(self.data[start:start + bucket_elems], group)
        return self.data

    def nbytes(self) -> int:
        return self.data.nbytes

    def remove(self) -> None:
        """Detach from the parameters (their gradients go back to plain .grad)."""
        for h in self._hooks:
            h.remove()
        for p in self.params:
            del p.main_grad
        self._hooks = []
