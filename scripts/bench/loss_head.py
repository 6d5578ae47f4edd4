"""The LM head + loss: the fused linear cross-entropy (the default) against the unfused head (logits, then the
vocab-parallel cross-entropy), forward + backward time and peak memory, side by side in one run.

    python scripts/bench/loss_head.py                               # CPU: small shapes, fp32, torch kernels
    python scripts/bench/loss_head.py --write docs/benchmarks.md    # and (re)write its section there
    python scripts/bench/loss_head.py --device cuda                 # GPU: llama-3.2-1b and gemma-3-1b heads, bf16

One process, tp = 1: hidden states [tokens, h] and the head weight [vocab, h] as leaves, the per-token loss
summed and scaled as the training loss is (so the fused path takes its no-recomputation backward), label
smoothing 0.1. Variants alternate within each repetition. Peak memory: on CPU the most bytes the step's own
tensors hold at once (tpzoo.plan.measure.peak_live_bytes, independent of the allocator), beside tpzoo plan's
model of it (plan/head.py: what the head keeps plus its working set); on CUDA torch.cuda.max_memory_allocated
over what was allocated before the step. On CUDA the kernel backends are "auto" (Triton: the per-chunk
statistics and gradient kernels, and the unfused cross-entropy kernel) and "torch"; Liger's fused linear
cross-entropy is added when `liger_kernel` imports.
"""
from __future__ import annotations

import argparse
import os
import pathlib
import statistics
import sys
import time

import torch
import torch.nn.functional as F

from mdsection import write_section  # noqa: E402 (a sibling script module)

CPU_SHAPES = [("cpu-small", 1024, 256, 16384), ("cpu-small, 4x tokens", 4096, 256, 16384)]
GPU_SHAPES = [("llama-3.2-1b, micro 4 x 2048", 8192, 2048, 128256), ("gemma-3-1b, micro 4 x 2048", 8192, 1152, 262144)]


def _step(variant: str, h, w, t):
    """Forward + backward of the summed, scaled loss; returns nothing (gradients land in h.grad, w.grad)."""
    from tpzoo import kernels as K

    kind, backend = variant.split("/")
    with K.use_backend(backend if backend != "liger" else "torch"):
        if kind == "fused":
            loss = K.linear_cross_entropy(h, w, t, label_smoothing=0.1)
        elif kind == "unfused":
            loss = K.cross_entropy(F.linear(h, w), t, label_smoothing=0.1)
        else:  # liger
            from liger_kernel.transformers.functional import liger_fused_linear_cross_entropy

            loss = liger_fused_linear_cross_entropy(h, w, t, label_smoothing=0.1, reduction="sum")
    (loss.sum() * (1.0 / t.numel())).backward()


def _run_once(variant, h, w, t, device, instrumented: bool):
    """(seconds, peak bytes or None) of one forward + backward."""
    from tpzoo.plan.measure import peak_live_bytes

    h.grad = w.grad = None
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        t0 = time.perf_counter()
        _step(variant, h, w, t)
        torch.cuda.synchronize()
        return time.perf_counter() - t0, torch.cuda.max_memory_allocated() - base
    t0 = time.perf_counter()
    if not instrumented:
        _step(variant, h, w, t)
        return time.perf_counter() - t0, None
    with peak_live_bytes() as r:
        _step(variant, h, w, t)
    return time.perf_counter() - t0, r.peak


def _measure(variants, h, w, t, device, reps) -> dict:
    """{variant: (timed seconds, peak bytes)}; the variants alternate within each repetition, so drift on a
    shared machine hits all alike. Repetition 0 is the warm-up (on CPU, the memory-instrumented run)."""
    times, peaks = {v: [] for v in variants}, {}
    for rep in range(reps + 1):
        for v in variants:
            elapsed, peak = _run_once(v, h, w, t, device, instrumented=rep == 0)
            if peak is not None:
                peaks[v] = max(peaks.get(v, 0), peak)
            if rep:
                times[v].append(elapsed)
    return {v: (times[v], peaks[v]) for v in variants}


def plan_bytes(tokens: int, hidden: int, vocab: int, e: int, fused: bool, kernels: str) -> int:
    """tpzoo plan's model of the same step: what the head and loss keep (less the final norm and the input,
    which this benchmark makes outside) plus their working set, plus the per-token loss the caller holds."""
    from tpzoo.models.config import ModelConfig
    from tpzoo.plan import RankLayout
    from tpzoo.plan.head import head_activation_bytes, head_transient_bytes

    cfg = ModelConfig.from_dict(dict(family="llama", vocab_size=vocab, hidden_size=hidden, num_layers=1,
                                     num_heads=1, ffn_hidden_size=hidden))
    at = RankLayout(act_bytes=e, kernels=kernels)
    kept = head_activation_bytes(cfg, at, tokens, fused, 0) - e * hidden * tokens - 4
    return kept + head_transient_bytes(cfg, at, tokens, fused) + 4 * tokens


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu", help="cpu (default) or cuda")
    parser.add_argument("--reps", type=int, default=None, help="timed repetitions (default: 3 on CPU, 10 on CUDA)")
    parser.add_argument("--write", type=pathlib.Path, help="markdown file whose loss_head section to (re)write")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    cuda = device.type == "cuda"
    if cuda and not torch.cuda.is_available():
        raise SystemExit("loss_head.py: --device cuda but CUDA is not available")
    dtype = torch.bfloat16 if cuda else torch.float32
    reps = args.reps or (10 if cuda else 3)
    shapes = GPU_SHAPES if cuda else CPU_SHAPES
    variants = ["fused/auto", "unfused/auto", "fused/torch", "unfused/torch"] if cuda else ["fused/torch",
                                                                                           "unfused/torch"]
    if cuda:
        try:
            import liger_kernel  # noqa: F401
            variants.append("liger/liger")
        except ImportError:
            pass
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    rows = []
    t_start = time.perf_counter()
    for name, tokens, hidden, vocab in shapes:
        g = torch.Generator(device="cpu").manual_seed(0)
        h = (torch.randn(tokens, hidden, generator=g) * 0.5).to(device, dtype).requires_grad_()
        w = (torch.randn(vocab, hidden, generator=g) * 0.02).to(device, dtype).requires_grad_()
        t = torch.randint(0, vocab, (tokens,), generator=g).to(device)
        results = _measure(variants, h, w, t, device, reps)
        base = statistics.median(results["unfused/torch"][0])
        for v, (times, peak) in results.items():
            kind, backend = v.split("/")
            modeled = "reference" if backend == "torch" else "fused"
            est = "" if kind == "liger" else format(
                plan_bytes(tokens, hidden, vocab, dtype.itemsize, kind == "fused", modeled) / 2**20, ".1f")
            rows.append(f"| {name} | {tokens} x {hidden} -> {vocab} | {kind} | {backend} | "
                        f"{statistics.median(times) * 1e3:.1f} | {statistics.median(times) / base:.2f} | "
                        f"{peak / 2**20:.1f} | {est} |")
        del h, w, t
    elapsed = time.perf_counter() - t_start
    where = (torch.cuda.get_device_name(device) if cuda else f"the 2-core CPU machine, {torch.get_num_threads()} "
             f"torch threads, load average {load:.1f} before the run")
    shared = "" if cuda else ("; other jobs share the cores, so compare the rows of one shape: the memory columns "
                              "are the robust numbers")
    body = (f"## LM head + loss: fused linear cross-entropy vs logits + cross-entropy "
            f"({'GPU' if cuda else 'CPU'})\n\n"
            f"Command: `python scripts/bench/loss_head.py{' --device cuda' if cuda else ''}"
            f"{f' --reps {args.reps}' if args.reps else ''} --write docs/benchmarks.md` ({where}; {dtype}, tp = 1, "
            f"label smoothing 0.1, the summed loss scaled as in training; median of {reps} forward + backward after "
            f"one warm-up, variants alternating; {elapsed:.0f} s in all{shared}). Peak: "
            + ("torch.cuda.max_memory_allocated over the memory before the step."
               if cuda else "the most bytes the step's tensors hold at once (tpzoo.plan.measure.peak_live_bytes), "
                            "beside tpzoo plan's model of it (plan/head.py). The fused path's default chunk is "
                            "2 x hidden tokens. The plan models the unfused head's working set as the logits' "
                            "gradient (what the Triton kernels allocate); the torch reference's forward also "
                            "holds its shifted fp32 logits for a moment (4 x tokens x vocab bytes), which the "
                            "plan leaves out: the gap in the unfused rows.")
            + "\n\n| shape | tokens x hidden -> vocab | head + loss | kernels | fwd+bwd ms (median) | vs unfused "
              "torch | peak MiB | plan's estimate MiB |\n|---|---|---|---|---|---|---|---|\n" + "\n".join(rows))
    if not cuda:
        body += ("\n\nGPU (`--device cuda`: llama-3.2-1b's and gemma-3-1b's heads at 8192 tokens, bf16, Triton and "
                 "torch per-chunk kernels, Liger when installed): **not measured yet** (no GPU in this session).")
    print(body)
    if args.write:
        write_section(args.write, "loss_head_cuda" if cuda else "loss_head", body)


if __name__ == "__main__":
    sys.exit(main())
