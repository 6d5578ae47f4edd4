"""Plain torch references of every kernel: the definition of what each computes, the path taken off-GPU, and
the oracle the Triton kernels are tested against (with autograd of these very expressions)."""
from __future__ import annotations

import torch
import torch.nn.functional as F


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x / sqrt(mean(x^2) + eps) * weight, statistics in fp32, result in x's dtype."""
    xf = x.float()
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * y.to(x.dtype)


def layer_norm(x: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None, eps: float) -> torch.Tensor:
    return F.layer_norm(x, (x.shape[-1],), weight, bias, eps)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate `x` [b, s, heads, head_dim] by position (half-split "rotate_half" convention, as in HF Llama).

    cos, sin: [s, head_dim // 2] or [b, s, head_dim // 2] (fp32), for the positions of x's tokens.
    """
    half = x.shape[-1] // 2
    c, s = cos.unsqueeze(-2), sin.unsqueeze(-2)  # broadcast over heads
    x1, x2 = x[..., :half].float(), x[..., half:].float()
    return torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], dim=-1).to(x.dtype)


def swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return F.silu(gate) * up


def geglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """gelu_tanh(gate) * up (Gemma's GeGLU, HF "gelu_pytorch_tanh")."""
    return F.gelu(gate, approximate="tanh") * up


def bias_gelu(x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """gelu(x + bias), tanh approximation (GPT-2's "gelu_new")."""
    return F.gelu(x + bias if bias is not None else x, approximate="tanh")


def cross_entropy(logits_shard: torch.Tensor, target: torch.Tensor, ignore_index: int = -100,
                  label_smoothing: float = 0.0, vocab_size: int | None = None, group=None,
                  z_loss: float = 0.0) -> torch.Tensor:
    """Per-token loss over tensor-parallel vocab shards (see tpzoo.parallel.vocab_parallel_cross_entropy)."""
    from tpzoo.parallel import vocab_parallel_cross_entropy

    return vocab_parallel_cross_entropy(logits_shard, target, ignore_index, label_smoothing, vocab_size, group,
                                        z_loss)


# -- FP8 casts (tpzoo.kernels.float8; the operands of tpzoo.parallel.fp8's GEMMs) --------------------------------

FP8_EPS = 1e-12  # the amax floor: an all-zero tensor (padding rows) quantizes to zeros with a finite scale


def fp8_scale(amax: torch.Tensor, dtype: torch.dtype, pow2: bool = False) -> torch.Tensor:
    """fp8_max / max(amax, EPS) in fp32 (one correctly rounded division); pow2: rounded down to a power of two by
    clearing the mantissa bits (exact, where exp2(floor(log2(s))) can round up just below a power of two)."""
    s = torch.full_like(amax, torch.finfo(dtype).max, dtype=torch.float32) / amax.float().clamp(min=FP8_EPS)
    return (s.view(torch.int32) & 0x7F800000).view(torch.float32) if pow2 else s


def fp8_cast(x: torch.Tensor, amax: torch.Tensor, dtype: torch.dtype, mode: str, pow2: bool, want_q: bool = True,
             want_t: bool = False, pad: int = 1) -> tuple:
    """x [M, N] cast to `dtype` with the scale of `amax` ([] for mode "tensor", [M, 1] "rows", [1, N] "cols"):
    (q = cast(clamp(x * s)) [M, N] or None, qt = q transposed into [N, M rounded up to `pad`] with zero padding,
    or None, 1/s shaped like amax). The product in fp32 (fp64 for fp64 x), saturated at the format's largest
    finite value (e4m3fn has no infinity)."""
    s = fp8_scale(amax, dtype, pow2)
    top = torch.finfo(dtype).max
    wide = torch.float64 if x.dtype == torch.float64 else torch.float32
    q = (x.to(wide) * s).clamp(-top, top).to(dtype)
    qt = None
    if want_t:
        m = x.shape[0]
        qt = torch.zeros((x.shape[1], -(-m // pad) * pad), dtype=dtype, device=x.device)
        qt[:, :m] = q.t()
    return (q if want_q else None), qt, s.reciprocal()


def fp8_cast_rows(x: torch.Tensor, dtype: torch.dtype, pow2: bool) -> tuple:
    """(q, 1/s [M, 1]) with one scale per row of x [M, N] from the row's own amax."""
    amax = torch.linalg.vector_norm(x, float("inf"), dim=1, keepdim=True)
    q, _, inv = fp8_cast(x, amax, dtype, "rows", pow2)
    return q, inv
