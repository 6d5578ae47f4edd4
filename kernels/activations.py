"""SwiGLU, GeGLU (Gemma: gelu_tanh(gate) * up) and bias-GeLU (tanh approximation) in Triton, forward and
backward. SwiGLU and GeGLU are one kernel pair with the gate's activation chosen at compile time.

Both save only their inputs and recompute the activation in the backward: no activation-sized tensor is kept
between forward and backward beyond what the caller already holds. Inputs are viewed as [rows, n] with any
row stride (gate and up are usually the two halves of one fused projection: no copy). The gated kernels run one
program per (row, column block), no loop; the packed form (`swiglu_packed(h)`, h = gate|up) writes dgate and dup
into the two halves of one gradient tensor, which spares autograd the cat that undoing `h.chunk(2)` costs. For
bias-GeLU each program owns one column block and walks a group of rows; its bias gradient is summed per group
in fp32 and the group partials are added in torch.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import launch

_SQRT_2_OVER_PI = tl.constexpr(0.7978845608028654)


@triton.jit
def _gelu_parts(z):
    """gelu_tanh(z) = z * sigmoid(2a) with a = sqrt(2/pi) (z + 0.044715 z^3), since (1 + tanh a) / 2 = sigmoid(2a);
    returns (gelu(z), d gelu / dz)."""
    a = _SQRT_2_OVER_PI * (z + 0.044715 * z * z * z)
    sg = tl.sigmoid(2.0 * a)
    da = _SQRT_2_OVER_PI * (1.0 + 3.0 * 0.044715 * z * z)
    return z * sg, sg + z * sg * (1.0 - sg) * 2.0 * da


@triton.jit
def _gate_parts(g, GELU: tl.constexpr):
    """(act(g), d act / dg) of the gate: silu (SwiGLU) or the tanh GeLU (GeGLU)."""
    if GELU:
        a, da = _gelu_parts(g)
    else:
        sig = tl.sigmoid(g)
        a, da = g * sig, sig * (1.0 + g * (1.0 - sig))
    return a, da


@triton.jit
def _swiglu_fwd(G, U, Y, N, sg, su, sy, GELU: tl.constexpr, BLOCK: tl.constexpr):
    # one program per (row, column block): no loop, so every program's loads are in flight at once
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < N
    g = tl.load(G + row * sg + cols, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(U + row * su + cols, mask=mask, other=0.0).to(tl.float32)
    a, _ = _gate_parts(g, GELU)
    tl.store(Y + row * sy + cols, (a * u).to(Y.dtype.element_ty), mask=mask)


@triton.jit
def _swiglu_bwd(G, U, DY, DG, DU, N, sg, su, sdy, sdg, sdu, GELU: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < N
    g = tl.load(G + row * sg + cols, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(U + row * su + cols, mask=mask, other=0.0).to(tl.float32)
    dy = tl.load(DY + row * sdy + cols, mask=mask, other=0.0).to(tl.float32)
    a, da = _gate_parts(g, GELU)
    tl.store(DG + row * sdg + cols, (dy * u * da).to(DG.dtype.element_ty), mask=mask)
    tl.store(DU + row * sdu + cols, (dy * a).to(DU.dtype.element_ty), mask=mask)


@triton.jit
def _bias_gelu_fwd(X, B, Y, M, N, sx, sy, rows_per_group, HAS_BIAS: tl.constexpr, BLOCK: tl.constexpr):
    cols = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < N
    bias = tl.zeros([BLOCK], dtype=tl.float32)
    if HAS_BIAS:
        bias = tl.load(B + cols, mask=mask, other=0.0).to(tl.float32)
    row0 = tl.program_id(1).to(tl.int64) * rows_per_group
    for row in range(row0, tl.minimum(row0 + rows_per_group, M)):
        z = tl.load(X + row * sx + cols, mask=mask, other=0.0).to(tl.float32) + bias
        y, _ = _gelu_parts(z)
        tl.store(Y + row * sy + cols, y.to(Y.dtype.element_ty), mask=mask)


@triton.jit
def _bias_gelu_bwd(X, B, DY, DX, DB, M, N, sx, sdy, sdx, rows_per_group, HAS_BIAS: tl.constexpr,
                   BLOCK: tl.constexpr):
    cols = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < N
    bias = tl.zeros([BLOCK], dtype=tl.float32)
    if HAS_BIAS:
        bias = tl.load(B + cols, mask=mask, other=0.0).to(tl.float32)
    db = tl.zeros([BLOCK], dtype=tl.float32)
    group = tl.program_id(1).to(tl.int64)
    row0 = group * rows_per_group
    for row in range(row0, tl.minimum(row0 + rows_per_group, M)):
        z = tl.load(X + row * sx + cols, mask=mask, other=0.0).to(tl.float32) + bias
        dy = tl.load(DY + row * sdy + cols, mask=mask, other=0.0).to(tl.float32)
        _, dgelu = _gelu_parts(z)
        dx = dy * dgelu
        tl.store(DX + row * sdx + cols, dx.to(DX.dtype.element_ty), mask=mask)
        db += dx
    if HAS_BIAS:
        tl.store(DB + group * N + cols, db, mask=mask)


def _layout(n: int, rows: int, device: torch.device, per_sm: int):
    block = launch.block_size(n, cap=launch.MAX_ELEMENTWISE_BLOCK)
    col_blocks = triton.cdiv(n, block)
    per, groups = launch.row_groups(rows, col_blocks, device, per_sm)
    return block, per, (col_blocks, groups)


def _glu_forward(g2, u2, gelu: bool) -> torch.Tensor:
    m, n = g2.shape
    y = torch.empty((m, n), dtype=g2.dtype, device=g2.device)
    block = launch.block_size(n, cap=launch.MAX_ELEMENTWISE_BLOCK)
    launch.run(_swiglu_fwd, (m, triton.cdiv(n, block)), g2, u2, y, n, g2.stride(0), u2.stride(0), y.stride(0),
               GELU=gelu, BLOCK=block)
    return y


def _glu_backward(g2, u2, dy2, dg, du, gelu: bool) -> None:
    m, n = g2.shape
    block = launch.block_size(n, cap=launch.MAX_ELEMENTWISE_BLOCK)
    launch.run(_swiglu_bwd, (m, triton.cdiv(n, block)), g2, u2, dy2, dg, du, n, g2.stride(0), u2.stride(0),
               dy2.stride(0), dg.stride(0), du.stride(0), GELU=gelu, BLOCK=block)


class SwiGLUFunction(torch.autograd.Function):
    """act(gate) * up: silu, or the tanh GeLU with gelu=True (GeGLU)."""

    @staticmethod
    def forward(ctx, gate, up, gelu=False):
        n = gate.shape[-1]
        g2, u2 = launch.as_rows(gate, n), launch.as_rows(up, n)
        ctx.save_for_backward(g2, u2)
        ctx.shape, ctx.gelu = gate.shape, gelu
        return _glu_forward(g2, u2, gelu).view(gate.shape)

    @staticmethod
    def backward(ctx, dy):
        g2, u2 = ctx.saved_tensors
        dg, du = (torch.empty(g2.shape, dtype=g2.dtype, device=g2.device) for _ in range(2))
        _glu_backward(g2, u2, launch.as_rows(dy, g2.shape[1]), dg, du, ctx.gelu)
        return dg.view(ctx.shape), du.view(ctx.shape), None


class PackedGLUFunction(torch.autograd.Function):
    """act(h[..., :n]) * h[..., n:] for h = gate|up [..., 2n]; the gradient is written into one tensor like h
    (its halves are dgate and dup), so autograd has no split to undo with a cat."""

    @staticmethod
    def forward(ctx, h, gelu=False):
        n = h.shape[-1] // 2
        h2 = launch.as_rows(h, 2 * n)
        ctx.save_for_backward(h2)
        ctx.shape, ctx.gelu = h.shape, gelu
        return _glu_forward(h2[:, :n], h2[:, n:], gelu).view(*h.shape[:-1], n)

    @staticmethod
    def backward(ctx, dy):
        (h2,) = ctx.saved_tensors
        n = h2.shape[1] // 2
        dh = torch.empty((h2.shape[0], 2 * n), dtype=h2.dtype, device=h2.device)
        _glu_backward(h2[:, :n], h2[:, n:], launch.as_rows(dy, n), dh[:, :n], dh[:, n:], ctx.gelu)
        return dh.view(ctx.shape), None


class BiasGeLUFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, bias):
        n = x.shape[-1]
        x2 = launch.as_rows(x, n)
        b = bias.contiguous() if bias is not None else None
        m = x2.shape[0]
        y = torch.empty((m, n), dtype=x.dtype, device=x.device)
        block, per, grid = _layout(n, m, x.device, per_sm=32)
        launch.run(_bias_gelu_fwd, grid, x2, b if b is not None else x2, y, m, n, x2.stride(0), y.stride(0), per,
                   HAS_BIAS=b is not None, BLOCK=block)
        ctx.save_for_backward(x2, b)
        ctx.shape = x.shape
        return y.view(x.shape)

    @staticmethod
    def backward(ctx, dy):
        x2, b = ctx.saved_tensors
        m, n = x2.shape
        dy2 = launch.as_rows(dy, n)
        dx = torch.empty((m, n), dtype=x2.dtype, device=x2.device)
        block, per, grid = _layout(n, m, x2.device, per_sm=8)  # fewer groups: one fp32 bias partial each
        db = torch.empty((grid[1], n) if b is not None else (1,), dtype=torch.float32, device=x2.device)
        launch.run(_bias_gelu_bwd, grid, x2, b if b is not None else x2, dy2, dx, db, m, n, x2.stride(0),
                   dy2.stride(0), dx.stride(0), per, HAS_BIAS=b is not None, BLOCK=block)
        return dx.view(ctx.shape), db.sum(0).to(b.dtype) if b is not None else None


def swiglu(gate, up):
    return SwiGLUFunction.apply(gate, up)


def geglu(gate, up):
    return SwiGLUFunction.apply(gate, up, True)


def swiglu_packed(h):
    return PackedGLUFunction.apply(h)


def geglu_packed(h):
    return PackedGLUFunction.apply(h, True)


def bias_gelu(x, bias=None):
    return BiasGeLUFunction.apply(x, bias)


INTERPRETED = not isinstance(_swiglu_fwd, triton.runtime.JITFunction)
