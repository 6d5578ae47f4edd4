"""RMSNorm and LayerNorm in Triton, forward and backward (input, weight and bias gradients).

One kernel pair serves both norms (RMSNorm is LayerNorm without the mean). Statistics are fp32 whatever the
input dtype; the forward saves the input and one or two fp32 scalars per row (rstd, and the mean for
LayerNorm). Rows longer than one block are streamed block by block. The backward walks a group of rows per
program and keeps fp32 partial weight/bias gradients per group, summed in torch afterwards.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import launch


@triton.jit
def _norm_fwd(X, W, B, Y, MEAN, RSTD, N, stride_x, stride_y, eps,
              IS_RMS: tl.constexpr, HAS_W: tl.constexpr, HAS_B: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    x_row = X + row * stride_x
    y_row = Y + row * stride_y
    mean = 0.0
    if not IS_RMS:
        acc = tl.zeros([BLOCK], dtype=tl.float32)
        for off in range(0, N, BLOCK):
            cols = off + tl.arange(0, BLOCK)
            acc += tl.load(x_row + cols, mask=cols < N, other=0.0).to(tl.float32)
        mean = tl.sum(acc, axis=0) / N
        tl.store(MEAN + row, mean)
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for off in range(0, N, BLOCK):  # centred second pass: no E[x^2] - E[x]^2 cancellation
        cols = off + tl.arange(0, BLOCK)
        mask = cols < N
        x = tl.load(x_row + cols, mask=mask, other=0.0).to(tl.float32)
        d = tl.where(mask, x - mean, 0.0)
        acc += d * d
    rstd = tl.rsqrt(tl.sum(acc, axis=0) / N + eps)
    tl.store(RSTD + row, rstd)
    for off in range(0, N, BLOCK):
        cols = off + tl.arange(0, BLOCK)
        mask = cols < N
        y = (tl.load(x_row + cols, mask=mask, other=0.0).to(tl.float32) - mean) * rstd
        if IS_RMS:  # like the reference (and HF Llama): round the normalized x to x's dtype, then scale
            y = y.to(X.dtype.element_ty).to(tl.float32)
        if HAS_W:
            y = y * tl.load(W + cols, mask=mask, other=0.0).to(tl.float32)
        if HAS_B:
            y = y + tl.load(B + cols, mask=mask, other=0.0).to(tl.float32)
        tl.store(y_row + cols, y.to(Y.dtype.element_ty), mask=mask)


@triton.jit
def _row_terms(X, W, DY, MEAN, RSTD, row, cols, mask, stride_x, stride_dy, IS_RMS: tl.constexpr,
               HAS_W: tl.constexpr):
    """(x_hat, dy, g = dy * w, rstd) of one block of one row, all fp32, zero outside the row."""
    x = tl.load(X + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    dy = tl.load(DY + row * stride_dy + cols, mask=mask, other=0.0).to(tl.float32)
    rstd = tl.load(RSTD + row)
    if IS_RMS:
        x_hat = x * rstd
    else:
        x_hat = tl.where(mask, (x - tl.load(MEAN + row)) * rstd, 0.0)
    g = dy
    if HAS_W:
        g = dy * tl.load(W + cols, mask=mask, other=0.0).to(tl.float32)
    return x_hat, dy, g, rstd


@triton.jit
def _norm_bwd(X, W, DY, DX, MEAN, RSTD, C, DW, DB, M, N, stride_x, stride_dy, stride_dx, rows_per_group,
              IS_RMS: tl.constexpr, HAS_W: tl.constexpr, HAS_B: tl.constexpr, ONE_BLOCK: tl.constexpr,
              BLOCK: tl.constexpr):
    # dx = rstd * (g - x_hat * mean(g * x_hat) - mean(g)), the mean(g) term for LayerNorm only.
    group = tl.program_id(0).to(tl.int64)
    row0 = group * rows_per_group
    row1 = tl.minimum(row0 + rows_per_group, M)
    if ONE_BLOCK:  # the row fits one block: a single read of x and dy per row
        cols = tl.arange(0, BLOCK)
        mask = cols < N
        dw = tl.zeros([BLOCK], dtype=tl.float32)
        db = tl.zeros([BLOCK], dtype=tl.float32)
        for row in range(row0, row1):
            x_hat, dy, g, rstd = _row_terms(X, W, DY, MEAN, RSTD, row, cols, mask, stride_x, stride_dy,
                                            IS_RMS, HAS_W)
            dx = g - x_hat * (tl.sum(g * x_hat, axis=0) / N)
            if not IS_RMS:
                dx -= tl.sum(g, axis=0) / N
            tl.store(DX + row * stride_dx + cols, (dx * rstd).to(DX.dtype.element_ty), mask=mask)
            if IS_RMS:
                x_hat = x_hat.to(X.dtype.element_ty).to(tl.float32)
            dw += dy * x_hat
            db += dy
        if HAS_W:
            tl.store(DW + group * N + cols, dw, mask=mask)
        if HAS_B:
            tl.store(DB + group * N + cols, db, mask=mask)
    else:  # long rows: first the two per-row coefficients into C, then column blocks with rows inside
        for row in range(row0, row1):
            a1 = tl.zeros([BLOCK], dtype=tl.float32)
            a2 = tl.zeros([BLOCK], dtype=tl.float32)
            for off in range(0, N, BLOCK):
                cols = off + tl.arange(0, BLOCK)
                x_hat, dy, g, rstd = _row_terms(X, W, DY, MEAN, RSTD, row, cols, cols < N, stride_x,
                                                stride_dy, IS_RMS, HAS_W)
                a1 += g * x_hat
                a2 += g
            tl.store(C + 2 * row, tl.sum(a1, axis=0) / N)
            tl.store(C + 2 * row + 1, tl.sum(a2, axis=0) / N)
        for off in range(0, N, BLOCK):
            cols = off + tl.arange(0, BLOCK)
            mask = cols < N
            dw = tl.zeros([BLOCK], dtype=tl.float32)
            db = tl.zeros([BLOCK], dtype=tl.float32)
            for row in range(row0, row1):
                x_hat, dy, g, rstd = _row_terms(X, W, DY, MEAN, RSTD, row, cols, mask, stride_x, stride_dy,
                                                IS_RMS, HAS_W)
                dx = g - x_hat * tl.load(C + 2 * row)
                if not IS_RMS:
                    dx -= tl.load(C + 2 * row + 1)
                tl.store(DX + row * stride_dx + cols, (dx * rstd).to(DX.dtype.element_ty), mask=mask)
                if IS_RMS:
                    x_hat = x_hat.to(X.dtype.element_ty).to(tl.float32)
                dw += dy * x_hat
                db += dy
            if HAS_W:
                tl.store(DW + group * N + cols, dw, mask=mask)
            if HAS_B:
                tl.store(DB + group * N + cols, db, mask=mask)


class NormFunction(torch.autograd.Function):
    """y = norm(x) * weight + bias over the last dim; RMSNorm when is_rms (then no bias)."""

    @staticmethod
    def forward(ctx, x, weight, bias, eps, is_rms):
        n = x.shape[-1]
        x2 = launch.as_rows(x, n)
        m = x2.shape[0]
        w = weight.contiguous() if weight is not None else None
        b = bias.contiguous() if bias is not None else None
        # RMSNorm's reference computes weight * x_hat.to(x.dtype): the result takes the promoted dtype.
        out_dtype = torch.promote_types(x.dtype, w.dtype) if is_rms and w is not None else x.dtype
        y = torch.empty((m, n), dtype=out_dtype, device=x.device)
        rstd = torch.empty(m, dtype=torch.float32, device=x.device)
        mean = rstd if is_rms else torch.empty_like(rstd)
        block = launch.block_size(n)
        launch.run(_norm_fwd, (m,), x2, w if w is not None else x2, b if b is not None else x2, y, mean, rstd, n,
                   x2.stride(0), y.stride(0), eps, IS_RMS=is_rms, HAS_W=w is not None, HAS_B=b is not None,
                   BLOCK=block, num_warps=launch.num_warps(block))
        ctx.save_for_backward(x2, w, mean, rstd)
        ctx.is_rms, ctx.has_b, ctx.shape = is_rms, b is not None, x.shape
        ctx.b_dtype = b.dtype if b is not None else None
        return y.view(x.shape)

    @staticmethod
    def backward(ctx, dy):
        x2, w, mean, rstd = ctx.saved_tensors
        m, n = x2.shape
        dy2 = launch.as_rows(dy, n)
        dx = torch.empty((m, n), dtype=x2.dtype, device=x2.device)
        block = launch.block_size(n)
        per, groups = launch.row_groups(m, 1, x2.device)
        scratch = lambda on: torch.empty((groups, n) if on else (1,), dtype=torch.float32,  # noqa: E731
                                         device=x2.device)
        dw, db = scratch(w is not None), scratch(ctx.has_b)
        coeffs = scratch(False) if n <= block else torch.empty(2 * m, dtype=torch.float32, device=x2.device)
        launch.run(_norm_bwd, (groups,), x2, w if w is not None else x2, dy2, dx, mean, rstd, coeffs, dw, db, m, n,
                   x2.stride(0), dy2.stride(0), dx.stride(0), per, IS_RMS=ctx.is_rms, HAS_W=w is not None,
                   HAS_B=ctx.has_b, ONE_BLOCK=n <= block, BLOCK=block, num_warps=launch.num_warps(block))
        dweight = dw.sum(0).to(w.dtype) if w is not None else None
        dbias = db.sum(0).to(ctx.b_dtype) if ctx.has_b else None
        return dx.view(ctx.shape), dweight, dbias, None, None


def rms_norm(x, weight, eps):
    return NormFunction.apply(x, weight, None, eps, True)


def layer_norm(x, weight, bias, eps):
    return NormFunction.apply(x, weight, bias, eps, False)


INTERPRETED = not isinstance(_norm_fwd, triton.runtime.JITFunction)
