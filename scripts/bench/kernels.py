"""Benchmark tpzoo.kernels: the Triton kernels against eager torch (the references) and torch.compile of the
references: forward and forward+backward time, peak extra memory, and achieved bandwidth against the device's
measured copy bandwidth.

    python scripts/bench/kernels.py                       # every kernel, bf16, Llama-3-8B-like shapes
    python scripts/bench/kernels.py --only rms_norm cross_entropy --tokens 4096 --dtype fp32
    python scripts/bench/kernels.py --no-compile          # skip the torch.compile column

Needs a CUDA device. Without one it says so, runs a tiny CPU sanity check (each kernel in Triton's
interpreter against its reference, when Triton is installed) and exits 0.

Bandwidth counts the bytes a fused kernel must move (read its inputs, write its outputs, once); GB/s of the
eager and compiled columns use the same byte count, so the columns compare time, not traffic.
"""
from __future__ import annotations

import argparse
import os
import sys

import torch

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
KERNELS = ("rms_norm", "layer_norm", "apply_rotary", "swiglu", "swiglu_packed", "bias_gelu", "cross_entropy")


def make_case(name: str, a, device, dtype, gen):
    """(function of the grad-requiring inputs, those inputs, incoming gradient, bytes fwd, bytes fwd+bwd)."""
    from tpzoo import kernels as K

    r = lambda *shape, dt=dtype: torch.randn(*shape, device=device, dtype=dt, generator=gen)  # noqa: E731
    t, h, e = a.tokens, a.hidden, torch.tensor([], dtype=dtype).element_size()
    if name == "rms_norm":
        x, w = r(t, h), r(h)
        return (lambda x, w: K.rms_norm(x, w, 1e-6)), [x, w], r(t, h), 2 * t * h * e, 5 * t * h * e
    if name == "layer_norm":
        x, w, b = r(t, h), r(h), r(h)
        return (lambda x, w, b: K.layer_norm(x, w, b, 1e-5)), [x, w, b], r(t, h), 2 * t * h * e, 5 * t * h * e
    if name == "apply_rotary":
        s = a.seq
        x = r(t // s, s, a.heads, a.head_dim)
        ang = torch.arange(s, device=device, dtype=torch.float32)[:, None] * r(a.head_dim // 2, dt=torch.float32)
        cos, sin = ang.cos(), ang.sin()
        n = x.numel() * e
        return (lambda x: K.apply_rotary(x, cos, sin)), [x], torch.randn_like(x), 2 * n, 4 * n
    if name == "swiglu":
        g, u = r(t, a.ffn), r(t, a.ffn)
        n = t * a.ffn * e
        return K.swiglu, [g, u], r(t, a.ffn), 3 * n, 8 * n
    if name == "swiglu_packed":  # gate|up as the MLP passes it: one packed gradient, no cat
        n = t * a.ffn * e
        return K.swiglu_packed, [r(t, 2 * a.ffn)], r(t, a.ffn), 3 * n, 8 * n
    if name == "bias_gelu":
        x, b = r(t, a.ffn), r(a.ffn)
        n = t * a.ffn * e
        return K.bias_gelu, [x, b], r(t, a.ffn), 2 * n, 5 * n
    if name == "cross_entropy":
        z = r(t, a.vocab_shard)
        target = torch.randint(0, a.vocab_shard, (t,), device=device, generator=gen)
        n = t * a.vocab_shard * e
        return (lambda z: K.cross_entropy(z, target, label_smoothing=0.1)), [z], r(t, dt=torch.float32), n, 3 * n
    raise ValueError(name)


def bench_one(fn, inputs, dy, backend: str, compiled: bool):
    """(ms fwd, ms fwd+bwd, peak extra MiB of fwd+bwd) of fn on inputs under a kernel backend."""
    import triton.testing
    from tpzoo import kernels as K

    leaves = [x.detach().requires_grad_() for x in inputs]
    call = torch.compile(fn) if compiled else fn

    def fwd():
        with torch.no_grad(), K.use_backend(backend):
            return call(*leaves)

    def fwd_bwd():
        with K.use_backend(backend):
            out = call(*leaves)
        torch.autograd.grad(out, leaves, dy)

    fwd_bwd()  # compile / warm up outside the timings
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    fwd_bwd()
    torch.cuda.synchronize()
    peak = (torch.cuda.max_memory_allocated() - base) / 2**20
    return triton.testing.do_bench(fwd), triton.testing.do_bench(fwd_bwd), peak


def copy_bandwidth(device) -> float:
    """GB/s of a large device-to-device copy (read + write): the practical ceiling for these kernels."""
    import triton.testing

    src = torch.empty(2**28, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    ms = triton.testing.do_bench(lambda: dst.copy_(src))
    return 2 * src.numel() / ms / 1e6


def run_gpu(a) -> None:
    device = torch.device("cuda")
    dtype = DTYPES[a.dtype]
    gen = torch.Generator(device=device).manual_seed(0)
    peak_bw = copy_bandwidth(device)
    print(f"# {torch.cuda.get_device_name(device)}, {a.dtype}, tokens={a.tokens} hidden={a.hidden} ffn={a.ffn} "
          f"heads={a.heads}x{a.head_dim} vocab_shard={a.vocab_shard}; measured copy bandwidth {peak_bw:.0f} GB/s\n")
    print("| kernel | impl | fwd ms | fwd+bwd ms | fwd GB/s | fwd+bwd GB/s | % of copy bw | peak extra MiB |")
    print("|---|---|---|---|---|---|---|---|")
    impls = [("triton", "triton", False), ("eager", "torch", False), ("auto", "auto", False)]  # auto: measured
    if not a.no_compile:
        impls.append(("compile", "torch", True))
    for name in a.only or KERNELS:
        fn, inputs, dy, bytes_fwd, bytes_all = make_case(name, a, device, dtype, gen)
        for label, backend, compiled in impls:
            try:
                t_f, t_fb, mem = bench_one(fn, inputs, dy, backend, compiled)
            except Exception as exc:  # noqa: BLE001 - one failing column should not end the table
                print(f"| {name} | {label} | failed: {type(exc).__name__}: {str(exc)[:60]} | | | | | |")
                continue
            bw_f, bw_fb = bytes_fwd / t_f / 1e6, bytes_all / t_fb / 1e6
            print(f"| {name} | {label} | {t_f:.3f} | {t_fb:.3f} | {bw_f:.0f} | {bw_fb:.0f} | "
                  f"{100 * bw_fb / peak_bw:.0f}% | {mem:.0f} |")
        del fn, inputs, dy
        torch.cuda.empty_cache()


def cpu_sanity() -> int:
    """Each kernel once in Triton's interpreter on tiny shapes, against its reference."""
    os.environ["TRITON_INTERPRET"] = "1"  # before the Triton kernels load (nothing has loaded them yet)
    from tpzoo import kernels as K

    if not K.triton_available():
        print("Triton is not installed: nothing to check on CPU.")
        return 0
    g = torch.Generator().manual_seed(0)
    r = lambda *s: torch.randn(*s, generator=g)  # noqa: E731
    x, w, cos, sin = r(4, 3, 2, 16), r(16), r(3, 8), r(3, 8)
    target = torch.randint(0, 16, (4, 3), generator=g)
    cases = {
        "rms_norm": lambda: K.rms_norm(x, w, 1e-6), "layer_norm": lambda: K.layer_norm(x, w, w, 1e-5),
        "apply_rotary": lambda: K.apply_rotary(x, cos, sin), "swiglu": lambda: K.swiglu(x, x * 0.5),
        "swiglu_packed": lambda: K.swiglu_packed(x),
        "bias_gelu": lambda: K.bias_gelu(x, w), "cross_entropy": lambda: K.cross_entropy(x[:, :, 0], target),
    }
    worst = 0.0
    for name, call in cases.items():
        with K.use_backend("triton"):
            got = call()
        with K.use_backend("torch"):
            ref = call()
        err = (got - ref).abs().max().item()
        worst = max(worst, err)
        print(f"  {name:14s} max |triton - torch| = {err:.2e}")
    print("CPU sanity check " + ("passed" if worst < 1e-4 else "FAILED"))
    return 0 if worst < 1e-4 else 1


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--only", nargs="+", choices=KERNELS)
    p.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    p.add_argument("--tokens", type=int, default=8192, help="rows: batch * sequence")
    p.add_argument("--seq", type=int, default=2048, help="sequence length (rotary)")
    p.add_argument("--hidden", type=int, default=4096)
    p.add_argument("--ffn", type=int, default=14336)
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--vocab-shard", type=int, default=32064, help="vocab per TP rank (128256 / 4)")
    p.add_argument("--no-compile", action="store_true", help="skip the torch.compile column")
    a = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("No CUDA device: the kernel benchmark needs a GPU. Running the CPU sanity check instead.")
        return cpu_sanity()
    if a.tokens % a.seq:
        p.error("--tokens must be a multiple of --seq")
    run_gpu(a)
    return 0


if __name__ == "__main__":
    sys.exit(main())
