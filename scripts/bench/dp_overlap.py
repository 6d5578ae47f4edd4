"""Data-parallel gradient reduction overlapped with the backward pass, against the same run with overlap off.

    python scripts/bench/dp_overlap.py                          # dp=2 and dp=4, ZeRO 0, 1, 2 and 3, markdown table
    python scripts/bench/dp_overlap.py --write docs/benchmarks.md

Each (dp, ZeRO level) trains a LLaMA-style model on dp gloo ranks with DistributedAdamW. Steps alternate between
overlap on and off on the same model and optimizer (after a warm-up step of each), so both see the same machine
load. Per step: step time (forward, backward, reduction, norm, AdamW; the slowest rank), and the time the
optimizer waited in reduce_grads() for the data-parallel reduction. With overlap off that wait is the whole
reduction (nothing is in flight before it); with overlap on only what the backward did not hide. Hidden fraction
= 1 - wait(on) / wait(off). ZeRO-2 and 3 reduce-scatter in every backward pass either way (off: each pass waits for
its buckets at its end); at ZeRO-3 "off" also stops prefetching the next layer's weights (each all-gather waited
on when its layer starts).
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

# Default shapes: little compute per step (one micro-batch of 1 x 64 tokens per rank) for a 4.6M-parameter
# model, so the gradient reduction is a large part of the step: the regime overlap is for.


def bench_config(seq: int):
    from tpzoo.models import get_config

    return get_config("nano-llama").replace(vocab_size=4096, hidden_size=256, num_heads=4, num_kv_heads=2,
                                            ffn_hidden_size=768, num_layers=4, max_position_embeddings=seq)


def run_case(zero: int, steps: int, bucket_elems: int, B: int, S: int, M: int) -> list[dict]:
    """On every rank: warm-up (one step each way), then `steps` pairs of steps, overlap on then off."""
    import torch.distributed as dist

    import tpzoo
    from tpzoo.pipeline import build_model_chunks, finalize_grads, forward_backward
    from tpzoo.train.optim import DistributedAdamW

    cfg = bench_config(S)
    dims = tpzoo.init_parallel(tp=1)  # every rank a data-parallel replica
    try:
        g = torch.Generator().manual_seed(dims.dp_rank)
        mbs = []
        for _ in range(M):
            ids = torch.randint(0, cfg.vocab_size, (B, S), generator=g)
            mbs.append({"input_ids": ids, "labels": torch.roll(ids, -1, dims=1)})
        chunks = build_model_chunks(cfg, dims)
        opt = DistributedAdamW([p for c in chunks for p in c.parameters()], dims, zero=zero,
                               bucket_elems=bucket_elems, modules=chunks)
        rows = []
        for i in range(2 * (steps + 1)):
            opt.overlap = i % 2 == 0
            if zero >= 2:  # the sharded gradient buffer reads its own flag (it always reduces during backward)
                opt.grads.overlap = opt.overlap
            if opt.shards is not None:
                opt.shards.prefetching = opt.overlap
            dist.barrier()
            gather0 = opt.shards.wait_s if opt.shards is not None else 0.0
            t0 = time.perf_counter()
            opt.zero_grad()
            forward_backward(chunks, mbs, dims, loss_scale=1.0 / (dims.dp * M * B * S))
            finalize_grads(chunks, dims)
            t1 = time.perf_counter()
            opt.reduce_grads()
            t2 = time.perf_counter()
            opt.global_grad_norm()
            opt.step(1e-4)
            t3 = time.perf_counter()
            if i >= 2:
                gather = (opt.shards.wait_s if opt.shards is not None else 0.0) - gather0
                rows.append({"overlap": opt.overlap, "step": t3 - t0, "wait": t2 - t1, "gather": gather,
                             "early": opt.grads.overlapped if opt.overlap else 0, "buckets": len(opt.buckets)})
        return rows
    finally:
        tpzoo.destroy_parallel()


def summarize(dp: int, zero: int, per_rank: list[list[dict]]) -> dict:
    out = {"dp": dp, "zero": zero, "buckets": per_rank[0][0]["buckets"]}
    for on in (True, False):
        steps = [[r for r in rows if r["overlap"] == on] for rows in per_rank]
        # a step lasts as long as its slowest rank; the wait is the mean over ranks
        out["step_on" if on else "step_off"] = statistics.median(max(s[k]["step"] for s in steps)
                                                                 for k in range(len(steps[0])))
        out["wait_on" if on else "wait_off"] = statistics.median(statistics.mean(s[k]["wait"] for s in steps)
                                                                 for k in range(len(steps[0])))
        out["gather_on" if on else "gather_off"] = statistics.median(statistics.mean(s[k]["gather"] for s in steps)
                                                                     for k in range(len(steps[0])))
        if on:
            out["early"] = per_rank[0][0]["early"]
    out["hidden"] = 1 - out["wait_on"] / out["wait_off"] if out["wait_off"] > 0 else float("nan")
    # ZeRO-3: the weights' all-gathers the layers waited for, prefetched (on) or not (off)
    out["gather_hidden"] = 1 - out["gather_on"] / out["gather_off"] if out["gather_off"] > 0 else float("nan")
    return out


def table(rows: list[dict]) -> str:
    out = ["| dp | ZeRO | buckets (started during backward) | step, overlap off (s) | step, overlap on (s) | "
           "on / off | DP wait off (ms) | DP wait on (ms) | hidden behind backward | ZeRO-3 gather wait off / on "
           "(ms; hidden) |",
           "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        out.append(f"| {r['dp']} | {r['zero']} | {r['buckets']} ({r['early']}) | {r['step_off']:.3f} | "
                   f"{r['step_on']:.3f} | {r['step_on'] / r['step_off']:.2f} | {1e3 * r['wait_off']:.0f} | "
                   f"{1e3 * r['wait_on']:.0f} | " + ("n/a |" if r["zero"] >= 2 else f"{100 * r['hidden']:.0f}% |")
                   + (f" {1e3 * r['gather_off']:.0f} / {1e3 * r['gather_on']:.0f} ({100 * r['gather_hidden']:.0f}%) |"
                      if r["zero"] >= 3 else " |"))
    return "\n".join(out) + "\n"


def main(argv=None) -> None:
    from tpzoo.testing import run_on_ranks, shutdown_pools

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dp", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--steps", type=int, default=5, help="timed steps each way, after one warm-up step each")
    parser.add_argument("--bucket-elems", type=int, default=1 << 20)
    parser.add_argument("--micro-batch-size", type=int, default=1)
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--microbatches", "-m", type=int, default=1, help="micro-batches per rank and step")
    parser.add_argument("--zero", type=int, nargs="+", default=[0, 1, 2, 3], help="ZeRO levels")
    parser.add_argument("--write", type=pathlib.Path, help="markdown file whose section to (re)write")
    args = parser.parse_args(argv)
    rows = []
    t0, load = time.time(), os.getloadavg()[0]
    try:
        for dp in args.dp:
            for zero in args.zero:
                per_rank = run_on_ranks(dp, run_case, zero, args.steps, args.bucket_elems, args.micro_batch_size,
                                        args.seq_len, args.microbatches, timeout=1200)
                rows.append(summarize(dp, zero, per_rank))
    finally:
        shutdown_pools()
    B, S, M = args.micro_batch_size, args.seq_len, args.microbatches
    cfg = bench_config(S)
    n_params = cfg.num_parameters()
    options = [f"--dp {' '.join(map(str, args.dp))}" if args.dp != [2, 4] else "",
               f"--steps {args.steps}" if args.steps != 5 else "",
               f"--bucket-elems {args.bucket_elems}" if args.bucket_elems != 1 << 20 else "",
               f"--micro-batch-size {B}" if B != 1 else "", f"--seq-len {S}" if S != 64 else "",
               f"-m {M}" if M != 1 else "",
               f"--zero {' '.join(map(str, args.zero))}" if args.zero != [0, 1, 2, 3] else "",
               "--write docs/benchmarks.md"]
    command = " ".join(["python scripts/bench/dp_overlap.py"] + [o for o in options if o])
    body = (f"## Data-parallel reduction overlapped with backward\n\n"
            f"Command: `{command}` (dp gloo ranks on CPU, one thread each; LLaMA-style model, hidden "
            f"{cfg.hidden_size}, {cfg.num_layers} layers, vocab {cfg.vocab_size}: {n_params / 1e6:.1f}M parameters, "
            f"fp32, {args.bucket_elems:,}-element buckets; {M} micro-batches of {B} x {S} tokens per rank; "
            f"{args.steps} steps each way, alternating on/off on the same model; {time.time() - t0:.0f} s in all). "
            f"ZeRO-2 and 3 reduce-scatter during every backward pass whether overlap is on or not (off: each "
            f"pass waits for its buckets at its end), so their DP wait off is not the whole reduction and no hidden "
            f"fraction is given: compare their step times; at ZeRO-3 overlap off also stops the prefetch of the "
            f"next layer's weights (each layer's all-gather waited on when the layer starts); the last column is "
            f"the time the layers waited for their weights' all-gathers per step (mean over ranks, median over "
            f"steps) and the share the prefetch hid. "
            f"Step time: the slowest rank, median over steps. DP wait: time in reduce_grads() (with overlap off, "
            f"the whole reduction; with overlap on, what the backward did not hide), mean over ranks, median over "
            f"steps; hidden = 1 - wait on / wait off. Machine: {os.cpu_count()} CPU cores, load average {load:.1f} "
            f"before the run"
            + (f"; dp={max(args.dp)} puts more ranks than cores, so gloo's communication threads and the "
               f"backward compete for the same cores" if max(args.dp) > (os.cpu_count() or 1) else "")
            + ".\n\n" + table(rows))
    print(body)
    if args.write:
        write_section(args.write, "dp_overlap", body)


if __name__ == "__main__":
    sys.exit(main())
