"""Checks of the FP8 cast kernels (tpzoo.kernels.float8) against their torch reference, bit for bit, and of the
launches an FP8 linear layer makes. They run in test_kernels.py's interpreter worker (TRITON_INTERPRET=1 set
before Triton loads) and, the GPU twins, in-process on CUDA (test_cuda there)."""
from __future__ import annotations

import torch

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2


def _same(got: tuple, want: tuple, what) -> None:
    """q, qt (fp8 bits) and 1/s of a cast equal."""
    for name, g, w in zip(("q", "qt", "1/s"), got, want):
        if w is None:
            assert g is None, (what, name)
            continue
        assert g.shape == w.shape and g.dtype == w.dtype, (what, name, g.shape, w.shape)
        bits = (lambda t: t.view(torch.uint8)) if w.dtype in (E4M3, E5M2) else (lambda t: t)
        assert torch.equal(bits(g), bits(w)), (what, name, int((bits(g) != bits(w)).sum()))


def check_fp8_casts(device: str = "cpu") -> None:
    """Every scale axis (one amax, per row, per column), both formats, both scale roundings, every layout choice
    and padding, bf16 / fp16 / fp32 inputs, a strided input, an all-zero row (the amax floor), an amax below the
    tensor's max (saturation), on a shape of several tiles; and the fused row cast (amax in the kernel) with rows
    longer than one block. Kernel and reference agree bit for bit."""
    from tpzoo.kernels import float8, reference

    float8.TILE, float8.ROW_BLOCK = (16, 16) if device == "cpu" else (64, 1024)
    g = torch.Generator().manual_seed(0)
    m, n = (37, 48) if device == "cpu" else (300, 4112)
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        wide = torch.randn(m, n + 5, generator=g) * 3
        x = wide[:, :n].to(device=device, dtype=dtype)  # a copy; then a strided view of another
        x[3] = 0
        strided = wide.to(device=device, dtype=dtype)[:, 2:n + 2]
        for fmt in (E4M3, E5M2):
            for mode, amax in (("tensor", x.abs().amax()), ("rows", x.abs().amax(1, keepdim=True)),
                               ("cols", x.abs().amax(0, keepdim=True) * 0.7)):  # 0.7: some values saturate
                for pow2 in (False, True):
                    for want_q, want_t, pad in ((True, False, 1), (True, True, 16), (False, True, 1)):
                        what = (dtype, fmt, mode, pow2, want_q, want_t, pad)
                        _same(float8.cast(x, amax, fmt, mode, pow2, want_q, want_t, pad),
                              reference.fp8_cast(x, amax, fmt, mode, pow2, want_q, want_t, pad), what)
            a = strided.abs().amax()
            _same(float8.cast(strided, a, fmt, "tensor", False, True, True, 16),
                  reference.fp8_cast(strided, a, fmt, "tensor", False, True, True, 16), (dtype, fmt, "strided"))
            for t, pow2 in ((x, True), (strided, False)):
                (q, inv), (q_ref, inv_ref) = float8.cast_rows(t, fmt, pow2), reference.fp8_cast_rows(t, fmt, pow2)
                _same((q, None, inv), (q_ref, None, inv_ref), (dtype, fmt, "rows fused", pow2))


def edge_values(fmt: torch.dtype) -> torch.Tensor:
    """fp32 values where rounding to `fmt` is decided: every finite fp8 value, the midpoints between neighbours
    (ties: to even), one fp32 ulp either side of each, fp8 subnormals, values past the largest (saturate), both
    signs; as a [rows, 16] tensor."""
    v = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(fmt).float()
    v = v[torch.isfinite(v) & (v >= 0)].unique().sort().values
    mids = (v[:-1] + v[1:]) / 2
    ulp = lambda t, k: (t.view(torch.int32) + k).view(torch.float32)  # noqa: E731
    top = torch.finfo(fmt).max
    vals = torch.cat([v, mids, ulp(mids, 1), ulp(mids, -1), torch.tensor([top * 1.5, 1e-30, 2.0 ** -30])])
    vals = torch.cat([vals, -vals])
    rows = -(-vals.numel() // 16)
    return torch.cat([vals, torch.zeros(rows * 16 - vals.numel())]).view(rows, 16)


def check_fp8_rounding(device: str = "cpu") -> int:
    """The kernel's conversion at every rounding decision equals torch's cast (scale 1: amax = the format's max);
    returns how many of these values Triton's own conversion gets wrong in the interpreter (the routine the kernel
    uses there instead; 0 on a GPU, whose hardware conversion the kernel uses)."""
    from tpzoo.kernels import float8, reference

    wrong = 0
    for fmt in (E4M3, E5M2):
        x = edge_values(fmt).to(device)
        amax = torch.tensor(torch.finfo(fmt).max, device=device)
        _same(float8.cast(x, amax, fmt, "tensor", False, True, True, 16),
              reference.fp8_cast(x, amax, fmt, "tensor", False, True, True, 16), (fmt, "edges"))
        if float8.INTERPRETED:
            float8.HW_ROUNDING = True
            try:
                q = float8.cast(x, amax, fmt, "tensor", False)[0]
            finally:
                float8.HW_ROUNDING = None
            want = reference.fp8_cast(x, amax, fmt, "tensor", False)[0]
            wrong += int((q.view(torch.uint8) != want.view(torch.uint8)).sum())
    return wrong


def fp8_linear_launches(recipe: str, kernels: str) -> tuple:
    """A column-parallel FP8 linear (bf16, 48 tokens, its weight cast and cached by a first micro-batch): the
    launches of the next micro-batch's forward and backward (tpzoo.kernels.launch.count_launches) with the casts
    in `kernels` ("triton" or "torch"), and its outputs (y, dx, dw)."""
    from tpzoo import kernels as K
    from tpzoo.kernels import launch
    from tpzoo.parallel import fp8

    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 24, 32, generator=g).bfloat16().requires_grad_()
    w = (torch.randn(48, 32, generator=g) * 0.05).bfloat16().requires_grad_()
    dy = (torch.randn(2, 24, 48, generator=g) * 1e-3).bfloat16()
    layer = fp8.Fp8Linear(fp8.get_recipe(recipe), "column")
    with K.use_backend(kernels, kernel="fp8_cast"):
        fp8.linear(x, w, None, layer).backward(dy)  # the first micro-batch: casts and keeps the weight
        x.grad = w.grad = None
        out = {}
        forward = launch.count_launches(lambda: out.setdefault("y", fp8.linear(x, w, None, layer)))
        backward = launch.count_launches(lambda: out["y"].backward(dy))
    names = {"triton::_cast_tiles": "cast", "triton::_cast_rows": "cast_rows", "tpzoo::fp8_cast": "cast",
             "tpzoo::fp8_cast_rows": "cast_rows"}  # the same kernel, launched or stood in for
    rename = lambda c: {names.get(k, k): v for k, v in c.items() if k != "views"}  # noqa: E731
    return rename(forward), rename(backward), (out["y"].detach(), x.grad, w.grad), layer.weight_casts
