"""Helpers over sharded parameters: gather a full tensor, reduce the gradients of replicated SP parameters."""
from __future__ import annotations

import torch
import torch.nn as nn

from . import comm
from .state import get_tp_group, get_tp_size


def gather_tp_tensor(t: torch.Tensor, partition_dim: int | None) -> torch.Tensor:
    """The full tensor from this rank's shard (all-gather over the TP group); replicated tensors as they are."""
    if partition_dim is None or get_tp_size() == 1:
        return t.detach().clone()
    return comm.all_gather(t.detach(), get_tp_group(), dim=partition_dim)


def gather_tp_param(param: nn.Parameter, grad: bool = False) -> torch.Tensor:
    """Full value (or full gradient with grad=True) of a parameter marked by `mark_parallel`."""
    t = param.grad if grad else param
    if t is None:
        raise ValueError("parameter has no gradient")
    return gather_tp_tensor(t, getattr(param, "tp_partition_dim", None))


def sequence_parallel_params(module: nn.Module) -> list[nn.Parameter]:
    return [p for p in module.parameters() if getattr(p, "sequence_parallel", False)]


def allreduce_sequence_parallel_grads(module: nn.Module) -> None:
    """Sum over the TP group the gradients of replicated parameters that only saw this rank's sequence chunk
    (norm weights, row-parallel biases under sequence parallelism), so every TP rank applies the same update.
    Without it the TP ranks' copies drift apart (Megatron-LM issue #1446). One flat all-reduce."""
    grads = [p.grad for p in sequence_parallel_params(module) if p.grad is not None]
    if not grads or get_tp_size() == 1:
        return
    flat = torch.cat([g.reshape(-1) for g in grads])
    comm.all_reduce(flat, get_tp_group())
    offset = 0
    for g in grads:
        g.copy_(flat[offset: offset + g.numel()].view_as(g))
        offset += g.numel()
