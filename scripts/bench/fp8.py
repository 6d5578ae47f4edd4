"""FP8 training (tpzoo.parallel.fp8) against bf16 on the same device: tokens/s of whole training steps and the loss
after N steps, bf16 and the two FP8 recipes side by side, one process, tp = 1.

    python scripts/bench/fp8.py                                   # CPU: a toy llama, fp32, the emulated FP8
    python scripts/bench/fp8.py --write docs/benchmarks.md        # and (re)write its section there
    python scripts/bench/fp8.py --device cuda --write docs/benchmarks.md
                                # GPU: llama-3.2-3b and llama-3-8b cut to 8 layers, bf16, 200 steps of 2 x 2048

A step is what the trainer runs: forward_backward, finalize_grads, DistributedAdamW (fp32 master weights, main
gradients and moments; bf16 weights on the GPU), clipping at 1.0, lr 3e-4 after 20 warm-up steps. Every variant
starts from the same weights (seed 0) and trains on the same batches: windows of the bytes of the Python standard
library's .py files (ids < 256; a learnable stream, so the losses mean something). Tokens/s counts the steps
after --warmup (FP8's compiled casts and the first GEMMs are warmed up there); loss = the mean of the last 10
steps' losses. On CUDA the peak is torch.cuda.max_memory_allocated. `--casts torch`: FP8 with the casts as the
torch reference (several eager passes per cast) instead of the fused Triton kernels, to see what fusing them is
worth. `--compile`: every variant's transformer blocks compiled (tpzoo.train.compile; the FP8 projections stay
eager with their own kernels).
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import pathlib
import statistics
import sys
import sysconfig
import time

import torch

from mdsection import write_section  # noqa: E402 (a sibling script module)

GPU_MODELS = ("llama-3.2-3b", "llama-3-8b-8l")
CPU_MODELS = ("toy-llama",)


def model_config(name: str):
    from tpzoo.models import ModelConfig, get_config

    if name == "toy-llama":  # every projection's dims a multiple of 16, small enough for a few CPU steps
        return ModelConfig.from_dict(dict(family="llama", vocab_size=512, hidden_size=256, num_layers=4,
                                          num_heads=4, num_kv_heads=2, ffn_hidden_size=768,
                                          max_position_embeddings=1024, name="toy-llama"))
    if name == "llama-3-8b-8l":  # llama-3-8b's shapes, 8 of its 32 layers: one GPU holds it with AdamW
        return get_config("llama-3-8b").replace(num_layers=8, name="llama-3-8b-8l")
    return get_config(name)


def corpus() -> torch.Tensor:
    """The bytes of the standard library's .py files, in a fixed order, as token ids."""
    lib = pathlib.Path(sysconfig.get_paths()["stdlib"])
    data = b"".join(p.read_bytes() for p in sorted(lib.glob("*.py")))
    return torch.frombuffer(bytearray(data), dtype=torch.uint8).long()


def batch(data: torch.Tensor, step: int, micro: int, seq: int, device) -> dict:
    g = torch.Generator().manual_seed(1000 + step)
    starts = torch.randint(0, data.numel() - seq - 1, (micro,), generator=g)
    ids = torch.stack([data[s: s + seq + 1] for s in starts.tolist()])
    return {"input_ids": ids[:, :-1].to(device), "labels": ids[:, 1:].to(device)}


def run_case(name: str, variant: str, args, data) -> dict:
    import tpzoo
    from tpzoo.parallel import fp8
    from tpzoo.pipeline import build_model_chunks, finalize_grads, forward_backward
    from tpzoo.train.lr import lr_at
    from tpzoo.train.optim import DistributedAdamW

    from tpzoo import kernels
    from tpzoo.train.compile import compile_blocks

    cfg = model_config(name)
    dims = tpzoo.init_parallel(tp=1, device=args.device)
    cuda = dims.device.type == "cuda"
    kernels.use_backend(None if args.casts == "auto" else args.casts, kernel="fp8_cast")
    try:
        chunks = build_model_chunks(cfg, dims, seed=0)
        report = fp8.enable_fp8(chunks, variant)
        if args.compile:
            compile_blocks(chunks)
        opt = DistributedAdamW([p for c in chunks for p in c.parameters()], dims, model_dtype=args.dtype,
                               betas=(0.9, 0.95), weight_decay=0.1)
        if cuda:
            # The previous case's parameters and main gradients live on in a reference cycle (a parameter and
            # its GradBuffer) until Python's cyclic GC runs: without this its 6 bytes per parameter counted in
            # this case's peak (what made FP8's peak look 4-31 GiB higher, issue 26's first measurement).
            gc.collect()
            torch.cuda.empty_cache()
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        losses, times = [], []
        for step in range(args.steps):
            b = batch(data, step, args.micro_batch, args.seq_len, dims.device)
            t0 = time.perf_counter()
            opt.zero_grad()
            out = forward_backward(chunks, [b], dims, loss_scale=1.0 / b["labels"].numel())
            finalize_grads(chunks, dims)
            opt.reduce_grads()
            norm, _ = opt.global_grad_norm()
            lr = lr_at(step, lr=args.lr, min_lr=args.lr / 10, warmup_steps=20, total_steps=args.steps)
            opt.step(lr, min(1.0, 1.0 / (norm + 1e-6)))
            if cuda:
                torch.cuda.synchronize()
            times.append(time.perf_counter() - t0)
            losses.append(out["loss_sum"] / b["labels"].numel())
        if args.profile:  # where one more step's time goes: the top kernels and the host's share
            from torch.profiler import ProfilerActivity, profile

            acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
            with profile(activities=acts) as prof:
                b = batch(data, 0, args.micro_batch, args.seq_len, dims.device)
                opt.zero_grad()
                forward_backward(chunks, [b], dims, loss_scale=1.0 / b["labels"].numel())
                if cuda:
                    torch.cuda.synchronize()
            key = "self_cuda_time_total" if cuda else "self_cpu_time_total"
            print(f"PROFILE {name} {variant}\n" + prof.key_averages().table(sort_by=key, row_limit=args.profile),
                  flush=True)
        timed = times[args.warmup:]
        tokens = args.micro_batch * args.seq_len
        return {"model": name, "variant": variant, "fp8_layers": len(report.fp8_layers),
                "fallbacks": len(report.fallbacks), "tokens_per_s": tokens * len(timed) / sum(timed),
                "step_ms_median": 1e3 * statistics.median(timed), "loss_first": losses[0],
                "loss_last10": sum(losses[-10:]) / len(losses[-10:]), "steps": args.steps,
                "peak_gib": torch.cuda.max_memory_allocated() / 2**30 if cuda else None,
                "warmup_s": sum(times[:args.warmup])}
    finally:
        tpzoo.destroy_parallel()
        if cuda:
            torch.cuda.empty_cache()


def table(results: list[dict]) -> str:
    base = {r["model"]: r for r in results if r["variant"] == "none"}
    lines = ["| model | matmuls | FP8 layers | tokens/s | vs model dtype | step ms (median) | loss, first | "
             "loss, last 10 steps | vs model dtype | peak GiB |", "|---|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        b = base.get(r["model"])
        speed = f"{r['tokens_per_s'] / b['tokens_per_s']:.2f}x" if b else ""
        loss = f"{100 * (r['loss_last10'] / b['loss_last10'] - 1):+.2f} %" if b else ""
        peak = f"{r['peak_gib']:.1f}" if r["peak_gib"] is not None else "-"
        label = {"none": "model dtype", "tensorwise": "FP8 tensorwise", "rowwise": "FP8 rowwise"}[r["variant"]]
        lines.append(f"| {r['model']} | {label} | {r['fp8_layers']} | {r['tokens_per_s']:,.0f} | {speed} | "
                     f"{r['step_ms_median']:.1f} | {r['loss_first']:.3f} | {r['loss_last10']:.4f} | {loss} | {peak} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cpu", help="cpu (default) or cuda")
    p.add_argument("--models", help=f"comma-separated (default: {','.join(CPU_MODELS)} on CPU, "
                                    f"{','.join(GPU_MODELS)} on CUDA)")
    p.add_argument("--variants", default="none,tensorwise,rowwise", help="'none' (the model dtype) and FP8 recipes")
    p.add_argument("--steps", type=int, help="optimizer steps per case (default: 30 on CPU, 200 on CUDA)")
    p.add_argument("--warmup", type=int, default=5, help="first steps left out of the timing")
    p.add_argument("--seq-len", type=int, help="tokens per sequence (default: 128 on CPU, 2048 on CUDA)")
    p.add_argument("--micro-batch", type=int, default=2, help="sequences per step (one micro-batch)")
    p.add_argument("--lr", type=float, default=3e-4)
    p.add_argument("--casts", choices=("auto", "triton", "torch"), default="auto",
                   help="the FP8 casts: auto (the Triton kernels on CUDA), or forced (torch: the eager reference)")
    p.add_argument("--compile", action="store_true", help="compile every variant's transformer blocks")
    p.add_argument("--profile", type=int, default=0, help="after each case, profile one forward + backward and "
                                                          "print this many top ops")
    p.add_argument("--jsonl", type=pathlib.Path, help="append each case's result to this file as it finishes")
    p.add_argument("--write", type=pathlib.Path, help="markdown file whose fp8 section to (re)write")
    p.add_argument("--section", help="the section's name (default: fp8_cuda on CUDA, fp8 on CPU)")
    args = p.parse_args(argv)
    cuda = args.device.startswith("cuda")
    if cuda and not torch.cuda.is_available():
        raise SystemExit("fp8.py: --device cuda but CUDA is not available")
    args.dtype = torch.bfloat16 if cuda else torch.float32
    args.steps = args.steps or (200 if cuda else 30)
    args.seq_len = args.seq_len or (2048 if cuda else 128)
    models = args.models.split(",") if args.models else list(GPU_MODELS if cuda else CPU_MODELS)
    data = corpus()
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    results, t_start = [], time.perf_counter()
    for name in models:
        for variant in args.variants.split(","):
            try:
                r = run_case(name, variant, args, data)
            except Exception as exc:  # noqa: BLE001 - one failed case must not lose the others' numbers
                import traceback

                traceback.print_exc()
                r = {"model": name, "variant": variant, "error": f"{type(exc).__name__}: {exc}"}
            else:
                results.append(r)
            print(json.dumps(r), flush=True)
            if args.jsonl:
                with args.jsonl.open("a") as f:
                    f.write(json.dumps(r) + "\n")
    elapsed = time.perf_counter() - t_start
    where = (f"{torch.cuda.get_device_name()}, torch {torch.__version__}" if cuda
             else f"the shared 2-core CPU machine, {torch.get_num_threads()} torch threads, torch {torch.__version__}, "
                  f"load average {load:.1f} before the run: other jobs share the cores, so compare rows, not runs")
    cmd = " ".join(["python scripts/bench/fp8.py", *(argv if argv is not None else sys.argv[1:])])
    body = (f"## FP8 training vs {'bf16' if cuda else 'fp32'}: tokens/s and loss ({'GPU' if cuda else 'CPU'})\n\n"
            f"Command: `{cmd}` ({where}; tp = 1, one micro-batch of {args.micro_batch} x {args.seq_len} tokens per "
            f"step, {args.steps} steps from the same weights on the same batches, tokens/s over the steps after "
            f"the first {args.warmup}{f', {args.casts} casts' if args.casts != 'auto' else ''}"
            f"{', blocks compiled' if args.compile else ''}; {elapsed:.0f} s in all).\n\n"
            + table(results))
    if not cuda:
        body += ("\n\nOn the CPU FP8 is emulated (the same casts, the GEMM in fp64): it can only be slower; this run "
                 "shows the path works end to end and how far the emulated numerics move the loss. GPU "
                 "(`--device cuda`: llama-3.2-3b and llama-3-8b cut to 8 layers, bf16 weights, 200 steps of 2 x "
                 "2048 tokens; the goal is >= 1.3x bf16 tokens/s with the loss within 1 %): see the GPU section.")
    print(body)
    if args.write:
        write_section(args.write, args.section or ("fp8_cuda" if cuda else "fp8"), body)
    return 0


if __name__ == "__main__":
    sys.exit(main())
