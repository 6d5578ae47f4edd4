"""Pipeline stages of a cut DeepSeek-V3 split by parameters (the default) vs by time (the plan's split), measured.

    python scripts/bench/pipeline_balance.py                           # pp=4, m=8, markdown table
    python scripts/bench/pipeline_balance.py --write docs/benchmarks.md

A dense-first mixture of experts: an MoE layer holds many times a dense layer's weights but computes about as much
per token, so tpzoo's default split (tpzoo.pipeline.partition_layers, balanced by each layer's parameters) gives
the dense stage more layers than the others and it becomes the slowest. The plan's time-balanced split
(tpzoo.plan.balance.time_balanced_boundaries, from the kinds' FLOPs; `--pp-boundaries` in training) weighs each
layer by its compute instead. Both splits train the same model on pp gloo ranks, 1F1B, for a few steps; the table
gives each split's boundaries, the per-stage busy time per step (from the schedule's own timeline), the step time
(first action start to last action end over all ranks) and the mean bubble (idle / busy within the step), medians
over the timed steps. On a 2-core machine the ranks share the cores: compare the rows, not the absolute times.
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import sys

import torch

from mdsection import write_section  # noqa: E402 (sibling script modules)
from pipeline_bubble import add_arguments, random_microbatches, timed_steps  # noqa: E402

B, S = 2, 128


def bench_config():
    """tiny-deepseek-v3 cut to 8 layers, the first 2 dense with the intermediate size of the active experts (2 routed
    + 1 shared of 64): per token the dense and MoE layers compute about the same, an MoE layer holds 16 experts."""
    from tpzoo.models import get_config

    base = get_config("tiny-deepseek-v3")
    layers, dense = 8, 2
    moe = dataclasses.replace(base.moe, num_experts=16, num_experts_per_tok=2, n_group=4, topk_group=2,
                              shared_expert_ffn=64, ffn_hidden_size=64)
    return base.replace(num_layers=layers, moe=moe, token_mixers=["mla"] * layers,
                        channel_mixers=["mlp"] * dense + ["moe"] * (layers - dense), vocab_size=256,
                        max_position_embeddings=S).replace(ffn_hidden_size=3 * 64)


def splits(cfg, pp: int) -> dict:
    from tpzoo.pipeline import partition_layers
    from tpzoo.plan.balance import time_balanced_boundaries
    from tpzoo.plan.spec import Layout, TrainingSpec

    default = partition_layers(cfg, pp)
    timed = time_balanced_boundaries(cfg, Layout(pp=pp, micro_batch_size=B),
                                     TrainingSpec(seq_len=S, global_batch_size=B, dtype="fp32", kernels="reference"))
    return {"by parameters (default)": [a for a, _ in default] + [cfg.num_layers], "by time (plan)": list(timed)}


def run_split(boundaries: list, pp: int, m: int, steps: int) -> dict:
    """On every rank: one warm-up step, then `steps` timed steps of 1F1B; this rank's timelines."""
    import tpzoo
    from tpzoo.models import ModelLayout
    from tpzoo.pipeline import build_model_chunks

    cfg = bench_config()
    mbs = random_microbatches(cfg.vocab_size, m, B, S)
    dims = tpzoo.init_parallel(pp=pp)
    try:
        chunks = build_model_chunks(cfg, ModelLayout(dims), boundaries=boundaries, seed=0)
        return timed_steps(chunks, mbs, dims, "1f1b", steps)
    finally:
        tpzoo.destroy_parallel()


def summarize(name: str, boundaries: list, per_rank: list[dict]) -> dict:
    from tpzoo.pipeline import bubble_fractions

    steps = len(per_rank[0]["timelines"])
    spans, bubbles, busy = [], [], []
    for k in range(steps):
        tls = [r["timelines"][k] for r in per_rank]
        spans.append(max(e[3] for tl in tls for e in tl) - min(e[2] for tl in tls for e in tl))
        bubbles.append(statistics.mean(bubble_fractions(tls)))
        busy.append([sum(e[3] - e[2] for e in tl) for tl in tls])
    per_stage = [statistics.median(b[r] for b in busy) for r in range(len(per_rank))]
    return {"name": name, "boundaries": boundaries, "busy": per_stage, "step": statistics.median(spans),
            "bubble": statistics.median(bubbles)}


def table(rows: list[dict]) -> str:
    out = ["| split | --pp-boundaries | stage busy per step (s) | slowest / mean stage | step time (s) | bubble |",
           "|---|---|---|---|---|---|"]
    for r in rows:
        busy = " / ".join(f"{b:.2f}" for b in r["busy"])
        out.append(f"| {r['name']} | {','.join(map(str, r['boundaries']))} | {busy} | "
                   f"{max(r['busy']) / statistics.mean(r['busy']):.2f} | {r['step']:.2f} | {r['bubble']:.3f} |")
    base = rows[0]["step"]
    return "\n".join(out) + "\n\n" + "; ".join(f"{r['name']}: {base / r['step']:.2f}x the default's speed"
                                             for r in rows[1:]) + "\n"


def main(argv=None) -> None:
    from tpzoo.testing import run_on_ranks, shutdown_pools

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_arguments(parser, "split")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    cfg = bench_config()
    load = os.getloadavg()
    rows = []
    try:
        for name, cuts in splits(cfg, args.pp).items():
            per_rank = run_on_ranks(args.pp, run_split, cuts, args.pp, args.microbatches, args.steps)
            rows.append(summarize(name, cuts, per_rank))
    finally:
        shutdown_pools()
    end = os.getloadavg()
    layers = ", ".join(f"{i}: {cfg.channel_mixer(i)}" for i in range(cfg.num_layers))
    text = (f"## Pipeline stages of a cut DeepSeek-V3: split by parameters vs by time (CPU, pp={args.pp})\n\n"
            f"`python scripts/bench/pipeline_balance.py --pp {args.pp} -m {args.microbatches} --steps {args.steps}`"
            f" on {os.cpu_count()} cores, one torch thread per rank, load average {load[0]:.1f} at the start and "
            f"{end[0]:.1f} at the end. Model: tiny-deepseek-v3 cut to {cfg.num_layers} layers (MLA; {layers}; "
            f"16 experts of 64, top-2 in 4 groups, one shared expert; the dense layers' MLP 192 wide, what a "
            f"token's active experts compute), batch {B} x {S} per micro-batch, {args.microbatches} micro-batches, "
            f"1F1B, fp32; medians of {args.steps} steps after one warm-up.\n\n" + table(rows))
    print(text)
    if args.write:
        write_section(args.write, "pipeline_balance", text)


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    main()
