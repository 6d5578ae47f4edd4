"""A kept-quantized model: its frozen projections computed from their quantized weights, dequantized per use.

`apply_quantization(chunk, record)` (called by Transformer.__init__ when the config says `quantization`, on meta)
turns every tensor the record names into its stored form: the weight parameter holds the quantized values (fp8
e4m3 [out, in], or int4 packed in int32 [out, in / 8]; frozen, with the weight's ShardSpec and expert-parallel
flag) and a frozen scale parameter `<name>_scale_inv` / `<name>_scale` sits beside it, laid out in blocks
(tpzoo.quant.layout: sharded along whole blocks, else refused). So the checkpoint machinery (specs, plans,
structure checks, fill and save) sees two more tensors and nothing new.

Compute: a linear layer's `fp8` slot (the seam its matmuls already go through: tpzoo.parallel.fp8.linear and the
sequence-parallel gathered matmul) holds a `QuantizedGemm`: y = x W^T with W dequantized from this rank's values
and scales into the activations' dtype at each use, in the forward and again in the backward for the input
gradient; nothing of W in 16 bits outlives the call, so a step holds the quantized bytes plus one layer's weight.
Mixtures of experts dequantize one expert at a time (`expert_mlp`). The frozen weights get no gradient; only LoRA's
adapters (beside them) train. The same path runs on a GPU (the dequantization is elementwise, then the matmul in
the activations' dtype); DeepSeek's block-scaled FP8 GEMM (torch.nn.functional.scaled_mm with BlockWise1x128 /
BlockWise128x128 scales, Hopper) would skip the 16-bit copy there: not built, since no GPU has measured it yet.
"""
from __future__ import annotations

import weakref

import torch
import torch.nn as nn
import torch.nn.functional as F

from tpzoo.errors import ConfigError
from tpzoo.parallel.eager import eager

from .formats import apply_scales, format_of
from .layout import block_index, check_whole_blocks, full_logical_shape, scale_full_shape, scale_spec


class QuantizedWeight:
    """One quantized tensor of a module (`attr`: "weight" of a linear, "gate_up" / "down" of a mixture of experts):
    where its values and scales live, and how to dequantize this rank's shard (or one expert of it)."""

    def __init__(self, module: nn.Module, attr: str, fmt, full: tuple, spec, rank: int, tp: int,
                 compute_dtype: torch.dtype):
        self._module = weakref.ref(module)  # the module holds this object: no reference cycle
        self.attr, self.fmt, self.full, self.spec = attr, fmt, tuple(full), spec
        self.rank, self.tp, self.compute_dtype = rank, tp, compute_dtype
        self._index: dict = {}

    @property
    def values(self) -> torch.Tensor:
        return getattr(self._module(), self.attr)

    @property
    def scales(self) -> torch.Tensor:
        return getattr(self._module(), self.attr + self.fmt.scale_suffix)

    def _rows(self, device) -> torch.Tensor:
        """This shard's row -> the row of its block in this shard's scales (built once per device). Columns need no
        map: a shard's columns start on a block boundary (tpzoo.quant.layout), so column c is in block c // unit."""
        if device not in self._index:
            self._index[device] = block_index(self.fmt, self.spec, self.full, self.rank, self.tp, 0).to(device)
        return self._index[device]

    def dequantized(self, dtype: torch.dtype, expert: int | None = None) -> torch.Tensor:
        """This rank's shard (or its local expert `expert`) in `dtype`: fp32(q) x its block's scale, rounded once."""
        q, s = self.values.detach(), self.scales.detach()
        if expert is not None:
            q, s = q[expert], s[expert]
        s = s.to(torch.float32).index_select(-2, self._rows(q.device))  # [rows, column blocks]
        return apply_scales(self.fmt.values(q), s, self.fmt.units()[1], 0, dtype)


class _DequantLinear(torch.autograd.Function):
    """y = x W^T with W = weight.dequantized(...) at each use: nothing saved but the (small) object; the input
    gradient dequantizes again. W is frozen: no weight gradient."""

    @staticmethod
    def forward(ctx, x, weight: QuantizedWeight, expert):
        ctx.weight, ctx.expert = weight, expert
        return F.linear(x, weight.dequantized(x.dtype, expert))

    @staticmethod
    def backward(ctx, dy):
        return dy.matmul(ctx.weight.dequantized(dy.dtype, ctx.expert)), None, None


@eager  # a weight cache and weak references: Python state, a graph break under torch.compile
def dequant_linear(x: torch.Tensor, weight: QuantizedWeight, bias: torch.Tensor | None = None,
                   expert: int | None = None) -> torch.Tensor:
    y = _DequantLinear.apply(x, weight, expert)
    return y + bias if bias is not None else y


class QuantizedGemm(QuantizedWeight):
    """What a column / row / replicated layer's `fp8` slot holds when its weight is kept quantized: its matmuls
    (tpzoo.parallel.fp8.linear calls `linear`; the sequence-parallel gathered matmul calls forward / input_grad
    around its own gather and reduce-scatter). `enable_fp8` leaves such a layer alone."""
    frozen_weight = True

    def linear(self, x, weight, bias):
        return dequant_linear(x, self, bias)

    def forward(self, x2, w, backward=False):
        return dequant_linear(x2, self), ()

    def backward_scales(self, dy, w, saved, need_input_grad, need_weight_grad):
        return None

    def input_grad(self, dy, w, saved, scales):
        return dy.matmul(self.dequantized(dy.dtype))

    def weight_grad(self, *args, **kw):
        raise RuntimeError("a kept-quantized weight is frozen: it has no gradient")

    def __repr__(self) -> str:
        return f"QuantizedGemm({self.fmt.name})"


def expert_mlp(rows: torch.Tensor, counts, gate_up, down, act, lora=None) -> torch.Tensor:
    """models/kinds/experts.expert_mlp's loop for kept-quantized experts (gate_up, down: a QuantizedWeight, or a
    plain [E, out, in] tensor): each expert's weights dequantized when it runs, one expert's at a time. `lora`: the
    experts' adapters (models/kinds/expert_lora.py), each expert's beside its matmul."""
    def linear(x, w, e):
        return dequant_linear(x, w, expert=e) if isinstance(w, QuantizedWeight) else F.linear(x, w[e])

    counts = counts.tolist() if isinstance(counts, torch.Tensor) else counts
    adapter = lora.per_expert() if lora is not None else None
    outs, start = [], 0
    for e, n in enumerate(counts):
        x = rows[start:start + n]
        h = linear(x, gate_up, e)
        a = act(*(h if adapter is None else adapter.add("gate_up", h, x, e)).chunk(2, dim=-1))
        out = linear(a, down, e)
        outs.append(out if adapter is None else adapter.add("down", out, a, e))
        start += n
    return torch.cat(outs, dim=0)


def _frozen(t: torch.Tensor, like: nn.Parameter) -> nn.Parameter:
    p = nn.Parameter(t, requires_grad=False)
    for key in ("tp_partition_dim", "sequence_parallel", "expert_parallel"):
        if hasattr(like, key):
            setattr(p, key, getattr(like, key))
    return p


def apply_quantization(chunk: nn.Module, record: dict, compute_dtype: torch.dtype | None) -> None:
    """Turn the chunk's tensors named in `record["tensors"]` (ModelConfig.quantization) into their stored form, on
    meta (module docstring); a tensor-parallel split cutting a block is refused naming the tensor."""
    from tpzoo.parallel import mark_parallel

    fmt = format_of(record)
    dims = chunk.dims
    compute_dtype = compute_dtype or torch.get_default_dtype()
    params = dict(chunk.named_parameters())
    for name in record["tensors"]:
        if name not in params:
            continue  # another pipeline stage's
        module_name, attr = name.rsplit(".", 1)
        module = chunk.get_submodule(module_name)
        old = params[name]
        if old.device.type != "meta":
            raise ConfigError(f"{name}: a model is quantized on meta, before its weights are allocated")
        spec = old.tp_spec
        full = full_logical_shape(tuple(old.shape), spec, dims.tp)
        check_whole_blocks(fmt, name, full, spec, dims.tp)
        weight = _frozen(torch.empty(fmt.stored_shape(old.shape), dtype=fmt.weight_dtype, device="meta"), old)
        weight.tp_spec = spec
        sspec = scale_spec(fmt, spec, len(full))
        sfull = scale_full_shape(fmt, full, spec)
        local = [sspec.local_size(n, dims.tp) if sspec.dim is not None and i == sspec.dim % len(sfull) else n
                 for i, n in enumerate(sfull)]
        if getattr(old, "expert_parallel", False):
            local[0] = old.shape[0]
        scale = mark_parallel(_frozen(torch.empty(local, dtype=fmt.scale_dtype, device="meta"), old), sspec,
                              getattr(old, "sequence_parallel", False))
        setattr(module, attr, weight)
        module.register_parameter(attr + fmt.scale_suffix, scale)
        args = (module, attr, fmt, full, spec, dims.tp_rank, dims.tp, compute_dtype)
        if attr == "weight" and hasattr(module, "fp8"):  # a parallel linear layer: its matmuls' seam
            module.fp8 = QuantizedGemm(*args)
        else:  # a mixture of experts' stacked weights (models/kinds/moe.py asks `quantized`)
            module.quantized = {**getattr(module, "quantized", {}), attr: QuantizedWeight(*args)}


@torch.no_grad()
def dequantize_model(chunk: nn.Module, dtype: torch.dtype) -> nn.Module:
    """Replace a kept-quantized chunk's quantized tensors by their dequantized values in `dtype` (frozen, same specs),
    drop the scales: an ordinary model again, whose adapters `--merge` can fold in (its config loses `quantization`)."""
    for module in list(chunk.modules()):
        weights = dict(getattr(module, "quantized", {}))
        if isinstance(getattr(module, "fp8", None), QuantizedGemm):
            weights["weight"] = module.fp8
            module.fp8 = None
        for attr, qw in weights.items():
            old = getattr(module, attr)
            n = old.shape[0] if attr != "weight" else None
            dense = (qw.dequantized(dtype) if n is None else
                     torch.stack([qw.dequantized(dtype, e) for e in range(n)]))
            new = _frozen(dense, old)
            new.tp_spec = old.tp_spec
            delattr(module, attr + qw.fmt.scale_suffix)
            setattr(module, attr, new)
        if hasattr(module, "quantized"):
            del module.quantized
    chunk.cfg = chunk.cfg.replace(quantization=None)
    return chunk


def merge_dtype(ckpt) -> torch.dtype | None:
    """The dtype `--merge` writes a LoRA checkpoint's base in: the run's (its adapters' dtype) when the base is kept
    quantized, else None (the base's own)."""
    from tpzoo.checkpoint.format import is_checkpoint, read_manifest
    from tpzoo.checkpoint.lora_io import lora_info, resolve_base
    from tpzoo.checkpoint.safetensors_io import DTYPES

    base = resolve_base(lora_info(ckpt), ckpt)
    if not is_checkpoint(base) or not read_manifest(base)["model_config"].get("quantization"):
        return None
    return DTYPES[next(iter(read_manifest(ckpt)["tensors"].values()))["dtype"]]


def quantizable_tensors(chunk: nn.Module) -> list[str]:
    """The chunk's tensors a quantized base stores quantized (what the published FP8 checkpoints quantize): the
    weights of the blocks' parallel linear layers (not a one-output gate) and the experts' stacked weights; never the
    embeddings, the head, norms, routers or biases."""
    out = []
    for name, m in chunk.named_modules():
        if not name.startswith("layers."):
            continue
        if getattr(type(m), "fp8_kind", None) and m.weight.shape[0] > 1:
            out.append(name + ".weight")
        out += [f"{name}.{attr}" for attr in ("gate_up", "down") if isinstance(getattr(m, attr, None), nn.Parameter)]
    return out
