"""Full tensors <-> a rank's shards, and HF tensors <-> full tpzoo tensors (in memory, tensor by tensor).

The on-disk format and the streaming converters build on these; tests use them directly.
"""
from __future__ import annotations

from typing import Callable, Iterable, Iterator, Mapping

import torch
import torch.nn as nn

from tpzoo.parallel.sharding import ShardSpec, shard, unshard

from .format import CheckpointError


def vocab_dims(cfg) -> dict[str, int]:
    """tpzoo tensor name -> the dim that is padded to the padded vocab (embedding and head rows)."""
    from tpzoo.models.registry import get_family

    return {m.name: m.vocab_dim for m in get_family(cfg.family).hf_tensor_map(cfg) if m.vocab_dim is not None}


def pad_dim(t: torch.Tensor, dim: int, size: int) -> torch.Tensor:
    if t.shape[dim] == size:
        return t
    if t.shape[dim] > size:
        raise ValueError(f"cannot pad dim {dim} of size {t.shape[dim]} down to {size}")
    pad_shape = list(t.shape)
    pad_shape[dim] = size - t.shape[dim]
    return torch.cat([t, t.new_zeros(pad_shape)], dim=dim)


def shard_full(full: torch.Tensor, spec: ShardSpec, tp_rank: int, tp: int, vocab_dim: int | None = None,
               padded_size: int | None = None) -> torch.Tensor:
    """This rank's shard of a full, unpadded tensor (vocab rows padded with zeros first where needed)."""
    if vocab_dim is not None and padded_size is not None:
        full = pad_dim(full, vocab_dim, padded_size)
    return shard(full, spec, tp_rank, tp)


def unshard_full(shards: list[torch.Tensor], spec: ShardSpec, vocab_dim: int | None = None,
                 vocab_size: int | None = None) -> torch.Tensor:
    """The full, unpadded tensor from every TP rank's shard (rank order)."""
    full = unshard(shards, spec)
    if vocab_dim is not None and vocab_size is not None:
        full = full.narrow(vocab_dim, 0, vocab_size).contiguous()
    return full


def load_full_tensors(model: nn.Module, get_full: Callable[[str], torch.Tensor], tp_rank: int, tp: int) -> None:
    """Fill every parameter and persistent buffer of `model` (this rank's part) from full tensors looked up by
    tpzoo name."""
    from .layout import state_tensors

    cfg = model.cfg
    vdims = vocab_dims(cfg)
    for name, param in state_tensors(model):
        full = expert_slice(get_full(name), param, getattr(model, "dims", None))
        spec = getattr(param, "tp_spec", ShardSpec(None))
        local = shard_full(full, spec, tp_rank, tp, vdims.get(name), _padded_rows(param, spec, tp))
        if local.shape != param.shape:
            raise CheckpointError(f"{name}: shard shape {tuple(local.shape)} does not match the model's "
                             f"{tuple(param.shape)} (wrong config or tp?)")
        with torch.no_grad():
            param.copy_(local)


def expert_slice(full: torch.Tensor, param, dims) -> torch.Tensor:
    """This ep rank's experts (dim 0) of a stacked expert tensor; any other tensor unchanged."""
    if not getattr(param, "expert_parallel", False) or dims is None or dims.ep == 1:
        return full
    local = param.shape[0]
    return full[dims.ep_rank * local:(dims.ep_rank + 1) * local]


def _padded_rows(param: torch.Tensor, spec: ShardSpec, tp: int) -> int | None:
    return param.shape[spec.dim] * tp if spec.dim is not None else None


def hf_to_full(cfg, hf_tensors: Mapping[str, torch.Tensor]) -> Iterator[tuple[str, torch.Tensor]]:
    """(tpzoo name, full tensor) for every tensor of the family mapping, from HF tensors by name."""
    from tpzoo.models.registry import get_family

    for m in get_family(cfg.family).hf_tensor_map(cfg):
        if m.mirror:  # an HF copy of another tensor: never read
            continue
        missing = [n for n in m.hf if n not in hf_tensors]
        if missing:
            raise CheckpointError(f"HF checkpoint is missing tensor(s) {missing} (needed for {m.name})")
        yield m.name, m.to_tpzoo([hf_tensors[n] for n in m.hf])


def full_to_hf(cfg, full_tensors: Mapping[str, torch.Tensor]) -> Iterable[tuple[str, torch.Tensor]]:
    from tpzoo.models.registry import get_family

    for m in get_family(cfg.family).hf_tensor_map(cfg):
        if not m.export:
            continue
        yield from zip(m.hf, m.to_hf(full_tensors[m.name]))
