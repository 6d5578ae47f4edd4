"""RMSNorm in Triton for rows up to launch.MAX_ROW long: tiles of several whole rows per program, and the weight
gradient reduced in two stages (fp32 partials per program, then one kernel summing them into the weight's dtype).

Forward: a program loads a [rows, n] tile once (the row stays in registers: one read of x, where the streaming
kernel of norms.py reads it twice), writes y and one fp32 rstd per row. Backward: each program walks a
contiguous range of rows tile by tile (x, dy and rstd in; dx out), keeping the weight and its running fp32
weight-gradient partial in registers, and stores the partial once; a second kernel sums the programs' partials
column block by column block in fp32 and writes the weight gradient in the weight's dtype (no torch sum + cast).
The arithmetic is the streaming kernel's (tests compare both with the reference): x_hat rounded to x's dtype
before the weight multiplies it, as the reference and HF Llama do; dx = rstd * (g - x_hat * mean(g * x_hat))
with g = dy * w. Longer rows (and LayerNorm) take norms.py.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import launch, norms


@triton.jit
def _rms_fwd(X, W, Y, RSTD, M, N, sx, sy, eps, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    rows = tl.program_id(0).to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.arange(0, BLOCK_N)
    rmask, cmask = rows < M, cols < N
    mask = rmask[:, None] & cmask[None, :]
    x = tl.load(X + rows[:, None] * sx + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    rstd = tl.rsqrt(tl.sum(x * x, axis=1) / N + eps)
    tl.store(RSTD + rows, rstd, mask=rmask)
    w = tl.load(W + cols, mask=cmask, other=0.0).to(tl.float32)
    x_hat = (x * rstd[:, None]).to(X.dtype.element_ty).to(tl.float32)
    tl.store(Y + rows[:, None] * sy + cols[None, :], (x_hat * w[None, :]).to(Y.dtype.element_ty), mask=mask)


@triton.jit
def _rms_bwd(X, W, DY, DX, RSTD, PARTIAL, M, N, sx, sdy, sdx, rows_per_program,
             BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK_N)
    cmask = cols < N
    w = tl.load(W + cols, mask=cmask, other=0.0).to(tl.float32)
    dw = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    first = pid.to(tl.int64) * rows_per_program
    last = tl.minimum(first + rows_per_program, M)
    for start in range(first, last, BLOCK_M):
        rows = start + tl.arange(0, BLOCK_M)
        rmask = rows < last
        mask = rmask[:, None] & cmask[None, :]
        x = tl.load(X + rows[:, None] * sx + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        dy = tl.load(DY + rows[:, None] * sdy + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        rstd = tl.load(RSTD + rows, mask=rmask, other=0.0)
        x_hat = x * rstd[:, None]
        g = dy * w[None, :]
        c = tl.sum(g * x_hat, axis=1) / N
        dx = (g - x_hat * c[:, None]) * rstd[:, None]
        tl.store(DX + rows[:, None] * sdx + cols[None, :], dx.to(DX.dtype.element_ty), mask=mask)
        dw += dy * x_hat.to(X.dtype.element_ty).to(tl.float32)
    tl.store(PARTIAL + pid * N + cols, tl.sum(dw, axis=0), mask=cmask)


@triton.jit
def _sum_partials(PARTIAL, OUT, P, N, BLOCK_P: tl.constexpr, BLOCK_C: tl.constexpr):
    """OUT[c] = sum over p of PARTIAL[p, c] in fp32, stored in OUT's dtype (stage 2 of the weight gradient)."""
    cols = tl.program_id(0) * BLOCK_C + tl.arange(0, BLOCK_C)
    cmask = cols < N
    acc = tl.zeros([BLOCK_P, BLOCK_C], dtype=tl.float32)
    for p0 in range(0, P, BLOCK_P):
        ps = p0 + tl.arange(0, BLOCK_P)
        acc += tl.load(PARTIAL + ps[:, None] * N + cols[None, :], mask=(ps < P)[:, None] & cmask[None, :],
                       other=0.0)
    tl.store(OUT + cols, tl.sum(acc, axis=0).to(OUT.dtype.element_ty), mask=cmask)


def _tile(n: int, m: int, tile: int) -> tuple[int, int]:
    """(rows per tile, row block) for rows of n elements: as many whole rows as `tile` elements hold."""
    block_n = launch.next_pow2(n)
    return max(1, min(tile // block_n, launch.next_pow2(m))), block_n


class RMSNormFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, eps):
        n = x.shape[-1]
        x2 = launch.as_rows(x, n)
        m = x2.shape[0]
        w = weight.contiguous()
        y = torch.empty((m, n), dtype=torch.promote_types(x.dtype, w.dtype), device=x.device)
        rstd = torch.empty(m, dtype=torch.float32, device=x.device)
        block_m, block_n = _tile(n, m, launch.MAX_TILE)
        launch.run(_rms_fwd, (triton.cdiv(m, block_m),), x2, w, y, rstd, m, n, x2.stride(0), y.stride(0), eps,
                   BLOCK_M=block_m, BLOCK_N=block_n, num_warps=launch.num_warps(block_m * block_n))
        ctx.save_for_backward(x2, w, rstd)
        ctx.shape = x.shape
        return y.view(x.shape)

    @staticmethod
    def backward(ctx, dy):
        x2, w, rstd = ctx.saved_tensors
        m, n = x2.shape
        dy2 = launch.as_rows(dy, n)
        dx = torch.empty((m, n), dtype=x2.dtype, device=x2.device)
        block_m, block_n = _tile(n, m, launch.MAX_TILE // 2)  # more live tensors per element than the forward
        tiles = triton.cdiv(m, block_m)
        programs = max(1, min(tiles, launch.target_programs(x2.device, per_sm=8)))
        rows_per_program = triton.cdiv(tiles, programs) * block_m
        programs = triton.cdiv(m, rows_per_program)
        partial = torch.empty((programs, n), dtype=torch.float32, device=x2.device)
        launch.run(_rms_bwd, (programs,), x2, w, dy2, dx, rstd, partial, m, n, x2.stride(0), dy2.stride(0),
                   dx.stride(0), rows_per_program, BLOCK_M=block_m, BLOCK_N=block_n,
                   num_warps=launch.num_warps(block_m * block_n))
        dw = torch.empty(n, dtype=w.dtype, device=w.device)
        block_c = min(64, block_n)
        launch.run(_sum_partials, (triton.cdiv(n, block_c),), partial, dw, programs, n,
                   BLOCK_P=min(64, launch.next_pow2(programs)), BLOCK_C=block_c)
        return dx.view(ctx.shape), dw, None


def rms_norm(x, weight, eps):
    if x.shape[-1] <= launch.MAX_ROW:
        return RMSNormFunction.apply(x, weight, eps)
    return norms.rms_norm(x, weight, eps)


INTERPRETED = not isinstance(_rms_fwd, triton.runtime.JITFunction)
