"""The operations of an FP8 GEMM (tpzoo.parallel.fp8): amax, the fused casts, and the scaled matmul.

Per operand, on CUDA: one amax reduction (the inf-norm kernel), the all-reduce that makes it agree across ranks
where the recipe needs it (fp8.py), and one cast kernel (tpzoo.kernels.float8) that computes the scale on the
device, writes the fp8 values in the layouts the GEMMs take and the dequantization scale; where the scaled dim is
not split across ranks the amax is taken inside the cast kernel too (`cast_rows`). Then one torch._scaled_mm. No
scale arithmetic on the host, no host sync, no transposes or padding copies: the casts write what the GEMM wants.

CUDA: torch._scaled_mm (torch 2.11 and 2.13 share its signature: mat1 row-major [M, K], mat2 column-major [K, N],
K and N multiples of 16, fp32 scales: 0-dim for tensorwise, [M, 1] and [1, N] for row-wise; row-wise output bf16,
or fp32 where cuBLAS >= 12.9 on sm90 has it). The weight-gradient GEMM contracts over the tokens: its operands are
cast transposed with the token dim zero-padded to 16 (`pad`), exact. Elsewhere the GEMM is emulated: the same fp8
values multiplied in fp64 (each product of two fp8 values is exact there, and so are the sums unless their terms
span more than 53 bits) and scaled once, then rounded to the output dtype: a result that does not depend on the
operands' layout or padding, so CPU tests compare exactly. On the CPU the torch reference of each cast and the
emulated GEMM count as one launch each (tpzoo.kernels.launch.count_launches), as the kernels they stand for.
"""
from __future__ import annotations

import torch

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
EPS = 1e-12       # amax floor (tpzoo.kernels.reference.FP8_EPS): an all-zero tensor quantizes to zeros
ALIGN = 16        # torch._scaled_mm: K and N multiples of 16

_K = None


def _kernels():
    """tpzoo.kernels, imported on first use (it imports tpzoo.parallel: no import at module load)."""
    global _K
    if _K is None:
        from tpzoo import kernels

        _K = kernels
    return _K


def amax(t: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """max |t| in t's dtype (exact in any): over everything (0-dim), or over `dim` (kept, size 1). One reduction
    kernel (the inf-norm), no |t| temporary; the cast kernels read it as fp32."""
    return torch.linalg.vector_norm(t, float("inf"), dim=dim, keepdim=dim is not None)


def scale_of(amax_: torch.Tensor, dtype: torch.dtype, pow2: bool = False) -> torch.Tensor:
    """The quantization scale fp8_max / amax (fp32), rounded down to a power of two if `pow2` (what the cast
    kernels compute on the device; tpzoo.kernels.reference.fp8_scale)."""
    return _kernels().reference.fp8_scale(amax_, dtype, pow2)


def cast(t: torch.Tensor, amax_: torch.Tensor, dtype: torch.dtype, mode: str, pow2: bool, want_q: bool = True,
         want_t: bool = False) -> tuple:
    """(q [M, N] | None, q transposed [N, M padded] | None, 1/s shaped like amax_) for t [M, N]; mode "tensor"
    (amax_ 0-dim), "rows" ([M, 1]) or "cols" ([1, N]). The transposed copy's token dim is padded to ALIGN on CUDA
    (the weight-gradient GEMM's contraction)."""
    return _kernels().fp8_cast(t, amax_, dtype, mode, pow2, want_q, want_t, ALIGN if t.is_cuda else 1)


def cast_rows(t: torch.Tensor, dtype: torch.dtype, pow2: bool) -> tuple:
    """(q, 1/s [M, 1]) with one scale per row from the row's own amax: amax and cast in one launch."""
    return _kernels().fp8_cast_rows(t, dtype, pow2)


def scaled_mm(a: torch.Tensor, b: torch.Tensor, inv_a: torch.Tensor, inv_b: torch.Tensor, out_dtype: torch.dtype,
              fast_accum: bool = False) -> torch.Tensor:
    """(a @ b) * inv_a * inv_b in `out_dtype` for fp8 a [M, K] (row-major), b [K, N] (column-major, a transposed
    view of a cast's row-major output); inv_a / inv_b: the dequantization scales 1/s, 0-dim (tensorwise) or
    [M, 1] / [1, N] (row-wise). torch._scaled_mm on CUDA, else emulated (the module docstring)."""
    if a.is_cuda and out_dtype != torch.float64:
        return _cuda_scaled_mm(a, b, inv_a, inv_b, out_dtype, fast_accum)
    with _kernels().launch.as_one_launch("tpzoo::scaled_mm"):
        acc = a.to(torch.float64) @ b.to(torch.float64)
        return acc.mul_(inv_a.double() * inv_b.double()).to(out_dtype)


_ROWWISE_FP32_OUT: dict = {}  # device index -> whether row-wise _scaled_mm gives fp32 output there


def _cuda_scaled_mm(a, b, inv_a, inv_b, out_dtype, fast_accum):
    if inv_a.dim() == 2 and out_dtype == torch.float32:  # row-wise with fp32 output: not on every cuBLAS
        key = a.device.index
        if _ROWWISE_FP32_OUT.get(key, True):
            try:
                out = torch._scaled_mm(a, b, inv_a, inv_b, out_dtype=out_dtype, use_fast_accum=fast_accum)
                _ROWWISE_FP32_OUT[key] = True
                return out
            except (RuntimeError, ValueError):  # "Only bf16 high precision output types ... for row-wise scaling"
                _ROWWISE_FP32_OUT[key] = False
        return torch._scaled_mm(a, b, inv_a, inv_b, out_dtype=torch.bfloat16, use_fast_accum=fast_accum).float()
    return torch._scaled_mm(a, b, inv_a, inv_b, out_dtype=out_dtype, use_fast_accum=fast_accum)
