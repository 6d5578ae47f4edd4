"""Rotary position embedding in Triton (half-split "rotate_half" convention), forward and backward.

y1 = x1 cos - x2 sin, y2 = x2 cos + x1 sin, with x1, x2 the two halves of head_dim. The backward is the same
rotation by the opposite angle, so one kernel does both. One program per token (b, s) loads that token's
cos/sin row once and rotates every head. Any strides are accepted (q and k are usually views into a fused qkv
projection), so no copies are made; cos/sin broadcast over the batch through a zero stride.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import launch


@triton.jit
def _rotary(X, COS, SIN, Y, S, H, HALF, sxb, sxs, sxh, sxd, syb, sys, syh, syd, scb, scs, scd, ssb, sss, ssd,
            INVERSE: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr):
    token = tl.program_id(0).to(tl.int64)
    b = token // S
    s = token % S
    d = tl.arange(0, BLOCK_D)
    d_mask = d < HALF
    c = tl.load(COS + b * scb + s * scs + d * scd, mask=d_mask, other=0.0).to(tl.float32)
    sn = tl.load(SIN + b * ssb + s * sss + d * ssd, mask=d_mask, other=0.0).to(tl.float32)
    if INVERSE:
        sn = -sn
    x_tok = X + b * sxb + s * sxs
    y_tok = Y + b * syb + s * sys
    for h0 in range(0, H, BLOCK_H):
        h = h0 + tl.arange(0, BLOCK_H)
        mask = (h < H)[:, None] & d_mask[None, :]
        x_ptr = x_tok + h[:, None] * sxh + d[None, :] * sxd
        y_ptr = y_tok + h[:, None] * syh + d[None, :] * syd
        x1 = tl.load(x_ptr, mask=mask, other=0.0).to(tl.float32)
        x2 = tl.load(x_ptr + HALF * sxd, mask=mask, other=0.0).to(tl.float32)
        tl.store(y_ptr, (x1 * c[None, :] - x2 * sn[None, :]).to(Y.dtype.element_ty), mask=mask)
        tl.store(y_ptr + HALF * syd, (x2 * c[None, :] + x1 * sn[None, :]).to(Y.dtype.element_ty), mask=mask)


def _launch(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, inverse: bool) -> torch.Tensor:
    bsz, seq, heads, dim = x.shape
    half = dim // 2
    cos, sin = cos.expand(bsz, seq, half), sin.expand(bsz, seq, half)  # [s, half] -> zero batch stride
    y = torch.empty((bsz, seq, heads, dim), dtype=x.dtype, device=x.device)
    block_d = launch.block_size(half)
    block_h = launch.block_size(heads, cap=max(1, launch.MAX_BLOCK // block_d))
    launch.run(_rotary, (bsz * seq,), x, cos, sin, y, seq, heads, half, *x.stride(), *y.stride(), *cos.stride(),
               *sin.stride(), INVERSE=inverse, BLOCK_H=block_h, BLOCK_D=block_d,
               num_warps=launch.num_warps(block_h * block_d))
    return y


class RotaryFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, cos, sin):
        ctx.save_for_backward(cos, sin)
        return _launch(x, cos, sin, inverse=False)

    @staticmethod
    def backward(ctx, dy):
        cos, sin = ctx.saved_tensors
        return _launch(dy, cos, sin, inverse=True), None, None


def apply_rotary(x, cos, sin):
    return RotaryFunction.apply(x, cos, sin)


INTERPRETED = not isinstance(_rotary, triton.runtime.JITFunction)
