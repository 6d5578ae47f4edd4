"""The training step at the hardware limit (issue 24): tpzoo against transformers, side by side in one process.

    python scripts/bench/gpu_step.py                                   # llama-3.2-1b, bf16, micro 4 x seq 2048
    python scripts/bench/gpu_step.py --model qwen3-1.7b --micro 4 --seq 2048 --profile --kernels
    python scripts/bench/gpu_step.py --device cpu --model nano-llama --micro 2 --seq 64 --steps 2 --warmup 1

Implementations (every one: forward, backward, global-norm clipping to 1.0, AdamW lr 1e-4 betas (0.9, 0.95)
weight decay 0.1, on the same random token batches of one model config):
    tpzoo              bf16 weights, fp32 master weights and fp32 main gradients (DistributedAdamW: 18 bytes per
                       parameter), gradient-accumulation fusion, kernels as `auto` picks them
    tpzoo-unfused      the same with --no-grad-accumulation-fusion (the fusion's own effect)
    tpzoo-compile      tpzoo with its transformer blocks compiled (`--compile`: tpzoo.train.compile)
    hf-bf16            transformers, bf16 weights and gradients, torch.optim.AdamW (fused on CUDA)
    hf-autocast        transformers, fp32 weights, bf16 autocast
    hf-compile         hf-bf16 with torch.compile(model)
    hf-liger           hf-bf16 with Liger's kernels (liger_kernel.transformers.apply_liger_kernel_to_<family>),
                       only when liger_kernel imports; last, since Liger patches the transformers classes

Reported per implementation: tokens/s (median step after warm-up), MFU (ModelConfig.flops_per_token against the
device's dense bf16 peak, tpzoo.train.metrics.peak_tflops: 989 TFLOP/s on H100/H200), peak memory (CUDA allocator,
reset per implementation; not measured on CPU), the last loss (all start near ln(vocab)). --profile adds
torch.profiler's split of tpzoo's step by category (matmul, attention, optimizer, norms, elementwise, copies,
communication); --kernels adds scripts/bench/kernels.py at the same token count. --write puts the table into a
markdown file (section gpu_step).
"""
from __future__ import annotations

import argparse
import gc
import importlib
import json
import math
import os
import statistics
import subprocess
import sys
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
IMPLS = ("tpzoo", "tpzoo-unfused", "tpzoo-compile", "hf-bf16", "hf-autocast", "hf-compile", "hf-liger")
LIGER = {"llama": "llama", "qwen3": "qwen3", "qwen2": "qwen2", "gemma3": "gemma3_text", "gemma2": "gemma2",
         "mistral": "mistral", "olmo2": "olmo2", "phi3": "phi3"}


def batches(cfg, args, device):
    g = torch.Generator().manual_seed(0)
    return [torch.randint(0, cfg.vocab_size, (args.micro, args.seq + 1), generator=g).to(device)
            for _ in range(args.warmup + args.steps)]


def sync(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed_steps(step, data, device) -> tuple[list[float], float]:
    """Run step(ids) on every batch; (seconds per step, last loss)."""
    times, loss = [], float("nan")
    for ids in data:
        sync(device)
        t0 = time.perf_counter()
        loss = step(ids)
        sync(device)
        times.append(time.perf_counter() - t0)
    return times, float(loss)


def tpzoo_step(cfg, args, device, impl: str):
    import tpzoo
    from tpzoo.pipeline import build_model_chunks, finalize_grads, forward_backward, materialize_chunks
    from tpzoo.train.compile import compile_blocks
    from tpzoo.train.optim import DistributedAdamW

    fusion = impl != "tpzoo-unfused"
    dims = tpzoo.init_parallel(tp=1, device=device)
    chunks = build_model_chunks(cfg, dims, device="meta")
    materialize_chunks(chunks, dims.device, init=True)  # fp32, cast to bf16 by the optimizer (fp32 master)
    if impl == "tpzoo-compile":
        compile_blocks(chunks)
    opt = DistributedAdamW([p for c in chunks for p in c.parameters()], dims, model_dtype=torch.bfloat16,
                           betas=(0.9, 0.95), weight_decay=0.1, grad_accumulation_fusion=fusion)

    def step(ids):
        batch = {"input_ids": ids[:, :-1], "labels": ids[:, 1:]}
        opt.zero_grad()
        out = forward_backward(chunks, [batch], dims, loss_scale=1.0 / batch["labels"].numel())
        finalize_grads(chunks, dims)
        opt.reduce_grads()
        norm, _ = opt.global_grad_norm()
        opt.step(1e-4, min(1.0, 1.0 / (norm + 1e-6)))
        return out["loss_sum"] / batch["labels"].numel()

    return step, tpzoo.destroy_parallel


def hf_step(cfg, args, device, impl: str):
    from transformers import AutoConfig, AutoModelForCausalLM

    from tpzoo.models import to_hf_config

    if impl == "hf-liger":
        liger = importlib.import_module("liger_kernel.transformers")
        getattr(liger, f"apply_liger_kernel_to_{LIGER[cfg.family]}")()
    hf_cfg = AutoConfig.for_model(**to_hf_config(cfg))
    dtype = torch.float32 if impl == "hf-autocast" else torch.bfloat16
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(hf_cfg, dtype=dtype).to(device)
    model.train()
    decay = [p for p in model.parameters() if p.dim() >= 2]
    rest = [p for p in model.parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}],
                            lr=1e-4, betas=(0.9, 0.95), fused=device.type == "cuda")
    forward = torch.compile(model) if impl == "hf-compile" else model
    autocast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=impl == "hf-autocast")

    def step(ids):
        opt.zero_grad(set_to_none=True)
        with autocast:
            loss = forward(input_ids=ids[:, :-1], labels=ids[:, :-1]).loss  # HF shifts the labels itself
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        return loss.detach()

    return step, lambda: None


def available(impl: str, cfg) -> str | None:
    """None when `impl` can run here, else why not."""
    if impl == "hf-liger":
        if importlib.util.find_spec("liger_kernel") is None:
            return "liger_kernel is not installed"
        if cfg.family not in LIGER:
            return f"no Liger patch for family {cfg.family}"
    return None


def run(impl: str, cfg, args, device) -> dict:
    why = available(impl, cfg)
    if why:
        return {"impl": impl, "skipped": why}
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
    make = tpzoo_step if impl.startswith("tpzoo") else hf_step
    t0 = time.perf_counter()
    try:
        step, close = make(cfg, args, device, impl)
    except Exception as exc:  # noqa: BLE001 - one implementation failing (a Liger patch, say) keeps the others
        return {"impl": impl, "skipped": f"failed: {type(exc).__name__}: {str(exc).splitlines()[0][:200]}"}
    try:
        times, loss = timed_steps(step, batches(cfg, args, device), device)
        profiled = args.profile and impl in ("tpzoo", "tpzoo-compile")
        prof = profile_step(step, batches(cfg, args, device)[:2], device) if profiled else None
    except Exception as exc:  # noqa: BLE001
        return {"impl": impl, "skipped": f"failed: {type(exc).__name__}: {str(exc).splitlines()[0][:200]}"}
    finally:
        close()
    step_s = statistics.median(times[args.warmup:])
    out = {"impl": impl, "step_s": step_s, "tokens_per_s": args.micro * args.seq / step_s, "loss": loss,
           "peak_gib": torch.cuda.max_memory_allocated(device) / 2 ** 30 if device.type == "cuda" else None,
           "profile": prof, "first_step_s": times[0], "total_s": time.perf_counter() - t0}
    del step
    gc.collect()
    return out


CATEGORIES = (("communication", ("nccl", "all_reduce", "allreduce", "all_gather", "reduce_scatter", "gloo")),
              ("attention", ("flash", "fmha", "attention", "sdpa", "cudnn")),
              ("optimizer", ("adam",)),
              ("norms", ("norm", "_rms")),
              ("matmul", ("gemm", "mm", "matmul", "linear", "cutlass", "xmma", "sm90", "cublas")),
              ("copies", ("copy", "memcpy", "memset", "cat", "fill")))


def category(name: str) -> str:
    low = name.lower()
    for cat, keys in CATEGORIES:
        if any(k in low for k in keys):
            return cat
    return "elementwise"


def profile_step(step, data, device) -> dict:
    """Share of device time (CPU: of self CPU time of the ops) per category over len(data) steps."""
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=acts) as prof:
        for ids in data:
            step(ids)
        sync(device)
    totals: dict[str, float] = {}
    for e in prof.key_averages():
        t = e.self_device_time_total if device.type == "cuda" else (
            e.self_cpu_time_total if e.key.startswith("aten::") else 0.0)
        if t > 0:
            totals[category(e.key)] = totals.get(category(e.key), 0.0) + t
    whole = sum(totals.values()) or 1.0
    return {k: v / whole for k, v in sorted(totals.items(), key=lambda kv: -kv[1])}


def kernels_table(cfg, args, device) -> str:
    """scripts/bench/kernels.py at this model's shapes and token count (its markdown tables; on CPU its
    interpreter check)."""
    cmd = [sys.executable, os.path.join(HERE, "kernels.py"), "--no-compile", "--tokens", str(args.micro * args.seq),
           "--seq", str(args.seq), "--hidden", str(cfg.hidden_size), "--ffn", str(cfg.ffn_hidden_size),
           "--heads", str(cfg.num_heads), "--head-dim", str(cfg.head_dim), "--vocab-shard", str(cfg.vocab_size)]
    env = dict(os.environ, **({"TRITON_INTERPRET": "1"} if device.type != "cuda" else {}))
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith(("|", "#")) or "sanity" in ln]
    return "\n".join(lines) or proc.stdout[-2000:] + proc.stderr[-2000:]


def report(cfg, args, device, rows, kernels: str | None) -> str:
    from tpzoo.train.metrics import peak_tflops

    peak = peak_tflops("bf16", torch.cuda.get_device_name(device)) if device.type == "cuda" else None
    where = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    flops = cfg.flops_per_token(args.seq)
    cmd = " ".join(["python scripts/bench/gpu_step.py", *sys.argv[1:]])
    n = cfg.num_parameters()
    size = f"{n / 1e9:.2f} B" if n >= 1e8 else f"{n / 1e6:.2f} M"
    out = [f"Command: `{cmd}` on {where}. Model {cfg.name} ({size} parameters, "
           f"vocab {cfg.vocab_size}), micro-batch {args.micro} x seq {args.seq}, {args.steps} timed steps after "
           f"{args.warmup} warm-up (median step); MFU against {peak or 'n/a'} TFLOP/s dense bf16.", "",
           "| implementation | tokens/s | step | MFU | peak memory | last loss | first step |",
           "|---|---|---|---|---|---|---|"]
    best_hf = max((r["tokens_per_s"] for r in rows if "skipped" not in r and r["impl"] in ("hf-compile", "hf-liger")),
                  default=None)
    for r in rows:
        if "skipped" in r:
            out.append(f"| {r['impl']} | skipped: {r['skipped']} | | | | | |")
            continue
        mfu = f"{100 * r['tokens_per_s'] * flops / 1e12 / peak:.1f} %" if peak else "n/a"
        mem = f"{r['peak_gib']:.1f} GiB" if r["peak_gib"] is not None else "n/a (CPU)"
        out.append(f"| {r['impl']} | {r['tokens_per_s']:,.0f} | {r['step_s'] * 1e3:.0f} ms | {mfu} | {mem} | "
                   f"{r['loss']:.3f} | {r['first_step_s']:.1f} s |")
    for name in ("tpzoo", "tpzoo-compile"):
        tp = next((r for r in rows if r["impl"] == name and "skipped" not in r), None)
        if tp and best_hf:
            out += ["", f"{name} / best of transformers + torch.compile and + Liger: "
                        f"{tp['tokens_per_s'] / best_hf:.2f}x (goal: >= 1.15x, with --compile at >= 60 % MFU)."]
        if tp and tp.get("profile"):
            out += ["", f"{name} step by category (" + ("device time" if device.type == "cuda" else
                                                        "self CPU time of the ops") + "): " +
                    ", ".join(f"{k} {100 * v:.1f} %" for k, v in tp["profile"].items())]
    if device.type != "cuda":
        out += ["", f"On the CPU at toy size the times measure Python overhead and the machine's load (load average "
                    f"{os.getloadavg()[0]:.1f} at the end of the run), not the kernels: this run checks that every "
                    f"implementation runs and trains. GPU figures: pending (no GPU was lent to this session); on an "
                    f"H100/H200 run the default command (llama-3.2-1b, micro 4 x seq 2048) with --profile --kernels."]
    if kernels:
        out += ["", "Kernels at the same token count (scripts/bench/kernels.py):", "", kernels]
    return "\n".join(out)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="llama-3.2-1b", help="a registered config name")
    p.add_argument("--micro", type=int, default=4, help="sequences per step")
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--steps", type=int, default=10, help="timed steps")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--device", default="cuda")
    p.add_argument("--impls", nargs="+", choices=IMPLS, default=list(IMPLS))
    p.add_argument("--profile", action="store_true", help="tpzoo's step split by category (torch.profiler)")
    p.add_argument("--kernels", action="store_true", help="also run scripts/bench/kernels.py at these shapes")
    p.add_argument("--write", metavar="MD", help="write the report into this markdown file (section gpu_step)")
    p.add_argument("--section", default="gpu_step", help="the markdown section's name (default gpu_step)")
    p.add_argument("--jsonl", help="append each implementation's result to this file as it finishes")
    args = p.parse_args(argv)
    from tpzoo.models import get_config

    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("gpu_step: CUDA is not available; use --device cpu (with a toy model: --model nano-llama)")
    cfg = get_config(args.model)
    if args.seq > cfg.max_position_embeddings:
        raise SystemExit(f"gpu_step: --seq {args.seq} exceeds {cfg.name}'s {cfg.max_position_embeddings} positions")
    rows = []
    for impl in sorted(args.impls, key=IMPLS.index):  # Liger last: it patches transformers for the process
        r = run(impl, cfg, args, device)
        if args.jsonl:  # as each finishes: a run cut short keeps what it measured
            with open(args.jsonl, "a") as f:
                f.write(json.dumps({k: v for k, v in r.items() if k != "profile"} | {"model": cfg.name}) + "\n")
        print(f"{impl}: " + (r["skipped"] if "skipped" in r else f"{r['tokens_per_s']:,.0f} tokens/s, "
                             f"loss {r['loss']:.3f}"), file=sys.stderr, flush=True)
        rows.append(r)
    text = report(cfg, args, device, rows, kernels_table(cfg, args, device) if args.kernels else None)
    print(text)
    if args.write:
        sys.path.insert(0, HERE)
        from mdsection import write_section

        write_section(args.write, args.section, "## The training step against transformers (issues 24, 36)\n\n" + text)
    assert all(math.isfinite(r["loss"]) for r in rows if "skipped" not in r), "a loss is not finite"


if __name__ == "__main__":
    main()
