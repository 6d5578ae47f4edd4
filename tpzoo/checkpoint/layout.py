"""What each (tp, pp) rank of a layout holds: pipeline chunks, parameter names, shard shapes and specs.

The plan comes from building each chunk's Transformer on the meta device for a virtual rank of the layout
(`ParallelDims.for_rank`: no memory, no process group), so it is by construction exactly what the model code
creates at that layout.

`local_segments` states a shard as ranges of the full tensor (along the split dim), which is what lets any
layout be read from any other by positioned reads of just the needed bytes.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from tpzoo.parallel.layers import padded_vocab_size
from tpzoo.parallel.sharding import ShardSpec
from tpzoo.parallel.dims import ParallelDims, ParallelLayoutError

from .tensors import vocab_dims


# --- shard specs ------------------------------------------------------------------------------------------

def spec_to_json(spec: ShardSpec) -> dict | None:
    if spec.dim is None:
        return None
    return {"dim": spec.dim, "parts": list(spec.parts) if spec.parts else None,
            "replicas": list(spec.replicas) if spec.replicas else None, "block": spec.block}


def spec_from_json(d: dict | None) -> ShardSpec:
    if d is None:
        return ShardSpec(None)
    return ShardSpec(d["dim"], tuple(d["parts"]) if d.get("parts") else None,
                     tuple(d["replicas"]) if d.get("replicas") else None, d.get("block", 1))


def local_segments(spec: ShardSpec, full_len: int, rank: int, tp: int) -> list[tuple[int, int]]:
    """Rank `rank`'s shard along the split dim as (start, length) ranges of the full tensor, in shard order
    (the shard is their concatenation). `full_len` is the (padded) full size of that dim. Replicated kv heads
    appear as repeated ranges; see ShardSpec for the layouts."""
    if spec.dim is None or tp == 1 and not spec.replicas:
        return [(0, full_len)]
    out: list[tuple[int, int]] = []
    offset = 0
    for size, rep in spec._parts(full_len):
        if (size * rep) % tp:
            raise ParallelLayoutError(f"a tensor-parallel part of size {size * rep} is not divisible by tp={tp}")
        n = size * rep // tp
        e, end = rank * n, (rank + 1) * n
        while e < end:  # walk the expanded (replicated) index space block by block
            if rep == 1:
                start, take = e, end - e
            else:
                block, within = divmod(e, spec.block)
                take = min(spec.block - within, end - e)
                start = (block // rep) * spec.block + within
            if out and out[-1][0] + out[-1][1] == offset + start:
                out[-1] = (out[-1][0], out[-1][1] + take)
            else:
                out.append((offset + start, take))
            e += take
        offset += size
    return out


# --- pipeline partition -----------------------------------------------------------------------------------

def even_partition(num_layers: int, chunks: int) -> list[tuple[int, int]]:
    """`chunks` contiguous layer ranges, sizes differing by at most one (the earlier ones larger)."""
    base, extra = divmod(num_layers, chunks)
    out, start = [], 0
    for i in range(chunks):
        end = start + base + (1 if i < extra else 0)
        out.append((start, end))
        start = end
    return out


def partition(cfg, pp: int, virtual_stages: int = 1) -> list[tuple[int, int]]:
    """Layer ranges of the pp * virtual_stages model chunks, in model order (chunk c lives on pp rank c % pp).
    Uses tpzoo.pipeline.partition_layers when that module provides it, else an even split."""
    try:
        from tpzoo.pipeline import partition_layers
    except ImportError:
        partition_layers = None
    if partition_layers is not None:
        return [tuple(r) for r in partition_layers(cfg, pp, virtual_stages=virtual_stages)]
    if pp * virtual_stages > cfg.num_layers:
        raise ParallelLayoutError(f"{pp * virtual_stages} pipeline chunks for {cfg.num_layers} layers")
    return even_partition(cfg.num_layers, pp * virtual_stages)


def stages_from_ranges(ranges: list[tuple[int, int]], pp: int) -> list[dict]:
    """Manifest `stages` entries: one per chunk in model order, with its pp rank and pre/post flags."""
    n = len(ranges)
    return [{"pp_rank": c % pp, "layers": [int(s), int(e)], "pre_process": c == 0, "post_process": c == n - 1}
            for c, (s, e) in enumerate(ranges)]


# --- parameter plan ---------------------------------------------------------------------------------------

@dataclass
class ParamInfo:
    name: str
    local_shape: tuple
    spec: ShardSpec
    full_shape: tuple             # full and unpadded
    vocab_dim: int | None = None  # the dim padded to `padded` rows
    padded: int | None = None     # padded full size along vocab_dim at this tp
    rows: tuple | None = None     # (start, end) of dim 0 this rank holds: its experts under expert parallelism


@dataclass
class ChunkPlan:
    pp_rank: int
    layers: tuple[int, int]
    pre_process: bool
    post_process: bool
    params: list[ParamInfo] = field(default_factory=list)


def build_chunk(cfg, stage: dict, dims: ParallelDims | None = None, *, vocab_padding_multiple: int = 1):
    """The Transformer of one manifest `stages` entry for the rank `dims` describes (default: the default dims),
    on meta: its parameters' names, shards and specs."""
    from tpzoo.models import ModelLayout, Stage, Transformer

    layout = ModelLayout(dims, vocab_padding_multiple=vocab_padding_multiple, device="meta")
    return Transformer(cfg, layout, Stage.from_manifest(stage))


def state_tensors(model) -> list[tuple[str, torch.Tensor]]:
    """What a checkpoint holds of a model: its parameters, then its persistent buffers (non-gradient state, such as
    a router's selection bias: `register_buffer(..., persistent=True)`, PyTorch's default; derived tables are
    registered persistent=False and left out), by their names in the model. A buffer carries no `tp_spec`: it is
    replicated over tp, like a norm weight (its slices, if a kind ever splits one, would carry a spec as a
    parameter's do)."""
    out = list(model.named_parameters())  # tied weights appear once, as in the model
    for prefix, module in model.named_modules():
        for name, buf in module.named_buffers(recurse=False):
            if buf is not None and name not in module._non_persistent_buffers_set:
                out.append((f"{prefix}.{name}" if prefix else name, buf))
    return out


def param_infos(model, cfg, tp: int, select=None) -> list[ParamInfo]:
    """Name, shard shape and spec of every parameter and persistent buffer of `model` (state_tensors; a rank's
    chunk at tensor-parallel size tp), or of those whose name `select(name)` accepts (a LoRA checkpoint holds only
    the adapters)."""
    vdims = vocab_dims(cfg)
    out = []
    for name, p in state_tensors(model):
        if select is not None and not select(name):
            continue
        spec = getattr(p, "tp_spec", ShardSpec(None))
        full = list(p.shape)
        vdim, padded = vdims.get(name), None
        if spec.dim is not None:
            d = spec.dim % p.dim()
            full[d] = sum(spec.parts) if spec.parts else p.shape[d] * tp
            if vdim is not None:
                padded, full[d] = full[d], cfg.vocab_size
        rows = None
        ep = getattr(getattr(model, "dims", None), "ep", 1)
        if getattr(p, "expert_parallel", False) and ep > 1:  # checkpoints hold every expert (no ep in the layout)
            full[0] = p.shape[0] * ep
            rows = (model.dims.ep_rank * p.shape[0], (model.dims.ep_rank + 1) * p.shape[0])
        out.append(ParamInfo(name, tuple(p.shape), spec, tuple(full), vdim, padded, rows))
    return out


def layout_plan(cfg, tp: int, stages: list[dict], vocab_padding_multiple: int = 1, lora=None) -> list[ChunkPlan]:
    """Every chunk's parameters at tensor-parallel size tp (shard shapes are the same on every tp rank); with
    `lora` (a LoRAConfig), the adapters only: what a LoRA checkpoint holds."""
    plans = []
    pp = max(s["pp_rank"] for s in stages) + 1
    for st in stages:
        dims = ParallelDims.for_rank(tp=tp, pp=pp, pp_rank=st["pp_rank"])
        model = build_chunk(cfg, st, dims, vocab_padding_multiple=vocab_padding_multiple)
        select = None
        if lora is not None:
            from tpzoo.models.lora import add_lora
            from tpzoo.parallel.lora import is_lora_param

            add_lora([model], lora)
            select = is_lora_param
        plans.append(ChunkPlan(st["pp_rank"], tuple(st["layers"]), st["pre_process"], st["post_process"],
                               param_infos(model, cfg, tp, select)))
    return plans


def infer_padding_multiple(vocab: int, padded: int, tp: int) -> int:
    """The largest power-of-two multiple (<= 1024) that pads `vocab` to `padded` at this tp."""
    best = 1
    for m in (2 ** k for k in range(11)):
        if padded_vocab_size(vocab, tp, m) == padded:
            best = m
    return best


def empty_meta(shape, dtype=torch.float32) -> torch.Tensor:
    return torch.empty(shape, dtype=dtype, device="meta")
