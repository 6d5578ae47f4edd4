"""Compile every kernel specialization the wrappers launch for a GPU target, on a machine without a GPU.

Triton's interpreter (what CPU tests run) executes kernels as numpy and skips the compiler, so type errors of
compiled mode (loop-carried types, constexpr misuse, unsupported ops) would first show on a GPU. This module
runs the wrappers on small CPU tensors with launches recorded instead of executed (`launch.recording`), then
compiles each distinct recorded launch down to a cubin with Triton's own compiler and bundled ptxas.

Use it in a process where the kernels were loaded without TRITON_INTERPRET:
    python -c "from tpzoo.kernels.compile_check import compile_all; print(compile_all())"
"""
from __future__ import annotations

import torch

from . import launch

_DTYPES = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16", torch.int64: "i64",
           torch.int32: "i32", torch.bool: "i1", torch.uint8: "u8"}


def _exercise(dtype: torch.dtype) -> None:
    """Forward and backward of every kernel wrapper: one-block and multi-block rows, with and without
    optional operands."""
    from . import activations, float8, fused_linear_cross_entropy, norms, rms, rotary, vocab_cross_entropy

    def fwd_bwd(fn, *args):
        ins = [a.requires_grad_() if isinstance(a, torch.Tensor) and a.is_floating_point() else a for a in args]
        out = fn(*ins)
        torch.autograd.grad(out, [a for a in ins if isinstance(a, torch.Tensor) and a.requires_grad],
                            torch.ones_like(out), allow_unused=True)

    r = lambda *shape, dt=dtype: torch.randn(*shape, dtype=dt, device="cpu")  # noqa: E731
    for n in (64, launch.MAX_BLOCK + 64):
        fwd_bwd(norms.rms_norm, r(4, n), r(n), 1e-6)
        fwd_bwd(norms.layer_norm, r(4, n), r(n), r(n), 1e-5)
        fwd_bwd(norms.layer_norm, r(4, n), r(n), None, 1e-5)
    for rows, n in ((4, 64), (64, 64), (4, 8192)):  # one row per tile, several, a row of the largest tile
        fwd_bwd(rms.rms_norm, r(rows, n), r(n), 1e-6)
    fwd_bwd(rms.rms_norm, r(4, 64), r(64, dt=torch.float32), 1e-6)  # weight of another dtype: fp32 output
    fwd_bwd(rotary.apply_rotary, r(2, 3, 4, 16), r(3, 8, dt=torch.float32), r(3, 8, dt=torch.float32))
    fwd_bwd(activations.swiglu, r(4, 80), r(4, 80))
    fwd_bwd(activations.geglu, r(4, 80), r(4, 80))
    fwd_bwd(activations.swiglu_packed, r(4, 160))
    fwd_bwd(activations.geglu_packed, r(4, 160))
    fwd_bwd(activations.bias_gelu, r(4, 80), r(80))
    fwd_bwd(activations.bias_gelu, r(4, 80), None)
    target = torch.randint(0, 50, (4,), device="cpu")
    fwd_bwd(vocab_cross_entropy.cross_entropy, r(4, 64), target, -100, 0.1, 50)
    fwd_bwd(vocab_cross_entropy.cross_entropy, r(4, 64), target, -100, 0.0, 50, None, False, 0.01)  # z-loss
    # the FP8 casts: every scale axis, both formats, both layouts (the transposed one padded), the fused row amax
    x = r(40, 64)
    for fmt in (torch.float8_e4m3fn, torch.float8_e5m2):
        for mode, amax in (("tensor", r(())), ("rows", r(40, 1)), ("cols", r(1, 64))):
            float8.cast(x, amax, fmt, mode, mode != "tensor", want_q=True, want_t=True, pad=16)
            float8.cast(x, amax, fmt, mode, mode != "tensor", want_q=False, want_t=True, pad=16)
            float8.cast(x, amax, fmt, mode, mode != "tensor", want_q=True, want_t=False)
        float8.cast_rows(x, fmt, True)
    # the fused head: the same kernels on chunks of logits (the gradient written into the chunk)
    fwd_bwd(lambda h, w: fused_linear_cross_entropy.linear_cross_entropy(
        h, w, target, label_smoothing=0.1, z_loss=0.01, vocab_size=50, chunk_rows=3, kernels=vocab_cross_entropy),
        r(4, 16), r(64, 16))


def _signature(kernel, args, kwargs) -> tuple[dict, dict]:
    constexprs = {k: v for k, v in kwargs.items() if k not in ("num_warps", "num_stages")}
    values = iter(args)
    signature = {}
    for p in kernel.params:
        if p.is_constexpr:
            signature[p.name] = "constexpr"
            continue
        v = next(values)
        if isinstance(v, torch.Tensor):
            signature[p.name] = "*" + _DTYPES[v.dtype]
        elif isinstance(v, bool):
            signature[p.name] = "i1"
        elif isinstance(v, int):
            signature[p.name] = "i32" if -(2 ** 31) <= v < 2 ** 31 else "i64"
        else:
            signature[p.name] = "fp32"
    return signature, constexprs


def compile_all(arch: int = 90, dtypes=(torch.bfloat16, torch.float32)) -> list[str]:
    """Compile each distinct launch of the wrappers for CUDA compute capability `arch`; returns their names.
    Raises whatever the Triton compiler raises (a compiled-mode bug)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    with launch.recording() as calls:
        for dtype in dtypes:
            _exercise(dtype)
    done: dict[str, None] = {}
    for kernel, _grid, args, kwargs in calls:
        if not isinstance(kernel, triton.runtime.JITFunction):
            raise RuntimeError("the kernels were loaded under TRITON_INTERPRET=1; compile in a process without it")
        signature, constexprs = _signature(kernel, args, kwargs)
        key = f"{kernel.__name__}{sorted(signature.items())}{sorted(constexprs.items())}"
        if key in done:
            continue
        src = ASTSource(kernel, signature, constexprs=constexprs)
        triton.compile(src, target=GPUTarget("cuda", arch, 32), options={"num_warps": kwargs.get("num_warps", 4)})
        done[key] = None
    return list(done)
