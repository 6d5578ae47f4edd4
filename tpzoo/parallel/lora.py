"""Low-rank adapters (LoRA, Hu et al. 2021) on the tensor-parallel linear layers.

y = x W^T + b + (alpha / r) * dropout(x) A^T B^T, with W frozen, A [r, in] drawn like PEFT (Kaiming-uniform,
bound 1/sqrt(in)) and B [out, r] starting at zero, so a fresh adapter leaves the model unchanged.

A fused layer (q|k|v, gate|up) gets one adapter per Hugging Face projection, named by it ("q_proj", ...): part j
has its own A_j and a B_j sharded exactly as part j of the fused weight (kv heads replicated over TP included). A
projection covering several consecutive parts (`groups`: Qwen3.5's in_proj_qkv over a Gated DeltaNet's q|k|v)
has one adapter whose B is sharded as those parts together.

Column-parallel layer, weight split by rows [out/tp, in]:
    A_j replicated [r, in], B_j split with its part [out_j/tp, r]. u = x A^T is computed on every rank from the
    layer's own input (under SP the same gather feeds W and A: one all-gather, only the shard saved); each rank
    adds u_j B_j^T to its slice of the output. Backward: dB_j is complete on each rank; the gradient reaching u
    is partial (each rank's B_j covers its slice), so dA is partial and summed over TP by finish_tp_grads (A is
    marked like a norm weight under SP), and dx = du A joins the layer's input gradient before the entry
    collective that already sums it. Extra collectives per micro-batch: none.
Row-parallel layer, weight split by columns [out, in/tp]:
    A split with the input [r, in/tp], B replicated [out, r]. Each rank computes its partial u_r = x_r A_r^T and
    adds u_r B^T to its partial output *before* the layer's all-reduce (or reduce-scatter): the sum over ranks
    is (sum_r u_r) B^T, the adapter's exact output, carried by the collective the layer already does. Backward:
    du = dy B is the same on every rank, so dA_r is complete; dB = dy^T u_r is partial and summed over TP by
    finish_tp_grads. Extra collectives per micro-batch: none (the cost is an [tokens, out] matmul of rank r
    done on every rank instead of once).
Replicated layer (tpzoo.parallel.ReplicatedLinear: latent attention's down projections), weight whole [out, in]:
    A [r, in] and B [out, r] whole on every rank, applied to the tokens the rank holds. Without SP every rank
    computes the same adapter on the same tokens: both gradients whole. Under SP each rank holds its sequence
    shard: both gradients partial, marked like the weight and summed over TP by finish_tp_grads. Extra
    collectives per micro-batch: none.
Per step, the partial gradients (A of column layers, B of row layers) join the one flat all-reduce that
finish_tp_grads already issues for the norm weights under SP (one more call when nothing else needed it).

Dropout (PEFT's lora_dropout, on the adapter's input): with dropout the column path gathers x for A through
autograd, which keeps the gathered dropped-out input (full sequence); use dropout 0 (PEFT's default) for the
sequence-parallel memory. TP ranks draw the same mask for the same (replicated) input from their common seed.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from .layers import ColumnParallelLinear, ReplicatedLinear, RowParallelLinear, _init_shard, mark_parallel
from .sharding import ShardSpec


def _kaiming_uniform(t: torch.Tensor) -> None:
    """PEFT's (and nn.Linear's) A init: kaiming_uniform_(a=sqrt(5)) = U(-1/sqrt(fan_in), 1/sqrt(fan_in))."""
    nn.init.kaiming_uniform_(t, a=math.sqrt(5))


def _part_specs(layer_spec: ShardSpec, out_features: int, n_adapters: int,
                groups: list | None = None) -> list[tuple[int, ShardSpec]]:
    """(full rows, ShardSpec) of each adapter's B: one per part of the fused weight (or per group of consecutive
    parts, `groups` giving how many each), or one for all of it."""
    parts = layer_spec.parts or (out_features,)
    if n_adapters == 1:
        return [(out_features, layer_spec)]
    groups = list(groups) if groups is not None else [1] * len(parts)
    if n_adapters != len(groups) or sum(groups) != len(parts):
        raise ValueError(f"{n_adapters} adapters for a weight fused from {len(parts)} parts (groups {groups})")
    reps = layer_spec.replicas or (1,) * len(parts)
    out, i = [], 0
    for n in groups:
        sizes, rs = parts[i:i + n], reps[i:i + n]
        i += n
        if n == 1 and rs[0] == 1:
            out.append((sizes[0], ShardSpec(0)))
        else:  # parts spelled out: each splits separately (and a replicated part's full size is not shard x tp)
            out.append((sum(sizes), ShardSpec(0, parts=tuple(sizes), replicas=None if set(rs) == {1} else tuple(rs),
                                              block=layer_spec.block)))
    return out


class LoRA(nn.Module):
    """The adapters of one parallel linear layer. `names`: one entry per part of the layer's (fused) weight, in
    order, the HF projection name of that part's adapter, or None for a part left without one (PEFT's default
    targets q_proj and v_proj only: k's rows of q|k|v get nothing); a single name for an unfused layer or a
    weight HF fuses too (GPT-2's c_attn)."""

    def __init__(self, layer: nn.Module, names: list, rank: int, alpha: float, dropout: float = 0.0,
                 dtype=None, device=None, groups: list | None = None):
        super().__init__()
        if rank <= 0 or alpha <= 0:
            raise ValueError(f"LoRA needs rank > 0 and alpha > 0 (got rank {rank}, alpha {alpha})")
        self.parts, self.rank, self.alpha, self.scale = list(names), rank, alpha, alpha / rank
        self.names = [n for n in self.parts if n is not None]
        self.dropout = dropout
        self.column = isinstance(layer, ColumnParallelLinear)
        self.replicated = isinstance(layer, ReplicatedLinear)
        if not (self.column or self.replicated or isinstance(layer, RowParallelLinear)):
            raise TypeError(f"LoRA attaches to Column/Row/ReplicatedLinear, not {type(layer)}")
        dims = layer.dims
        self.tp, self.tp_rank = dims.tp, dims.tp_rank
        # (a kept-quantized base weight says which dtype it computes in: tpzoo.quant.modules.QuantizedGemm)
        kw = {"dtype": dtype if dtype is not None else getattr(layer.fp8, "compute_dtype", layer.weight.dtype),
              "device": device if device is not None else layer.weight.device}
        self.A, self.B = nn.ParameterDict(), nn.ParameterDict()
        self.shapes: dict[str, tuple[tuple, ShardSpec, tuple, ShardSpec]] = {}  # full A, A spec, full B, B spec
        self.local_rows: list[int] = []
        if self.column:
            for name, (rows, spec) in zip(self.parts, _part_specs(layer.shard_spec, layer.out_features,
                                                                  len(self.parts), groups)):
                self.local_rows.append(spec.local_size(rows, self.tp))
                if name is None:
                    continue
                # A: replicated; its gradient is partial on each rank and summed over TP (finish_tp_grads).
                a = torch.empty(rank, layer.in_features, **kw)
                b = torch.empty(self.local_rows[-1], rank, **kw)
                self.A[name] = mark_parallel(nn.Parameter(a), None, sequence_parallel=True)
                self.B[name] = mark_parallel(nn.Parameter(b), spec)
                self.shapes[name] = ((rank, layer.in_features), ShardSpec(None), (rows, rank), spec)
        else:
            if len(self.parts) != 1 or self.parts[0] is None:
                raise ValueError(f"a row-parallel or replicated layer takes one adapter, got {self.parts}")
            name = self.parts[0]
        if self.replicated:
            sp = layer.sequence_parallel  # partial gradients exactly when the weight's are
            self.A[name] = mark_parallel(nn.Parameter(torch.empty(rank, layer.in_features, **kw)), None, sp)
            self.B[name] = mark_parallel(nn.Parameter(torch.empty(layer.out_features, rank, **kw)), None, sp)
            self.shapes[name] = ((rank, layer.in_features), ShardSpec(None), (layer.out_features, rank),
                                 ShardSpec(None))
        elif not self.column:
            a = torch.empty(rank, layer.in_per_rank, **kw)
            b = torch.empty(layer.out_features, rank, **kw)
            self.A[name] = mark_parallel(nn.Parameter(a), 1)
            self.B[name] = mark_parallel(nn.Parameter(b), None, sequence_parallel=True)  # partial: summed over TP
            self.shapes[name] = ((rank, layer.in_features), ShardSpec(1), (layer.out_features, rank), ShardSpec(None))

    def init_adapter(self) -> None:
        """A from the current RNG state (full tensor drawn, this rank's shard kept: layout independent), B = 0."""
        for name in self.names:
            full_a, spec_a, _, _ = self.shapes[name]
            _init_shard(self.A[name], full_a, spec_a, _kaiming_uniform, self.tp_rank, self.tp)
            if self.B[name].device.type != "meta":
                with torch.no_grad():
                    self.B[name].zero_()

    def _drop(self, x: torch.Tensor) -> torch.Tensor:
        return F.dropout(x, self.dropout, self.training) if self.dropout > 0 else x

    def _up(self, us: list) -> torch.Tensor:
        """u_j B_j^T of every part, laid out as the layer's local output (parts concatenated; zeros for a part
        without an adapter)."""
        if len(self.parts) == 1:
            return F.linear(us[0], self.B[self.names[0]])
        us = iter(us)
        out = [F.linear(next(us), self.B[name]) if name is not None else None for name in self.parts]
        lead = next(o for o in out if o is not None).shape[:-1]
        ref = self.B[self.names[0]]
        return torch.cat([o if o is not None else ref.new_zeros(lead + (rows,))
                          for o, rows in zip(out, self.local_rows)], dim=-1)

    def column_forward(self, layer: ColumnParallelLinear, x: torch.Tensor) -> torch.Tensor:
        # One matmul per part (no concatenated copy of the A's to keep), on the layer's own entry into TP.
        extra = tuple((self.A[n], None) for n in self.names)
        y, *us = layer.matmuls(x, extra, self._drop if self.dropout > 0 else None)
        return y + self.scale * self._up(us)

    def replicated_forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """A replicated layer's output plus the adapter's, on the same tokens."""
        (name,) = self.names
        return y + self.scale * F.linear(F.linear(self._drop(x), self.A[name]), self.B[name])

    def row_partial(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """The row layer's partial output plus this rank's share of the adapter, before the reduction."""
        (name,) = self.names
        return y + self.scale * F.linear(F.linear(self._drop(x), self.A[name]), self.B[name])

    def extra_repr(self) -> str:
        return f"{', '.join(self.names)}: rank={self.rank}, alpha={self.alpha:g}, dropout={self.dropout:g}"


def is_lora_param(name: str) -> bool:
    """A parameter name of an adapter (`....lora.A.q_proj`)."""
    return ".lora.A." in name or ".lora.B." in name
