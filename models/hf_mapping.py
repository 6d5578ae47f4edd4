"""Tensor-name mappings between Hugging Face checkpoints and tpzoo's full (unsharded) tensors.

A family's `hf_tensor_map(cfg)` returns one TensorMap per tpzoo tensor. tpzoo tensors here are *full* and
*unpadded*: sharding over tp and vocab padding are applied afterwards from the model's ShardSpecs, so the same
table serves every layout. Converters are pure functions on tensors (no dtype changes: round trips are
bit-exact).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

Tensors = list[torch.Tensor]


@dataclass(frozen=True)
class PeftParam:
    """How Hugging Face PEFT adapts a stacked experts tensor (`target_parameters`, its ParamWrapper): the parameter
    as transformers 5 holds it in memory (e.g. "model.layers.3.mlp.experts.gate_up_proj", whatever the checkpoint
    stores), and, where HF orders the tensor's output rows unlike tpzoo, the permutation of an adapter's B rows
    ([E, out, r], dim 1) to HF's order and back (gpt-oss's interleaved gate|up)."""
    param: str
    out_to_hf: Callable[[torch.Tensor], torch.Tensor] | None = None
    out_from_hf: Callable[[torch.Tensor], torch.Tensor] | None = None


@dataclass
class TensorMap:
    name: str                                  # tpzoo name, e.g. "layers.3.attn.qkv.weight"
    hf: tuple[str, ...]                        # the HF tensors it is made of
    to_tpzoo: Callable[[Tensors], torch.Tensor]
    to_hf: Callable[[torch.Tensor], Tensors]
    vocab_dim: int | None = None               # dim padded to the padded vocab when sharded
    export: bool = True                        # False: a copy of another tensor (tied head), not written to HF
    layer: int | None = None                   # transformer layer index (pipeline stage assignment)
    rows: tuple[int, ...] | None = None        # the HF tensors' rows when the tpzoo tensor stacks them (dim 0,
                                               # concatenated): LoRA gives each its adapter over those rows
    peft: PeftParam | None = None              # stacked experts: how PEFT names and lays out their adapters
    mirror: bool = False                       # True: HF keeps a copy of tpzoo tensor `name` here (DeepSeek's
                                               # multi-token-prediction layers, of the embedding and the head):
                                               # written on export, never read on import


def same(name: str, hf: str, **kw) -> TensorMap:
    return TensorMap(name, (hf,), lambda t: t[0], lambda x: [x], **kw)


def transposed(name: str, hf: str, **kw) -> TensorMap:
    """HF Conv1D (GPT-2) stores [in, out]; tpzoo linears are [out, in]."""
    return TensorMap(name, (hf,), lambda t: t[0].t().contiguous(), lambda x: [x.t().contiguous()], **kw)


def concatenated(name: str, hfs: tuple[str, ...], sizes: tuple[int, ...], dim: int = 0, transpose: bool = False,
                 **kw) -> TensorMap:
    """Several HF tensors fused into one tpzoo tensor along `dim` (q|k|v, gate|up), or the reverse split."""

    def to_tpzoo(ts: Tensors) -> torch.Tensor:
        ts = [t.t() for t in ts] if transpose else ts
        return torch.cat(ts, dim=dim)

    def to_hf(x: torch.Tensor) -> Tensors:
        return [p.t().contiguous() if transpose else p.contiguous() for p in x.split(list(sizes), dim=dim)]

    rows = tuple(sizes) if dim == 0 and not transpose else None
    return TensorMap(name, tuple(hfs), to_tpzoo, to_hf, rows=rows, **kw)

