"""Helpers over sharded parameters: gather full tensors, and finish the TP-level gradient reductions.

Gradients are read and reduced where they live: a parameter's fp32 `main_grad` when a GradBuffer is attached
(tpzoo.parallel.data_parallel: the trainer's mixed precision), else its `.grad` (`grad_of`)."""
from __future__ import annotations

import torch
import torch.nn as nn

from . import comm
from .sharding import ShardSpec, shard, unshard
from .dims import ParallelDims
from .state import get_dims


def param_spec(param: torch.Tensor) -> ShardSpec:
    return getattr(param, "tp_spec", ShardSpec(None))


def grad_of(param: torch.Tensor) -> torch.Tensor | None:
    """The gradient of `param` as accumulated so far: its fp32 main_grad when it has one, else .grad."""
    main = getattr(param, "main_grad", None)
    return main if main is not None else param.grad


def gather_tp_tensor(t: torch.Tensor, spec: ShardSpec | int | None, reduce: str = "first",
                     dims: ParallelDims | None = None) -> torch.Tensor:
    """The full tensor from every TP rank's shard `t` (collective over the TP group)."""
    spec = spec if isinstance(spec, ShardSpec) else ShardSpec(spec)
    dims = get_dims(dims)
    if spec.dim is None:
        return t.detach().clone()
    if dims.tp == 1:
        return unshard([t.detach().clone()], spec, reduce)
    gathered = comm.all_gather(t.detach(), dims.tp_group, dim=spec.dim)
    return unshard(list(gathered.chunk(dims.tp, dim=spec.dim)), spec, reduce)


def gather_tp_param(param: nn.Parameter, grad: bool = False, dims: ParallelDims | None = None) -> torch.Tensor:
    """Full value (or full gradient with grad=True) of a parameter marked by `mark_parallel`.
    With grad=True the raw (partial) gradients of replicated kv-head copies are summed, which gives the true
    gradient of the shared head *before* `finish_tp_grads`; after it every copy already holds that sum, so
    gather with `gather_tp_tensor(p.grad, param_spec(p), reduce="first")` instead."""
    t = grad_of(param) if grad else param
    if t is None:
        raise ValueError("parameter has no gradient")
    return gather_tp_tensor(t, param_spec(param), reduce="sum" if grad else "first", dims=dims)


def sequence_parallel_params(module: nn.Module) -> list[nn.Parameter]:
    return [p for p in module.parameters() if getattr(p, "sequence_parallel", False)]


def allreduce_sequence_parallel_grads(module: nn.Module, dims: ParallelDims | None = None) -> None:
    """Sum over the TP group the gradients of replicated parameters that only saw this rank's sequence chunk
    (norm weights, row-parallel biases under sequence parallelism), so every TP rank applies the same update.
    Without it the TP ranks' copies drift apart (Megatron-LM issue #1446). One flat all-reduce."""
    dims = get_dims(dims)
    grads = [g for g in map(grad_of, sequence_parallel_params(module)) if g is not None]
    if not grads or dims.tp == 1:
        return
    flat = torch.cat([g.reshape(-1) for g in grads])
    comm.all_reduce(flat, dims.tp_group)
    offset = 0
    for g in grads:
        g.copy_(flat[offset: offset + g.numel()].view_as(g))
        offset += g.numel()


def sync_replicated_head_grads(module: nn.Module, dims: ParallelDims | None = None) -> None:
    """Kv heads replicated over several TP ranks (kv_heads < tp) get a partial gradient on each copy: replace
    each copy's gradient by the sum over the copies, so the copies stay identical after the optimizer step."""
    dims = get_dims(dims)
    if dims.tp == 1:
        return
    for p in module.parameters():
        spec, g = param_spec(p), grad_of(p)
        if g is None or spec.dim is None or not spec.replicas or max(spec.replicas) == 1:
            continue
        full = gather_tp_tensor(g, spec, reduce="sum", dims=dims)
        g.copy_(shard(full, spec, dims.tp_rank, dims.tp))


def finish_tp_grads(module: nn.Module, dims: ParallelDims | None = None) -> None:
    """The tensor-parallel gradient reductions a trainer runs after backward and before clipping."""
    allreduce_sequence_parallel_grads(module, dims)
    sync_replicated_head_grads(module, dims)
