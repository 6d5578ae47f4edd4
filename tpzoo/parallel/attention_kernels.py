"""Fused attention kernels for ring attention's blocks: PyTorch's private SDPA ops that return the log-sum-exp.

Ring attention (ring_attention.py) computes one block of keys at a time and merges the partial outputs with their
log-sum-exp; its backward hands each block's kernel the *merged* output and log-sum-exp, so that the kernel's
P = exp(S - lse) is the block's share of the global softmax (flash attention's backward recomputes P from exactly
these). Each kernel here is that pair of ops behind one interface:

    forward(q, k, v, scale, causal)                       -> (out [b, h, sq, d], lse [b, h, sq], state)
    backward(d_out, q, k, v, out, lse, scale, causal, state) -> (dq, dk, dv)

q [b, h, sq, d], k/v [b, h, sk, d] (grouped-query heads already expanded by the caller), out and d_out in q's
dtype, `causal` the diagonal block (sq == sk, causal by index); `state` is what the forward returned beyond
(out, lse) that the backward op takes (the random-number state of its dropout, unused at p = 0, passed back
as produced, and the efficient kernel's padded log-sum-exp width).

The log-sum-exp is normalized to [b, h, sq] (fp32 from the CUDA kernels): flash returns exactly that; the
memory-efficient kernel pads the row dim to a multiple of 32 (on CUDA), so its rows are trimmed here and the merged
one padded back to the forward's width for its backward.

Signatures (torch >= 2.5; checked against native_functions.yaml / _meta_registrations.py of 2.13):
    _scaled_dot_product_flash_attention(q, k, v, dropout_p, is_causal, return_debug_mask, *, scale)
        -> (out, logsumexp, cum_seq_q, cum_seq_k, max_q, max_k, rng_state, unused, debug_attn_mask)
    _scaled_dot_product_flash_attention_backward(grad_out, q, k, v, out, logsumexp, cum_seq_q, cum_seq_k,
        max_q, max_k, dropout_p, is_causal, philox_seed, philox_offset, *, scale) -> (dq, dk, dv)
    _scaled_dot_product_efficient_attention(q, k, v, attn_bias, compute_log_sumexp, dropout_p, is_causal, *,
        scale) -> (out, log_sumexp, philox_seed, philox_offset)
    _scaled_dot_product_efficient_attention_backward(grad_out, q, k, v, attn_bias, out, logsumexp, philox_seed,
        philox_offset, dropout_p, grad_input_mask, is_causal, *, scale) -> (dq, dk, dv, d_bias)
    _scaled_dot_product_flash_attention_for_cpu(q, k, v, dropout_p, is_causal, *, attn_mask, scale) -> (out, lse)
    _scaled_dot_product_flash_attention_for_cpu_backward(grad_out, q, k, v, out, lse, dropout_p, is_causal, *,
        attn_mask, scale) -> (dq, dk, dv)
cuDNN's attention (also log-sum-exp returning) is not used: its backward takes the bias and sequence metadata of
its own forward and is not faster than flash for these block shapes on every cuDNN version.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

# The ops by name (None where this torch has none). Looked up at each call, so that CPU tests can put emulations
# with the same signatures here and run the CUDA wrappers below.
OPS = {name: getattr(torch.ops.aten, name, None) for name in (
    "_scaled_dot_product_flash_attention", "_scaled_dot_product_flash_attention_backward",
    "_scaled_dot_product_efficient_attention", "_scaled_dot_product_efficient_attention_backward",
    "_scaled_dot_product_flash_attention_for_cpu", "_scaled_dot_product_flash_attention_for_cpu_backward")}


def _op(name: str):
    return OPS[name]


def _cpu_forward(q, k, v, scale, causal):
    out, lse = _op("_scaled_dot_product_flash_attention_for_cpu")(
        q.contiguous(), k.contiguous(), v.contiguous(), 0.0, causal, scale=scale)
    return out, lse, None


def _cpu_backward(d_out, q, k, v, out, lse, scale, causal, state):
    return _op("_scaled_dot_product_flash_attention_for_cpu_backward")(
        d_out.contiguous(), q.contiguous(), k.contiguous(), v.contiguous(), out.contiguous(), lse, 0.0, causal,
        scale=scale)


def _flash_forward(q, k, v, scale, causal):
    out, lse, cum_q, cum_k, max_q, max_k, seed, offset, _ = _op("_scaled_dot_product_flash_attention")(
        q, k, v, 0.0, causal, False, scale=scale)
    return out, lse, (cum_q, cum_k, max_q, max_k, seed, offset)


def _flash_backward(d_out, q, k, v, out, lse, scale, causal, state):
    cum_q, cum_k, max_q, max_k, seed, offset = state
    return _op("_scaled_dot_product_flash_attention_backward")(
        d_out, q, k, v, out, lse, cum_q, cum_k, max_q, max_k, 0.0, causal, seed, offset, scale=scale)


def _efficient_forward(q, k, v, scale, causal):
    out, lse, seed, offset = _op("_scaled_dot_product_efficient_attention")(
        q, k, v, None, True, 0.0, causal, scale=scale)
    return out, trim_lse(lse, q.shape[2]), (seed, offset, lse.shape[-1])


def _efficient_backward(d_out, q, k, v, out, lse, scale, causal, state):
    seed, offset, width = state
    dq, dk, dv, _ = _op("_scaled_dot_product_efficient_attention_backward")(
        d_out, q, k, v, None, out, pad_lse(lse, width), seed, offset, 0.0, [True, True, True, False], causal,
        scale=scale)
    return dq, dk, dv


def trim_lse(lse: torch.Tensor, rows: int) -> torch.Tensor:
    """A kernel's log-sum-exp as [b, h, rows] (the memory-efficient kernel pads rows to a multiple of 32)."""
    return lse[..., :rows]


def pad_lse(lse: torch.Tensor, width: int) -> torch.Tensor:
    """The [b, h, rows] log-sum-exp laid out as a kernel's backward reads it: `width` rows, contiguous."""
    rows = lse.shape[-1]
    if width == rows:
        return lse.contiguous()
    out = torch.zeros(*lse.shape[:-1], width, dtype=lse.dtype, device=lse.device)
    out[..., :rows] = lse
    return out


@dataclass(frozen=True)
class FusedKernel:
    forward: Callable
    backward: Callable


FUSED = {
    "cpu_flash": FusedKernel(_cpu_forward, _cpu_backward),
    "cuda_flash": FusedKernel(_flash_forward, _flash_backward),
    "cuda_efficient": FusedKernel(_efficient_forward, _efficient_backward),
}


def pick_kernel(device_type: str, dtype: torch.dtype, head_dim: int, capability: tuple[int, int] | None,
                available: set[str]) -> str:
    """The block kernel for these inputs (a pure function of them, so its rules are tested on any machine):
    CUDA flash for fp16/bf16 on sm80+ with head dim a multiple of 8 up to 256, else CUDA memory-efficient
    attention (any float dtype, head dim a multiple of 8), the CPU flash kernel on CPU, else "torch" (the math).
    Calling the ops directly skips SDPA's own checks, so theirs that apply are repeated here: flash's backward
    does not run head dims in (192, 224] on sm86-sm89 and sm120-sm121 (RTX 30xx/40xx/50xx, A40, L40S: torch's
    sdp_utils, check_requires_grad_and_head_dim_gt192_constraints)."""
    if device_type == "cpu":
        return "cpu_flash" if "cpu_flash" in available else "torch"
    if device_type != "cuda" or head_dim % 8:
        return "torch"
    consumer = capability is not None and ((8, 6) <= capability <= (8, 9) or (12, 0) <= capability <= (12, 1))
    flash_bwd_gap = consumer and 192 < head_dim <= 224
    if ("cuda_flash" in available and dtype in (torch.float16, torch.bfloat16) and head_dim <= 256
            and capability is not None and capability >= (8, 0) and not flash_bwd_gap):
        return "cuda_flash"
    if "cuda_efficient" in available and dtype in (torch.float16, torch.bfloat16, torch.float32):
        return "cuda_efficient"
    return "torch"


def available_kernels(device: torch.device) -> set[str]:
    """The fused kernels this torch build offers on `device` (ops present, and on CUDA the backend enabled)."""
    have = set()
    if OPS["_scaled_dot_product_flash_attention_for_cpu_backward"] is not None:
        have.add("cpu_flash")
    if device.type == "cuda":
        backends = torch.backends.cuda
        if (getattr(backends, "is_flash_attention_available", lambda: True)() and backends.flash_sdp_enabled()
                and OPS["_scaled_dot_product_flash_attention_backward"] is not None):
            have.add("cuda_flash")
        if backends.mem_efficient_sdp_enabled() and OPS["_scaled_dot_product_efficient_attention_backward"] is not None:
            have.add("cuda_efficient")
    return have


def choose_kernel(q: torch.Tensor, fused: bool | str | None) -> str:
    """The kernel for a call: fused False -> "torch"; a kernel name -> that kernel; None -> pick_kernel."""
    if fused is False:
        return "torch"
    if isinstance(fused, str):
        if fused != "torch" and fused not in FUSED:
            raise ValueError(f"ring attention: unknown block kernel {fused!r}; choose one of "
                             f"{sorted(FUSED) + ['torch']}")
        return fused
    capability = torch.cuda.get_device_capability(q.device) if q.device.type == "cuda" else None
    return pick_kernel(q.device.type, q.dtype, q.shape[-1], capability, available_kernels(q.device))
