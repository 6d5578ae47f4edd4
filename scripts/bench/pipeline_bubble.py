"""Pipeline bubble of every schedule, measured from the schedules' own timelines, next to the theory.

    python scripts/bench/pipeline_bubble.py                    # pp=4, m=8 micro-batches, markdown table
    python scripts/bench/pipeline_bubble.py --pp 2 --write docs/benchmarks.md

Each schedule trains a LLaMA-style model (hidden 384, 8 layers) on pp gloo ranks for a few steps. Bubble of a
stage = idle time / busy time within the step's span (first action start to last action end over all ranks),
which is what (p-1)/m describes (Narayanan et al. 2021); the table shows the mean over stages, median over steps.
Columns: "theory" is the papers' formula ((p-1)/m for GPipe and 1F1B, (p-1)/(v m) interleaved, (p-1)/(3m) for
ZB-H1 when F, B and W cost the same); "simulated" replays the schedule's order with each stage's measured mean
cost per action kind and free communication (tpzoo.pipeline.simulate); "measured" is the wall clock.
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

SCHEDULES = (("gpipe", 1), ("1f1b", 1), ("interleaved", 2), ("zb", 1))
B, S = 4, 128


def bench_config():
    from tpzoo.models import get_config

    return get_config("nano-llama").replace(vocab_size=256, hidden_size=384, num_heads=6, num_kv_heads=2,
                                            ffn_hidden_size=1024, num_layers=8, max_position_embeddings=S)


def run_schedule(schedule: str, v: int, pp: int, m: int, steps: int) -> dict:
    """On every rank: warm-up step, then `steps` timed steps; this rank's timelines and peak in-flight."""
    import tpzoo
    from tpzoo.pipeline import build_model_chunks

    cfg = bench_config()
    mbs = random_microbatches(cfg.vocab_size, m, B, S)
    dims = tpzoo.init_parallel(pp=pp)
    try:
        chunks = build_model_chunks(cfg, dims, virtual_stages=v)
        return timed_steps(chunks, mbs, dims, schedule, steps)
    finally:
        tpzoo.destroy_parallel()


def random_microbatches(vocab: int, m: int, batch: int, seq: int) -> list[dict]:
    """m micro-batches of random tokens (seeded: the same on every rank), labels the next token."""
    g = torch.Generator().manual_seed(0)
    ids = [torch.randint(0, vocab, (batch, seq), generator=g) for _ in range(m)]
    return [{"input_ids": x, "labels": torch.roll(x, -1, dims=1)} for x in ids]


def timed_steps(chunks, mbs: list, dims, schedule: str, steps: int) -> dict:
    """One warm-up step (it pays one-off allocation costs), then `steps` timed ones: this rank's timelines and peak
    in-flight micro-batches. The loss is the mean over every token of the step."""
    import torch.distributed as dist

    from tpzoo.pipeline import forward_backward

    tokens = sum(mb["labels"].numel() for mb in mbs)
    timelines, peak = [], 0
    for step in range(steps + 1):
        for c in chunks:
            c.zero_grad(set_to_none=True)
        dist.barrier()  # start together: the span is measured across ranks (one machine, one clock)
        out = forward_backward(chunks, mbs, dims, schedule=schedule, loss_scale=1.0 / tokens)
        if step:
            timelines.append(out["timeline"])
        peak = out["peak_inflight"]
    return {"timelines": timelines, "peak": peak}


def add_arguments(parser, per: str) -> None:
    """The options both pipeline benches take (this one and pipeline_balance.py)."""
    parser.add_argument("--pp", type=int, default=4)
    parser.add_argument("--microbatches", "-m", type=int, default=8)
    parser.add_argument("--steps", type=int, default=3, help=f"timed steps per {per} (after one warm-up step)")
    parser.add_argument("--write", type=pathlib.Path, help="markdown file whose section to (re)write")


def summarize(schedule: str, v: int, pp: int, m: int, per_rank: list[dict]) -> dict:
    from tpzoo.pipeline import bubble_fractions, plan, simulate

    steps = len(per_rank[0]["timelines"])
    measured, spans = [], []
    for k in range(steps):
        tls = [r["timelines"][k] for r in per_rank]
        measured.append(statistics.mean(bubble_fractions(tls)))
        spans.append(max(e[3] for tl in tls for e in tl) - min(e[2] for tl in tls for e in tl))
    # each stage's mean cost per action kind (stages differ: embedding, head and loss, zb's first-stage W)
    cost = [{kind: statistics.mean([e[3] - e[2] for tl in r["timelines"] for e in tl if e[0] == kind] or [0.0])
             for kind in "FBW"} for r in per_rank]
    simulated = statistics.mean(bubble_fractions(simulate([plan(schedule, r, pp, m, v) for r in range(pp)], pp, v,
                                                          cost)))
    theory = (pp - 1) / m / v if schedule != "zb" else (pp - 1) / (3 * m)
    return {"schedule": schedule, "v": v, "theory": theory, "simulated": simulated,
            "measured": statistics.median(measured), "step_s": statistics.median(spans), "peak": per_rank[0]["peak"],
            "cost_ms": {k: 1e3 * statistics.mean(c[k] for c in cost) for k in "FBW" if any(c[k] for c in cost)}}


def table(rows: list[dict]) -> str:
    out = ["| schedule | v | bubble: theory | simulated (measured stage costs) | measured | step time (s) | "
           "mean action time (ms) | peak in-flight, stage 0 |", "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        costs = ", ".join(f"{k} {c:.0f}" for k, c in r["cost_ms"].items())
        out.append(f"| {r['schedule']} | {r['v']} | {r['theory']:.3f} | {r['simulated']:.3f} | {r['measured']:.3f} "
                   f"| {r['step_s']:.2f} | {costs} | {r['peak']} |")
    return "\n".join(out) + "\n"


def main(argv=None) -> None:
    from tpzoo.testing import run_on_ranks, shutdown_pools

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_arguments(parser, "schedule")
    args = parser.parse_args(argv)
    pp, m = args.pp, args.microbatches
    rows = []
    t0, load = time.time(), os.getloadavg()[0]
    try:
        for schedule, v in SCHEDULES:
            per_rank = run_on_ranks(pp, run_schedule, schedule, v, pp, m, args.steps, timeout=1200)
            rows.append(summarize(schedule, v, pp, m, per_rank))
    finally:
        shutdown_pools()
    cfg = bench_config()
    options = [f"--pp {pp}" if pp != 4 else "", f"-m {m}" if m != 8 else "",
               f"--steps {args.steps}" if args.steps != 3 else "", "--write docs/benchmarks.md"]
    command = " ".join(["python scripts/bench/pipeline_bubble.py"] + [o for o in options if o])
    body = (f"## Pipeline bubble, pp={pp}, m={m}\n\n"
            f"Command: `{command}` ({pp} gloo ranks, one thread each; LLaMA-style model, hidden "
            f"{cfg.hidden_size}, {cfg.num_layers} layers, micro-batch {B} x {S} tokens, {args.steps} timed steps per "
            f"schedule after a warm-up step; {time.time() - t0:.0f} s in all). Bubble = idle / busy time per stage "
            f"within the step, mean over stages, median over steps. For zb, B computes only the input gradient "
            f"and W only the weight gradients (docs/parallelism.md); B + W costs a little more than one "
            f"backward, so compare step times too. Machine: {os.cpu_count()} CPU cores, load average {load:.1f} "
            f"before the run. Action times move with the machine's load"
            + (" and, with more ranks than cores, with how many ranks compute at once" if pp > (os.cpu_count() or 1)
               else "")
            + "; the simulated column (each stage's mean costs, free communication) is the steadier comparison, "
              "the measured one adds communication and that variation.\n\n" + table(rows))
    print(body)
    if args.write:
        write_section(args.write, f"pipeline_bubble_pp{pp}", body)


if __name__ == "__main__":
    sys.exit(main())
