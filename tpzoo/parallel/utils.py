"""Helpers over sharded parameters: gather full tensors, and finish the TP-level gradient reductions."""
from __future__ import annotations

import torch
import torch.nn as nn

from . import comm
from .sharding import ShardSpec, shard, unshard
from .state import get_tp_group, get_tp_rank, get_tp_size


def param_spec(param: torch.Tensor) -> ShardSpec:
    return getattr(param, "tp_spec", ShardSpec(None))


def gather_tp_tensor(t: torch.Tensor, spec: ShardSpec | int | None, reduce: str = "first") -> torch.Tensor:
    """The full tensor from every TP rank's shard `t` (collective over the TP group)."""
    spec = spec if isinstance(spec, ShardSpec) else ShardSpec(spec)
    tp = get_tp_size()
    if spec.dim is None:
        return t.detach().clone()
    if tp == 1:
        return unshard([t.detach().clone()], spec, reduce)
    gathered = comm.all_gather(t.detach(), get_tp_group(), dim=spec.dim)
    return unshard(list(gathered.chunk(tp, dim=spec.dim)), spec, reduce)


def gather_tp_param(param: nn.Parameter, grad: bool = False) -> torch.Tensor:
    """Full value (or full gradient with grad=True) of a parameter marked by `mark_parallel`.
    With grad=True the raw (partial) gradients of replicated kv-head copies are summed, which gives the true
    gradient of the shared head *before* `finish_tp_grads`; after it every copy already holds that sum, so
    gather with `gather_tp_tensor(p.grad, param_spec(p), reduce="first")` instead."""
    t = param.grad if grad else param
    if t is None:
        raise ValueError("parameter has no gradient")
    return gather_tp_tensor(t, param_spec(param), reduce="sum" if grad else "first")


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


def sync_replicated_head_grads(module: nn.Module) -> None:
    """Kv heads replicated over several TP ranks (kv_heads < tp) get a partial gradient on each copy: replace
    each copy's gradient by the sum over the copies, so the copies stay identical after the optimizer step."""
    if get_tp_size() == 1:
        return
    for p in module.parameters():
        spec = param_spec(p)
        if p.grad is None or spec.dim is None or not spec.replicas or max(spec.replicas) == 1:
            continue
        full = gather_tp_tensor(p.grad, spec, reduce="sum")
        p.grad.copy_(shard(full, spec, get_tp_rank(), get_tp_size()))


def finish_tp_grads(module: nn.Module) -> None:
    """The tensor-parallel gradient reductions a trainer runs after backward and before clipping."""
    allreduce_sequence_parallel_grads(module)
    sync_replicated_head_grads(module)
