"""The local experts of a mixture-of-experts layer over rows grouped by expert: one grouped GEMM per projection
(`torch._grouped_mm`, CUDA bf16, Hopper+), or a loop of two matmuls per expert (the fallback: CPU, fp32/fp16,
older GPUs).

    expert_mlp(rows, counts, gate_up [E, 2f, h], down [E, h, f], activation, gemm,
               gate_up_bias [E, 2f] = None, down_bias [E, h] = None) -> [rows, h]

rows [T, h] are grouped by local expert (counts[e] consecutive rows for expert e, an expert may have none).
The grouped path never reads the counts on the host: their cumulative sums are the GEMM's group offsets (int32, on
the device), so at ep = 1 the layer runs with no host synchronization. The loop needs the counts as host ints
(`.tolist()`: one sync when they live on the device).

The grouped GEMM is one autograd function over an op with _grouped_mm's signature, op(a, b, offs):
    a [T, K] (2-d), b [G, K, N] (3-d)  -> [T, N]: rows offs[g-1]:offs[g] of a times b[g]
    a [K, T] (2-d), b [T, N] (2-d)     -> [G, K, N]: a[:, offs[g-1]:offs[g]] times b[offs[g-1]:offs[g]]
(the forward, the input gradient, and the weight gradient, each group's own).

Expert biases (gpt-oss) are added per row from its expert's bias (a gather by the rows' expert ids, built on the
device from the counts: no host read on the grouped path). Under expert tensor parallelism gate_up_bias is split
with gate_up (the same fused gate|up parts), while down_bias belongs after the tp reduction: pass it on one tp
rank only (the others None), whose gradient is then the whole one (sum the bias gradient over tp, as for a
replicated parameter under SP). `activation` is "swiglu", "geglu_tanh" or a function (gate, up) -> h, such as
gpt-oss's `clamped_swiglu`. On CUDA the op is torch._grouped_mm;
elsewhere `grouped_mm_reference`, a plain implementation of the same function (masks, no host reads), so CPU tests
run the grouped path's exact code against the loop.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from tpzoo import kernels

GEMMS = ("auto", "grouped", "loop")


def clamped_swiglu(gate: torch.Tensor, up: torch.Tensor, alpha: float = 1.702, limit: float = 7.0) -> torch.Tensor:
    """gpt-oss's gated unit: the gate clamped from above, up clamped both ways, gate * sigmoid(alpha * gate) times
    (up + 1) (transformers' GptOssExperts._apply_gate on de-interleaved halves)."""
    gate = gate.clamp(max=limit)
    up = up.clamp(min=-limit, max=limit)
    return (up + 1) * (gate * torch.sigmoid(gate * alpha))


def grouped_mm_reference(a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """torch._grouped_mm(a, b, offs) for the two layouts above, in plain torch: each group through a row mask (its
    rows kept, the others zeroed), so no offset is read on the host and an empty group is a zero product."""
    if offs.dtype != torch.int32 or offs.dim() != 1:
        raise ValueError(f"grouped mm: offs must be a 1-d int32 tensor of cumulative group ends, got {offs.dtype} "
                         f"{tuple(offs.shape)}")
    t = a.shape[0] if b.dim() == 3 else a.shape[1]
    index = torch.arange(t, device=a.device)
    starts = torch.cat([offs.new_zeros(1), offs[:-1]])
    member = (index[None, :] >= starts[:, None]) & (index[None, :] < offs[:, None])  # [G, T]
    if b.dim() == 3:  # [T, K] x [G, K, N]: each row through its group's matrix
        return torch.einsum("gt,tk,gkn->tn", member.to(a.dtype), a, b)
    return torch.einsum("gt,kt,tn->gkn", member.to(a.dtype), a, b)


def grouped_mm_op(device: torch.device):
    return torch._grouped_mm if device.type == "cuda" else grouped_mm_reference


class GroupedLinear(torch.autograd.Function):
    """y[rows of group g] = x[rows of g] @ w[g]^T for x [T, K] grouped by offs, w [G, N, K] (nn.Linear's layout)."""

    @staticmethod
    def forward(ctx, x, w, offs):
        op = grouped_mm_op(x.device)
        # x only for the weight's gradient: a frozen expert weight (LoRA) keeps no rows, as F.linear's would not
        ctx.save_for_backward(x if ctx.needs_input_grad[1] else None, w, offs)
        return op(x, w.transpose(-2, -1), offs)

    @staticmethod
    def backward(ctx, dy):
        x, w, offs = ctx.saved_tensors
        op = grouped_mm_op(dy.device)
        dy = dy.contiguous()
        dx = op(dy, w, offs) if ctx.needs_input_grad[0] else None  # [T, N] x [G, N, K]
        dw = None
        if ctx.needs_input_grad[1]:
            dw = op(dy.t(), x, offs)  # [N, T] x [T, K] grouped along T -> [G, N, K]
            # An expert without rows gets an exact zero gradient, whatever the kernel leaves in an empty group.
            sizes = torch.diff(offs, prepend=offs.new_zeros(1))
            dw = torch.where((sizes > 0)[:, None, None], dw, torch.zeros((), dtype=dw.dtype, device=dw.device))
        return dx, dw, None


def use_grouped(gemm: str, rows: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor,
                lora_rank: int | None = None) -> bool:
    """Whether the experts run as grouped GEMMs: "grouped" forces it (CUDA: bf16 only), "loop" never, "auto" on
    CUDA bf16 with compute capability 9.0+ (Hopper's grouped GEMM) and every GEMM dim a multiple of 8 (16 bytes),
    the experts' adapters' rank too (`lora_rank`: their inner dim)."""
    if gemm not in GEMMS:
        raise ValueError(f"expert gemm {gemm!r}: choose one of {GEMMS}")
    dims = (*gate_up.shape[1:], *down.shape[1:], *((lora_rank,) if lora_rank else ()))
    cuda_ok = (rows.device.type == "cuda" and rows.dtype == torch.bfloat16 and hasattr(torch, "_grouped_mm")
               and all(n % 8 == 0 for n in dims))
    if gemm == "grouped":
        if rows.device.type == "cuda" and not cuda_ok:
            raise ValueError(f"grouped expert GEMMs on CUDA need bf16 rows and GEMM dims that are multiples of 8 "
                             f"(torch._grouped_mm); got {rows.dtype}, gate_up {tuple(gate_up.shape)}"
                             + (f", LoRA rank {lora_rank}" if lora_rank else ""))
        return True
    return gemm == "auto" and cuda_ok and torch.cuda.get_device_capability(rows.device) >= (9, 0)


def expert_mlp(rows: torch.Tensor, counts, gate_up: torch.Tensor, down: torch.Tensor, activation,
               gemm: str = "auto", gate_up_bias: torch.Tensor | None = None,
               down_bias: torch.Tensor | None = None, lora=None) -> torch.Tensor:
    """The local experts over their contiguous row groups; counts: rows per expert (a device tensor or host
    ints). Every expert runs, an empty one on zero rows, so each expert weight gets a (possibly zero) gradient.
    `lora`: the experts' adapters (expert_lora.ExpertLoRA), added to each weight's output with the same groups."""
    act = _activation(activation)
    if use_grouped(gemm, rows, gate_up, down, lora.rank if lora is not None else None):
        counts = torch.as_tensor(counts, device=rows.device)  # host ints: one copy to the device, no sync
        offs = torch.cumsum(counts, 0, dtype=torch.int32)
        expert_of = None
        if gate_up_bias is not None or down_bias is not None:  # each row's expert, on the device (no sync)
            expert_of = torch.repeat_interleave(torch.arange(counts.numel(), device=rows.device), counts,
                                                output_size=rows.shape[0])
        h = GroupedLinear.apply(rows, gate_up, offs)
        if lora is not None:
            h = h + lora.grouped("gate_up", rows, offs)
        if gate_up_bias is not None:
            h = h + gate_up_bias.index_select(0, expert_of)
        a = act(*h.chunk(2, dim=-1))
        out = GroupedLinear.apply(a, down, offs)
        if lora is not None:
            out = out + lora.grouped("down", a, offs)
        return out + down_bias.index_select(0, expert_of) if down_bias is not None else out
    counts = counts.tolist() if isinstance(counts, torch.Tensor) else counts  # the loop's host sync
    outs, start = [], 0
    # unbind: one backward that stacks the experts' gradients (indexing each expert would zero-fill a whole-tensor
    # gradient per expert)
    gate_ups, downs = gate_up.unbind(0), down.unbind(0)
    gate_up_biases = gate_up_bias.unbind(0) if gate_up_bias is not None else [None] * len(gate_ups)
    down_biases = down_bias.unbind(0) if down_bias is not None else [None] * len(downs)
    adapter = lora.per_expert() if lora is not None else None
    for e, n in enumerate(counts):
        x = rows[start:start + n]
        h = F.linear(x, gate_ups[e], gate_up_biases[e])
        a = act(*(h if adapter is None else adapter.add("gate_up", h, x, e)).chunk(2, dim=-1))
        out = F.linear(a, downs[e], down_biases[e])
        outs.append(out if adapter is None else adapter.add("down", out, a, e))
        start += n
    return torch.cat(outs, dim=0)


def _activation(activation):
    if callable(activation):
        return activation
    if activation == "swiglu":
        return kernels.swiglu
    if activation == "geglu_tanh":
        return kernels.geglu
    raise ValueError(f"expert activation {activation!r}: choose swiglu, geglu_tanh or a function (gate, up) -> h")
