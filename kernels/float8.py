"""FP8 casts in Triton (the operands of tpzoo.parallel.fp8's GEMMs): one read of the 16-bit (or fp32) tensor
writes its fp8 values in every layout the GEMMs need, the scale arithmetic done in the kernel.

`cast`: x [M, N] and its amax, already reduced where the recipe needs agreement across ranks: one per tensor,
per row ([M, 1]) or per column ([1, N]). Each program loads a [BM, BN] tile once, computes the scale
s = fp8_max / max(amax, EPS) (rounded down to a power of two for the rowwise recipe, by clearing the mantissa
bits), and stores cast(clamp(x * s)) row-major (`q`, [M, N]) and/or transposed (`qt`, [N, MP]: the copy that
torch._scaled_mm takes as a column-major operand, or as the weight-gradient GEMM's row-major first operand). MP
is M rounded up to `pad` and the padding columns are written as zeros: the weight-gradient GEMM contracts over
the tokens and _scaled_mm wants that dim a multiple of 16 (zeros add nothing). The programs of the first row or
column block also write 1/s, the dequantization scale the GEMM takes. No host arithmetic, no host sync.

`cast_rows`: one scale per row over a dim that is not split across ranks (x per token for a column layer, the
weight per output channel...): the amax is taken in the kernel (a first walk over the row's blocks), then the
row is cast (a second walk, from cache): amax, scale and cast in one launch.

Rounding. On a GPU the conversion is the hardware's (cvt.rn.satfinite: round to nearest even). Triton's
interpreter (what CPU tests run) converts to fp8 with its own routine, which rounds ties away and drops
subnormals, so there the code is computed from the fp32 bits instead (`_soft_fp8`: round to nearest even, the
fp8 subnormals through one fp32 addition whose ulp is the subnormal step), which is what torch's cast does. The
tests compare both paths with torch bit for bit (the interpreter's on CPU, the hardware's on a GPU).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import launch

EPS = 1e-12          # tpzoo.parallel.fp8.EPS: the amax floor (an all-zero tensor gets a finite scale)
TILE = 64            # rows and columns per program of `cast`; tests lower it to cross tile edges
ROW_BLOCK = 1024     # columns per step of `cast_rows`' walk along a row; tests lower it
HW_ROUNDING = None   # the conversion: None = the hardware's when compiled, the bit-exact routine when interpreted;
                     # tests force True in the interpreter to show its own conversion differs from torch's


def _format(dtype: torch.dtype) -> dict:
    """The constexprs of an fp8 format: its largest finite value, mantissa bits, exponent bias, and the fp32
    constant whose ulp is the format's subnormal step (BIG) with its bit pattern."""
    e5m2 = dtype == torch.float8_e5m2
    mant, bias = (2, 15) if e5m2 else (3, 7)
    big_exp = 1 - bias - mant + 23
    return dict(FMAX=float(torch.finfo(dtype).max), E5M2=e5m2, MANT=mant, BIAS=bias, BIG=2.0 ** big_exp,
                BIG_BITS=(127 + big_exp) << 23)


@triton.jit
def _scale(amax, FMAX: tl.constexpr, EPS_: tl.constexpr, POW2: tl.constexpr):
    """fp8_max / max(amax, EPS) in fp32, correctly rounded; POW2: rounded down to a power of two (the exponent
    bits kept, the mantissa cleared)."""
    s = tl.math.div_rn(tl.full(amax.shape, FMAX, tl.float32), tl.maximum(amax, EPS_))
    if POW2:
        s = (s.to(tl.int32, bitcast=True) & 0x7F800000).to(tl.float32, bitcast=True)
    return s


@triton.jit
def _soft_fp8(v, MANT: tl.constexpr, BIAS: tl.constexpr, BIG: tl.constexpr, BIG_BITS: tl.constexpr):
    """The fp8 code (uint8) of v (fp32, finite, within the format's range), rounded to nearest even."""
    bits = v.to(tl.uint32, bitcast=True)
    sign = (bits >> 24) & 0x80
    a = bits & 0x7FFFFFFF
    # normal results: round the mantissa to MANT bits (a carry moves into the exponent), then rebias
    odd = (a >> (23 - MANT)) & 1
    normal = ((a + ((1 << (22 - MANT)) - 1) + odd) >> (23 - MANT)) - ((127 - BIAS) << MANT)
    # below the smallest normal: |v| + BIG rounds |v| to a multiple of the subnormal step (fp32 addition rounds
    # to nearest even), and the low bits of the sum count the steps
    sub = ((a.to(tl.float32, bitcast=True) + BIG).to(tl.uint32, bitcast=True) - BIG_BITS)
    code = tl.where(a < ((128 - BIAS) << 23), sub, normal)
    code = tl.where(a > 0x7F800000, 0x7F, code)  # NaN stays NaN
    return (code | sign).to(tl.uint8)


@triton.jit
def _fp8_bits(v, FMAX: tl.constexpr, E5M2: tl.constexpr, MANT: tl.constexpr, BIAS: tl.constexpr,
              BIG: tl.constexpr, BIG_BITS: tl.constexpr, HW: tl.constexpr):
    """cast(clamp(v, -FMAX, FMAX)) to the fp8 format, as uint8 bits."""
    v = tl.minimum(tl.maximum(v, -FMAX), FMAX)
    if HW:
        if E5M2:
            q = v.to(tl.float8e5, fp_downcast_rounding="rtne")
        else:
            q = v.to(tl.float8e4nv, fp_downcast_rounding="rtne")
        return q.to(tl.uint8, bitcast=True)
    return _soft_fp8(v, MANT, BIAS, BIG, BIG_BITS)


@triton.jit
def _cast_tiles(X, AMAX, Q, QT, INV, M, N, MP, sx, sq, sqt, MODE: tl.constexpr, POW2: tl.constexpr,
                WRITE_Q: tl.constexpr, WRITE_QT: tl.constexpr, EPS_: tl.constexpr, FMAX: tl.constexpr,
                E5M2: tl.constexpr, MANT: tl.constexpr, BIAS: tl.constexpr, BIG: tl.constexpr,
                BIG_BITS: tl.constexpr, HW: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr):
    # MODE 0: one amax; 1: one per row [M]; 2: one per column [N]
    pm, pn = tl.program_id(0), tl.program_id(1)
    rows = pm.to(tl.int64) * BM + tl.arange(0, BM)
    cols = pn.to(tl.int64) * BN + tl.arange(0, BN)
    rmask, cmask = rows < M, cols < N
    x = tl.load(X + rows[:, None] * sx + cols[None, :], mask=rmask[:, None] & cmask[None, :],
                other=0.0).to(tl.float32)
    if MODE == 0:
        s = _scale(tl.load(AMAX).to(tl.float32), FMAX, EPS_, POW2)
        v = x * s
        if (pm == 0) & (pn == 0):
            tl.store(INV, tl.math.div_rn(1.0, s))
    elif MODE == 1:
        s = _scale(tl.load(AMAX + rows, mask=rmask, other=1.0).to(tl.float32), FMAX, EPS_, POW2)
        v = x * s[:, None]
        if pn == 0:
            tl.store(INV + rows, tl.math.div_rn(tl.full(s.shape, 1.0, tl.float32), s), mask=rmask)
    else:
        s = _scale(tl.load(AMAX + cols, mask=cmask, other=1.0).to(tl.float32), FMAX, EPS_, POW2)
        v = x * s[None, :]
        if pm == 0:
            tl.store(INV + cols, tl.math.div_rn(tl.full(s.shape, 1.0, tl.float32), s), mask=cmask)
    code = _fp8_bits(v, FMAX, E5M2, MANT, BIAS, BIG, BIG_BITS, HW)
    if WRITE_Q:
        tl.store(Q + rows[:, None] * sq + cols[None, :], code, mask=rmask[:, None] & cmask[None, :])
    if WRITE_QT:  # rows past M (up to MP) hold zeros: x was loaded as 0 there
        tl.store(QT + cols[:, None] * sqt + rows[None, :], tl.trans(code), mask=cmask[:, None] & (rows < MP)[None, :])


@triton.jit
def _cast_rows(X, Q, INV, M, N, sx, sq, POW2: tl.constexpr, EPS_: tl.constexpr, FMAX: tl.constexpr,
               E5M2: tl.constexpr, MANT: tl.constexpr, BIAS: tl.constexpr, BIG: tl.constexpr,
               BIG_BITS: tl.constexpr, HW: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr):
    rows = tl.program_id(0).to(tl.int64) * BM + tl.arange(0, BM)
    rmask = rows < M
    amax = tl.zeros([BM], dtype=tl.float32)
    for n0 in range(0, N, BN):
        cols = n0 + tl.arange(0, BN)
        mask = rmask[:, None] & (cols < N)[None, :]
        x = tl.load(X + rows[:, None] * sx + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        amax = tl.maximum(amax, tl.max(tl.abs(x), axis=1))
    s = _scale(amax, FMAX, EPS_, POW2)
    for n0 in range(0, N, BN):
        cols = n0 + tl.arange(0, BN)
        mask = rmask[:, None] & (cols < N)[None, :]
        x = tl.load(X + rows[:, None] * sx + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        code = _fp8_bits(x * s[:, None], FMAX, E5M2, MANT, BIAS, BIG, BIG_BITS, HW)
        tl.store(Q + rows[:, None] * sq + cols[None, :], code, mask=mask)
    tl.store(INV + rows, tl.math.div_rn(tl.full(s.shape, 1.0, tl.float32), s), mask=rmask)


_MODES = {"tensor": 0, "rows": 1, "cols": 2}


def cast(x: torch.Tensor, amax: torch.Tensor, dtype: torch.dtype, mode: str, pow2: bool, want_q: bool = True,
         want_t: bool = False, pad: int = 1) -> tuple:
    """(q [M, N] or None, qt [N, MP] or None, 1/s shaped like amax): see the module docstring."""
    m, n = x.shape
    if x.stride(1) != 1:
        x = x.contiguous()
    mp = -(-m // pad) * pad if want_t else m
    q = torch.empty((m, n), dtype=dtype, device=x.device) if want_q else None
    qt = torch.empty((n, mp), dtype=dtype, device=x.device) if want_t else None
    inv = torch.empty(amax.shape, dtype=torch.float32, device=x.device)
    qb = q.view(torch.uint8) if want_q else None
    qtb = qt.view(torch.uint8) if want_t else None
    qb, qtb = (qb if want_q else qtb), (qtb if want_t else qb)  # a stand-in pointer where nothing is written
    tile = TILE
    launch.run(_cast_tiles, (triton.cdiv(mp, tile), triton.cdiv(n, tile)), x, amax.contiguous(), qb, qtb, inv,
               m, n, mp, x.stride(0), n, mp, MODE=_MODES[mode], POW2=pow2, WRITE_Q=want_q, WRITE_QT=want_t,
               EPS_=EPS, HW=_hardware(), BM=tile, BN=tile, num_warps=4, **_format(dtype))
    return q, qt, inv


def cast_rows(x: torch.Tensor, dtype: torch.dtype, pow2: bool) -> tuple:
    """(q [M, N], 1/s [M, 1]) with each row's own amax (taken in the kernel)."""
    m, n = x.shape
    if x.stride(1) != 1:
        x = x.contiguous()
    q = torch.empty((m, n), dtype=dtype, device=x.device)
    inv = torch.empty((m, 1), dtype=torch.float32, device=x.device)
    bn = launch.block_size(n, ROW_BLOCK)
    bm = max(1, min(launch.next_pow2(m), 4096 // bn))
    launch.run(_cast_rows, (triton.cdiv(m, bm),), x, q.view(torch.uint8), inv, m, n, x.stride(0), n, POW2=pow2,
               EPS_=EPS, HW=_hardware(), BM=bm, BN=bn, num_warps=4, **_format(dtype))
    return q, inv


def _hardware() -> bool:
    return not INTERPRETED if HW_ROUNDING is None else HW_ROUNDING


INTERPRETED = not isinstance(_cast_tiles, triton.runtime.JITFunction)
