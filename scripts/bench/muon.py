"""Muon vs AdamW: tokens/s of the training step and the orthogonalization's share of it, at tp 1 and tp 2.

    python scripts/bench/muon.py                          # tp 1 and tp 2 on gloo ranks, markdown table
    python scripts/bench/muon.py --write docs/benchmarks.md
    python scripts/bench/muon.py --model llama-3.2-1b --device cuda --tp 1   # on a GPU (bf16 weights)

On every rank three copies of the same model (same weights) train side by side, one step each in turn, so they see
the same machine load: DistributedAdamW, and DistributedMuon with the Newton-Schulz iteration in bfloat16
(torch.optim.Muon's) and in float32. A step is what the trainer runs: forward and backward of the micro-batches,
finalize_grads, the data-parallel reduction, the global norm and the update. Muon's share: the host seconds of its
part of the update (momentum, the matrices' exchange to their owners and back, Newton-Schulz, the update:
DistributedMuon.muon_seconds) over the step; at tp 2 each matrix is orthogonalized once, by one of the two ranks.
"""
from __future__ import annotations

import argparse
import os
import pathlib
import statistics
import sys
import time

import torch

from mdsection import write_section  # noqa: E402 (a sibling script module)

CASES = ("adamw", "muon bf16", "muon fp32")


def bench_config(name: str):
    from tpzoo.models import ModelConfig, get_config

    if name != "bench-llama":
        return get_config(name)
    # scripts/bench/train.py's CPU bench model: ~17M parameters
    return ModelConfig.from_dict(dict(family="llama", vocab_size=8192, hidden_size=384, num_layers=6, num_heads=6,
                                      num_kv_heads=2, ffn_hidden_size=1024, max_position_embeddings=1024,
                                      name="bench-llama"))


def run_case(model: str, tp: int, steps: int, batch: int, seq: int, device: str) -> list[dict]:
    """On every rank: the three optimizers' models in turn, one warm-up step each, then `steps` timed rounds."""
    import functools

    import torch.distributed as dist

    import tpzoo
    from tpzoo.pipeline import build_model_chunks, finalize_grads, forward_backward
    from tpzoo.train.muon import DistributedMuon
    from tpzoo.train.muon_matrices import place
    from tpzoo.train.optim import DistributedAdamW

    cfg = bench_config(model)
    dims = tpzoo.init_parallel(tp=tp, device=device)
    dtype = torch.bfloat16 if dims.device.type == "cuda" else torch.float32
    try:
        g = torch.Generator().manual_seed(0)
        ids = torch.randint(0, cfg.vocab_size, (batch, seq + 1), generator=g)
        mbs = [{"input_ids": ids[:, :-1].to(dims.device), "labels": ids[:, 1:].to(dims.device)}]
        runs = {}
        for case in CASES:
            chunks = build_model_chunks(cfg, dims, seed=0)
            params = [p for c in chunks for p in c.parameters()]
            if case == "adamw":
                opt = DistributedAdamW(params, dims, model_dtype=dtype, weight_decay=0.1)
            else:
                ns = torch.bfloat16 if case.endswith("bf16") else torch.float32
                opt = functools.partial(DistributedMuon, matrices=place(chunks), ns_dtype=ns)(
                    params, dims, model_dtype=dtype, weight_decay=0.1)
            runs[case] = (chunks, opt)
        rows = []
        for i in range(steps + 1):
            for case, (chunks, opt) in runs.items():
                if dims.world_size > 1:
                    dist.barrier()
                if dims.device.type == "cuda":
                    torch.cuda.synchronize()
                t0 = time.perf_counter()
                opt.zero_grad()
                forward_backward(chunks, mbs, dims, loss_scale=1.0 / (batch * seq))
                finalize_grads(chunks, dims)
                opt.reduce_grads()
                opt.global_grad_norm()
                opt.step(1e-3)
                if dims.device.type == "cuda":
                    torch.cuda.synchronize()
                if i > 0:
                    rows.append({"case": case, "step": time.perf_counter() - t0,
                                 "muon": getattr(opt, "muon_seconds", 0.0)})
        return rows
    finally:
        tpzoo.destroy_parallel()


def summarize(tp: int, per_rank: list[list[dict]], tokens: int) -> list[dict]:
    out = []
    for case in CASES:
        steps = [[r for r in rows if r["case"] == case] for rows in per_rank]
        step = statistics.median(max(s[k]["step"] for s in steps) for k in range(len(steps[0])))
        muon = statistics.median(max(s[k]["muon"] for s in steps) for k in range(len(steps[0])))
        out.append({"tp": tp, "case": case, "step": step, "tokens_per_s": tokens / step, "muon": muon})
    base = out[0]["tokens_per_s"]
    for r in out:
        r["ratio"] = r["tokens_per_s"] / base
    return out


def table(rows: list[dict]) -> str:
    out = ["| tp | optimizer | step (s) | tokens/s | vs AdamW | Muon's part of the step (s) | share |",
           "|---|---|---|---|---|---|---|"]
    for r in rows:
        share = f"{100 * r['muon'] / r['step']:.0f}%" if r["muon"] else ""
        out.append(f"| {r['tp']} | {r['case']} | {r['step']:.3f} | {r['tokens_per_s']:,.0f} | {r['ratio']:.2f} | "
                   f"{r['muon']:.3f} | {share} |" if r["muon"] else
                   f"| {r['tp']} | {r['case']} | {r['step']:.3f} | {r['tokens_per_s']:,.0f} | {r['ratio']:.2f} | | |")
    return "\n".join(out) + "\n"


def main(argv=None) -> None:
    from tpzoo.testing import run_on_ranks, shutdown_pools

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="bench-llama")
    parser.add_argument("--tp", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--steps", type=int, default=3, help="timed rounds, after one warm-up round")
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--write", type=pathlib.Path, help="markdown file whose section to (re)write")
    args = parser.parse_args(argv)
    rows, t0, load = [], time.time(), os.getloadavg()[0]
    try:
        for tp in args.tp:
            per_rank = run_on_ranks(tp, run_case, args.model, tp, args.steps, args.batch, args.seq_len, args.device,
                                    timeout=3600)
            rows += summarize(tp, per_rank, args.batch * args.seq_len)
    finally:
        shutdown_pools()
    cfg = bench_config(args.model)
    options = [f"--model {args.model}" if args.model != "bench-llama" else "",
               f"--tp {' '.join(map(str, args.tp))}" if args.tp != [1, 2] else "",
               f"--steps {args.steps}" if args.steps != 3 else "", f"--batch {args.batch}" if args.batch != 4 else "",
               f"--seq-len {args.seq_len}" if args.seq_len != 256 else "",
               f"--device {args.device}" if args.device != "cpu" else "", "--write docs/benchmarks.md"]
    command = " ".join(["python scripts/bench/muon.py"] + [o for o in options if o])
    where = (torch.cuda.get_device_name() if args.device.startswith("cuda") and torch.cuda.is_available()
             else f"{os.cpu_count()} CPU cores, gloo ranks, one thread each")
    body = (f"## Muon vs AdamW: tokens/s and the orthogonalization's share ({args.device})\n\n"
            f"Command: `{command}` ({cfg.name or args.model}: {cfg.num_parameters() / 1e6:.1f}M parameters, hidden "
            f"{cfg.hidden_size}, {cfg.num_layers} layers; one micro-batch of {args.batch} x {args.seq_len} tokens per "
            f"step; the three optimizers' models step in turn, {args.steps} timed rounds after one warm-up; "
            f"{time.time() - t0:.0f} s in all). Step: forward, backward, reductions, norm and update, the slowest "
            f"rank, median over rounds. Muon's part: momentum, the matrices' exchange to their owner ranks and "
            f"back, Newton-Schulz and the update (DistributedMuon.muon_seconds). Machine: {where}, load average "
            f"{load:.1f} before the run.\n\n" + table(rows))
    print(body)
    if args.write:
        write_section(args.write, "muon", body)


if __name__ == "__main__":
    sys.exit(main())
