"""Tensor-parallel layers: column- and row-parallel linear, vocab-parallel embedding.

Each parameter carries `tp_partition_dim` (the dim it is split along, or None when replicated across the
tensor-parallel group) and `sequence_parallel` (True for replicated parameters that see only this rank's
sequence chunk, whose gradients must be summed over the tensor-parallel group).

Initialization is layout independent: the full ("master") weight is drawn from the same generator on every
rank, and each rank keeps its slice, so a seed gives the same full weight at every tp.

The column- and row-parallel layers run their matmuls in FP8 when `layer.fp8` holds an Fp8Linear
(tpzoo.parallel.fp8.enable_fp8; None by default): one call, tpzoo.parallel.fp8.linear, or the sequence-parallel
column matmul given it.

The column- and row-parallel matmuls accumulate their weight gradients straight into the fp32 main gradients
when a GradBuffer with gradient-accumulation fusion holds them (tpzoo.parallel.wgrad).

Every layer takes `dims` (a ParallelDims: its TP size, rank and group; default: the default dims) and `device`
(default: dims.device). Built on "meta", a layer holds no memory and draws nothing: `to_empty()` then
`reset_parameters()` materializes it exactly as a direct build would.
"""
from __future__ import annotations

import math
from typing import Callable

import torch
import torch.nn as nn
import torch.nn.functional as F

from . import fp8 as _fp8
from .column_linear import gathered_linear
from .mappings import (copy_to_tp, gather_from_sequence, gather_from_tp, reduce_from_tp,
                       reduce_scatter_to_sequence, scatter_to_tp)
from .sharding import ShardSpec, shard
from .dims import ParallelDims, divide
from .state import get_dims
from .wgrad import linear

InitMethod = Callable[[torch.Tensor], None]


def normal_init(std: float = 0.02) -> InitMethod:
    return lambda t: nn.init.normal_(t, mean=0.0, std=std)


def mark_parallel(param: nn.Parameter, spec: ShardSpec | int | None, sequence_parallel: bool = False) -> nn.Parameter:
    """Attach the tensor-parallel layout (a ShardSpec, a split dim, or None for replicated) to a parameter."""
    spec = spec if isinstance(spec, ShardSpec) else ShardSpec(spec)
    param.tp_spec = spec
    param.tp_partition_dim = spec.dim
    param.sequence_parallel = sequence_parallel
    return param


def mark_tied(param: nn.Parameter, group: str, primary: bool) -> nn.Parameter:
    """Declare `param` one copy of a weight stored on several ranks (a tied embedding: the first pipeline stage's
    input embedding and the last stage's output head). `group` names the ParallelDims group of the ranks that
    hold a copy; their gradients are summed over it so the copies stay equal, and only the `primary` copy counts
    toward the gradient norm."""
    param.tied_group = group
    param.tied_primary = primary
    return param


def _init_shard(local: torch.Tensor, full_shape: tuple, spec: ShardSpec, init_method: InitMethod,
                rank: int, size: int) -> None:
    """Draw the full weight, keep this rank's shard (identical full weight at any tp for one RNG state).

    Fused parts are drawn one after the other in a fixed order, so a fused layer's full weight equals the
    concatenation of what separate layers of the same shapes would draw."""
    if local.device.type == "meta":
        return
    dim = spec.dim
    if dim is None:  # replicated: every rank keeps the whole draw
        master = torch.empty(full_shape, dtype=torch.float32, device=local.device)
        init_method(master)
        with torch.no_grad():
            local.copy_(master)
        return
    pieces = []
    for part in spec.parts or (full_shape[dim],):
        shape = list(full_shape)
        shape[dim] = part
        # Drawn on the layer's device (its generator): a CPU draw of a large model's full weights would be slow.
        piece = torch.empty(shape, dtype=torch.float32, device=local.device)
        init_method(piece)
        pieces.append(piece)
    master = torch.cat(pieces, dim=dim)
    with torch.no_grad():
        local.copy_(shard(master, spec, rank, size))


class ColumnParallelLinear(nn.Module):
    """y = x A^T + b with A split along its output dim: rank r holds rows [r*out/tp, (r+1)*out/tp).

    The output is this rank's slice of the features unless `gather_output`. With `sequence_parallel`, the
    input is this rank's chunk of the sequence (dim `sequence_dim`) and is all-gathered before the matmul;
    only the chunk is kept for backward, which gathers it again (tpzoo.parallel.column_linear).
    """
    fp8_kind = "column"  # FP8 scales: the output dim is split over tp (tpzoo.parallel.fp8)

    def __init__(self, in_features: int, out_features: int, bias: bool = True, gather_output: bool = False,
                 sequence_parallel: bool = False, init_method: InitMethod | None = None, sequence_dim: int = -2,
                 skip_bias_add: bool = False, shard_spec: ShardSpec | None = None, dtype: torch.dtype | None = None,
                 device=None, dims: ParallelDims | None = None):
        super().__init__()
        self.dims = get_dims(dims)
        self.tp_size, self.tp_rank = self.dims.tp, self.dims.tp_rank
        self.in_features, self.out_features = in_features, out_features
        # skip_bias_add: forward returns x A^T only, so a fused kernel can add the bias (bias + GeLU in one pass).
        self.skip_bias_add = skip_bias_add
        # shard_spec: fused outputs (e.g. gate|up) or replicated kv heads; default: a plain split of the rows.
        self.shard_spec = shard_spec or ShardSpec(0)
        if shard_spec is None:
            self.out_per_rank = divide(out_features, self.tp_size, "ColumnParallelLinear out_features / tp")
        else:
            self.out_per_rank = self.shard_spec.local_size(out_features, self.tp_size)
        if gather_output and sequence_parallel:
            raise ValueError("ColumnParallelLinear: gather_output and sequence_parallel cannot both be set")
        self.gather_output, self.sequence_parallel, self.sequence_dim = gather_output, sequence_parallel, sequence_dim
        self.init_method = init_method or normal_init()
        kw = {"dtype": dtype, "device": device if device is not None else self.dims.device}
        self.weight = mark_parallel(nn.Parameter(torch.empty(self.out_per_rank, in_features, **kw)), self.shard_spec)
        self.bias = (mark_parallel(nn.Parameter(torch.empty(self.out_per_rank, **kw)), self.shard_spec)
                     if bias else None)
        self.reset_parameters()
        self.lora = None  # a tpzoo.parallel.lora.LoRA when adapters are attached
        self.fp8 = None   # a tpzoo.parallel.fp8.Fp8Linear when the matmuls run in FP8

    def reset_parameters(self) -> None:
        _init_shard(self.weight, (self.out_features, self.in_features), self.shard_spec, self.init_method,
                    self.tp_rank, self.tp_size)
        if self.bias is not None and self.bias.device.type != "meta":
            nn.init.zeros_(self.bias)

    def matmuls(self, x: torch.Tensor, extra: tuple = (), drop=None) -> tuple:
        """Enter the TP region with `x` and return (x W^T + b, *(x w^T + b_e for (w, b_e) in extra)): the layer's
        output and those of more weights fed the same input (LoRA's A), one entry collective for all. Under SP
        the gather keeps only this rank's shard for backward (tpzoo.parallel.column_linear), unless `drop` (a
        dropout for the extra matmuls' input) needs the gathered input itself."""
        group = self.dims.tp_group
        bias = None if self.skip_bias_add else self.bias
        if self.sequence_parallel and self.tp_size > 1 and drop is None:
            out = gathered_linear(x, self.weight, bias, self.sequence_dim, group, extra=extra, fp8=self.fp8)
            return out if extra else (out,)
        x = gather_from_sequence(x, self.sequence_dim, group) if self.sequence_parallel else copy_to_tp(x, group)
        dropped = drop(x) if drop is not None else x
        return (_fp8.linear(x, self.weight, bias, self.fp8), *(linear(dropped, w, b) for w, b in extra))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.lora is not None:  # low-rank adapters (tpzoo.parallel.lora)
            y = self.lora.column_forward(self, x)
        else:
            (y,) = self.matmuls(x)
        return gather_from_tp(y, self.dims.tp_group) if self.gather_output else y

    def extra_repr(self) -> str:
        return (f"in={self.in_features}, out={self.out_features} (local {self.out_per_rank}), tp={self.tp_size}, "
                f"bias={self.bias is not None}, sequence_parallel={self.sequence_parallel}"
                + (f", fp8={self.fp8.recipe.name}" if self.fp8 is not None else ""))


class RowParallelLinear(nn.Module):
    """y = x A^T + b with A split along its input dim: weight [out, in/tp]; the partial products are summed
    (all-reduce, or reduce-scatter along the sequence with `sequence_parallel`) and the full bias is added
    once, after the reduction."""
    fp8_kind = "row"  # FP8 scales: the input dim is split over tp (tpzoo.parallel.fp8)

    def __init__(self, in_features: int, out_features: int, bias: bool = True, input_is_parallel: bool = True,
                 sequence_parallel: bool = False, init_method: InitMethod | None = None, sequence_dim: int = -2,
                 dtype: torch.dtype | None = None, device=None, dims: ParallelDims | None = None):
        super().__init__()
        self.dims = get_dims(dims)
        self.tp_size, self.tp_rank = self.dims.tp, self.dims.tp_rank
        self.in_features, self.out_features = in_features, out_features
        self.in_per_rank = divide(in_features, self.tp_size, "RowParallelLinear in_features / tp")
        if sequence_parallel and not input_is_parallel:
            raise ValueError("RowParallelLinear: sequence_parallel requires input_is_parallel=True")
        self.input_is_parallel, self.sequence_parallel, self.sequence_dim = (input_is_parallel, sequence_parallel,
                                                                             sequence_dim)
        self.init_method = init_method or normal_init()
        kw = {"dtype": dtype, "device": device if device is not None else self.dims.device}
        self.weight = mark_parallel(nn.Parameter(torch.empty(out_features, self.in_per_rank, **kw)), 1)
        # The bias is replicated; under sequence parallelism each rank adds it to its own sequence chunk only,
        # so its gradient is partial and must be summed over the tensor-parallel group.
        self.bias = (mark_parallel(nn.Parameter(torch.empty(out_features, **kw)), None, sequence_parallel)
                     if bias else None)
        self.reset_parameters()
        self.lora = None  # a tpzoo.parallel.lora.LoRA when adapters are attached
        self.fp8 = None   # a tpzoo.parallel.fp8.Fp8Linear when the matmul runs in FP8

    def reset_parameters(self) -> None:
        _init_shard(self.weight, (self.out_features, self.in_features), ShardSpec(1), self.init_method,
                    self.tp_rank, self.tp_size)
        if self.bias is not None and self.bias.device.type != "meta":
            nn.init.zeros_(self.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        group = self.dims.tp_group
        if not self.input_is_parallel:
            x = scatter_to_tp(x, group)
        y = _fp8.linear(x, self.weight, None, self.fp8)
        if self.lora is not None:  # the adapter's partial output joins the reduction (tpzoo.parallel.lora)
            y = self.lora.row_partial(x, y)
        y = (reduce_scatter_to_sequence(y, self.sequence_dim, group) if self.sequence_parallel
             else reduce_from_tp(y, group))
        return y + self.bias if self.bias is not None else y

    def extra_repr(self) -> str:
        return (f"in={self.in_features} (local {self.in_per_rank}), out={self.out_features}, tp={self.tp_size}, "
                f"bias={self.bias is not None}, sequence_parallel={self.sequence_parallel}"
                + (f", fp8={self.fp8.recipe.name}" if self.fp8 is not None else ""))


class ReplicatedLinear(nn.Module):
    """y = x W^T + b with W [out, in] whole on every TP rank (latent attention's down projections, a shared
    expert's gate): applied to the tokens this rank holds, no collective. Its weights' gradients are whole without
    sequence parallelism (every rank sees the same tokens and output gradient) and partial under it (marked
    `sequence_parallel`: summed over TP by finish_tp_grads, like a norm's). LoRA (a replicated adapter) and FP8
    (scales agreeing over the tokens' ranks) attach as to the other parallel layers."""
    fp8_kind = "replicated"  # FP8 scales: nothing split over tp but the tokens under SP (tpzoo.parallel.fp8)

    def __init__(self, in_features: int, out_features: int, bias: bool = False, sequence_parallel: bool = False,
                 init_method: InitMethod | None = None, dtype: torch.dtype | None = None, device=None,
                 dims: ParallelDims | None = None):
        super().__init__()
        self.dims = get_dims(dims)
        self.in_features, self.out_features, self.sequence_parallel = in_features, out_features, sequence_parallel
        self.init_method = init_method or normal_init()
        kw = {"dtype": dtype, "device": device if device is not None else self.dims.device}
        self.weight = mark_parallel(nn.Parameter(torch.empty(out_features, in_features, **kw)), None,
                                    sequence_parallel)
        self.bias = (mark_parallel(nn.Parameter(torch.empty(out_features, **kw)), None, sequence_parallel)
                     if bias else None)
        self.reset_parameters()
        self.lora = None  # a tpzoo.parallel.lora.LoRA when adapters are attached
        self.fp8 = None   # a tpzoo.parallel.fp8.Fp8Linear when the matmul runs in FP8

    def reset_parameters(self) -> None:
        _init_shard(self.weight, (self.out_features, self.in_features), ShardSpec(None), self.init_method, 0, 1)
        if self.bias is not None and self.bias.device.type != "meta":
            nn.init.zeros_(self.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = _fp8.linear(x, self.weight, self.bias, self.fp8)
        return self.lora.replicated_forward(x, y) if self.lora is not None else y

    def extra_repr(self) -> str:
        return (f"in={self.in_features}, out={self.out_features}, bias={self.bias is not None}, replicated, "
                f"sequence_parallel={self.sequence_parallel}" + (f", fp8={self.fp8.recipe.name}" if self.fp8 else ""))


def padded_vocab_size(vocab_size: int, tp: int, multiple: int = 1) -> int:
    """Vocab rounded up to a multiple of tp * multiple, so every rank holds an equal contiguous range."""
    step = tp * multiple
    return int(math.ceil(vocab_size / step) * step)


class VocabParallelEmbedding(nn.Module):
    """Embedding table split by vocabulary: rank r holds ids [r*V'/tp, (r+1)*V'/tp) of the padded vocab V'.

    Padding: V' = vocab rounded up to a multiple of tp * `padding_multiple`. Padded rows start at zero; no
    valid id looks them up, so they receive no gradient. A tied output head shares these rows; its logits for
    padded ids are masked by `vocab_parallel_cross_entropy(vocab_size=...)` and sliced off before sampling.
    """

    def __init__(self, num_embeddings: int, embedding_dim: int, padding_multiple: int = 1,
                 sequence_parallel: bool = False, init_method: InitMethod | None = None, sequence_dim: int = -2,
                 dtype: torch.dtype | None = None, device=None, dims: ParallelDims | None = None):
        super().__init__()
        self.dims = get_dims(dims)
        self.tp_size, self.tp_rank = self.dims.tp, self.dims.tp_rank
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim
        self.num_embeddings_padded = padded_vocab_size(num_embeddings, self.tp_size, padding_multiple)
        self.per_rank = self.num_embeddings_padded // self.tp_size
        self.vocab_start = self.tp_rank * self.per_rank
        self.vocab_end = self.vocab_start + self.per_rank
        self.sequence_parallel, self.sequence_dim = sequence_parallel, sequence_dim
        self.init_method = init_method or normal_init()
        self.weight = mark_parallel(nn.Parameter(torch.empty(
            self.per_rank, embedding_dim, dtype=dtype, device=device if device is not None else self.dims.device)), 0)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        def init_real_rows(master: torch.Tensor) -> None:
            self.init_method(master[: self.num_embeddings])
            master[self.num_embeddings:].zero_()

        _init_shard(self.weight, (self.num_embeddings_padded, self.embedding_dim), ShardSpec(0), init_real_rows,
                    self.tp_rank, self.tp_size)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:
            out = F.embedding(ids, self.weight)
        else:
            outside = (ids < self.vocab_start) | (ids >= self.vocab_end)
            local_ids = (ids - self.vocab_start).masked_fill(outside, 0)
            out = F.embedding(local_ids, self.weight).masked_fill(outside.unsqueeze(-1), 0.0)
        if self.sequence_parallel:
            return reduce_scatter_to_sequence(out, self.sequence_dim, self.dims.tp_group)
        return reduce_from_tp(out, self.dims.tp_group)

    def extra_repr(self) -> str:
        return (f"{self.num_embeddings} (padded {self.num_embeddings_padded}, local {self.per_rank}), "
                f"{self.embedding_dim}, tp={self.tp_size}, sequence_parallel={self.sequence_parallel}")
