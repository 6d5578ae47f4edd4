"""finalize_grads: the model-parallel gradient reductions between the backward passes and the optimizer.

Both are sums, so their order does not change the result:
  1. tensor parallel: replicated parameters that only saw this rank's sequence chunk (norms, row biases under
     SP) and kv heads replicated over TP ranks get the sum over their copies (`finish_tp_grads`);
  2. tied weights: a weight the model declared tied (`mark_tied`: the first stage's embedding and the last
     stage's head) is one parameter stored on several ranks; each copy gets the sum of all copies' gradients
     over the group the model named, so the copies stay equal.
The data-parallel sum comes after, from the gradients' GradBuffer (tpzoo.parallel.data_parallel): the one place
gradients are reduced over replicas (the optimizer calls it; so can a test).
"""
from __future__ import annotations

import torch

from tpzoo.parallel import comm, finish_tp_grads, grad_of
from tpzoo.parallel.dims import ParallelDims
from tpzoo.parallel.state import get_dims


def tied_params(chunks) -> list[torch.nn.Parameter]:
    """This rank's copies of tied weights, each Parameter once."""
    found = {}
    for chunk in chunks:
        for p in chunk.parameters():
            if getattr(p, "tied_group", None):
                found[id(p)] = p
    return list(found.values())


def sum_tied_grads(chunks, dims: ParallelDims | None = None) -> None:
    dims = get_dims(dims)
    for p in tied_params(chunks):
        if dims.group_size(p.tied_group) == 1 or not p.requires_grad:
            continue  # every copy is this very Parameter, or it is frozen (LoRA) on every rank
        g = grad_of(p)
        if g is None:  # the other copy may have a gradient: join the sum with zeros
            p.grad = g = torch.zeros_like(p)
        comm.all_reduce(g, dims.group(p.tied_group))


def finalize_grads(chunks, dims: ParallelDims | None = None) -> None:
    """TP reductions, then the sum of tied copies (collective over the TP and embedding groups)."""
    dims = get_dims(dims)
    for chunk in chunks:
        finish_tp_grads(chunk, dims)
    sum_tied_grads(chunks, dims)
