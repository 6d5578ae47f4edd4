"""Context parallelism (ring attention): activation memory per rank, ring p2p volume and step time at cp = 1, 2, 4;
with --device, the block schedule of cp ranks in one process against one fused SDPA over the whole sequence.

    python scripts/bench/cp_ring.py                            # print the markdown section
    python scripts/bench/cp_ring.py --write docs/benchmarks.md # and (re)write its section there
    python scripts/bench/cp_ring.py --device cuda              # blocks vs SDPA: 32K tokens, llama-3.2-1b heads
    python scripts/bench/cp_ring.py --device cpu --write docs/benchmarks.md   # the same at a CPU size

--device (cp_ring_blocks.py): attention alone, forward + backward, the kernels ring attention picks on that
device (tpzoo.parallel.attention_kernels) and the SDPA that cp = 1 runs (models/kinds/attention_core.py), time and peak memory.

One long sequence through a LLaMA-style model (embedding, layers, head and loss), fp32, torch kernels, on cp gloo
ranks (cp = 1, 2, 4), each rank holding its two load-balanced chunks. Per rank: the bytes the forward leaves for
the backward (tpzoo.plan.measure.live_activation_bytes: every storage alive when the forward returns, parameters
and the batch excluded), the p2p sends per layer forward and backward (counted by tpzoo.parallel.comm) against the
analytical count of tpzoo.parallel.ring_attention's docstring, and the forward + backward time (median of the timed
repetitions; cp = 1 is the same code without a ring: SDPA over the whole sequence).
"""
from __future__ import annotations

import argparse
import os
import pathlib
import statistics
import sys
import time

from mdsection import write_section  # noqa: E402 (a sibling script module)

S, LAYERS, REPS = 2048, 4, 3


def bench_config():
    from tpzoo.models import get_config

    return get_config("nano-llama").replace(hidden_size=256, num_heads=8, num_kv_heads=4, ffn_hidden_size=704,
                                            num_layers=LAYERS, max_position_embeddings=S, vocab_size=512)


def measure(cp: int) -> dict:
    import torch

    import tpzoo
    from tpzoo import kernels as K
    from tpzoo.models import Inputs, Transformer
    from tpzoo.parallel import count_collectives
    from tpzoo.parallel.context_parallel import shard_batch
    from tpzoo.plan.measure import live_activation_bytes

    dims = tpzoo.init_parallel(cp=cp)
    try:
        cfg = bench_config()
        g = torch.Generator().manual_seed(0)
        ids = torch.randint(0, cfg.vocab_size, (1, S), generator=g)
        batch = shard_batch({"input_ids": ids, "labels": torch.roll(ids, -1, 1)}, dims)
        model = Transformer(cfg, dims, seed=0)
        with K.use_backend("torch"):
            run = lambda: model(Inputs(batch["input_ids"], labels=batch["labels"],  # noqa: E731
                                       positions=batch.get("position_ids"))).sum()
            with live_activation_bytes(list(model.parameters()) + list(batch.values())) as live:
                loss = run()
            del loss
            with count_collectives() as fwd:
                loss = run()
            with count_collectives() as bwd:
                loss.backward()
            times, cpu = [], []
            for rep in range(REPS + 1):
                torch.distributed.barrier()
                t0, c0 = time.perf_counter(), time.process_time()
                run().backward()
                c1 = time.process_time()
                torch.distributed.barrier()
                if rep:  # the first is warm-up
                    times.append(time.perf_counter() - t0)
                    cpu.append(c1 - c0)
        sends = {phase: (c.get("send", "cp").calls / LAYERS, c.get("send", "cp").payload_bytes / LAYERS)
                 for phase, c in (("forward", fwd), ("backward", bwd))}
        return {"bytes": live.total, "sends": sends, "time": statistics.median(times), "cpu": statistics.median(cpu)}
    finally:
        tpzoo.destroy_parallel()


def analytical(cfg, cp: int) -> dict:
    """Sends per layer and rank: forward N-1 K|V blocks, backward N-1 K|V and N dK|dV blocks (fp32 here)."""
    if cp == 1:
        return {"forward": (0, 0), "backward": (0, 0)}
    block = 2 * 1 * cfg.num_kv_heads * (S // cp) * cfg.head_dim * 4
    return {"forward": (cp - 1, (cp - 1) * block), "backward": (2 * cp - 1, (2 * cp - 1) * block)}


def main(argv=None) -> None:
    from tpzoo.testing import run_on_ranks, shutdown_pools

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--write", type=pathlib.Path, help="markdown file whose cp_ring section to (re)write")
    parser.add_argument("--device", help="cpu or cuda: ring attention's block schedule vs one fused SDPA "
                        "(cp_ring_blocks.py) instead of the gloo model run")
    parser.add_argument("--seq", type=int, help="--device: sequence length (default 32768 on cuda, 2048 on cpu)")
    parser.add_argument("--cp", default="2,4,8", help="--device: cp sizes (default 2,4,8)")
    parser.add_argument("--reps", type=int, default=3, help="--device: timed repetitions after a warm-up")
    args = parser.parse_args(argv)
    if args.device:
        from cp_ring_blocks import run_blocks

        body = run_blocks(args.device, args.seq, [int(c) for c in args.cp.split(",")], args.reps)
        print(body)
        if args.write:
            write_section(args.write, f"cp_ring_blocks_{args.device.split(':')[0]}", body)
        return
    from tpzoo.plan import Layout, TrainingSpec, stage_memory

    cfg = bench_config()
    load = os.getloadavg()[0]
    t0 = time.perf_counter()
    try:
        results = {cp: run_on_ranks(cp, measure, cp) for cp in (1, 2, 4)}
    finally:
        shutdown_pools()
    elapsed = time.perf_counter() - t0
    base_bytes, base_time, base_cpu = results[1][0]["bytes"], results[1][0]["time"], results[1][0]["cpu"]
    lines = ["| cp | tokens per rank | activation MiB per rank (max over ranks) | plan estimate | vs cp=1 / cp | "
             "p2p sends per layer, "
             "forward: calls, MiB (measured / analytical) | backward | fwd+bwd wall s (median, rank 0) | vs cp=1 | "
             "fwd+bwd CPU s per rank (median, max over ranks) | vs cp=1 |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for cp, ranks in results.items():
        most = max(r["bytes"] for r in ranks)
        want = analytical(cfg, cp)
        cells = []
        for phase in ("forward", "backward"):
            got = {(r["sends"][phase][0], r["sends"][phase][1]) for r in ranks}
            (calls, nbytes), = got if len(got) == 1 else ((-1, -1),)  # every rank the same, else flagged
            cells.append(f"{calls:g}, {nbytes / 2**20:.2f} / {want[phase][0]}, {want[phase][1] / 2**20:.2f}")
        t, c = ranks[0]["time"], max(r["cpu"] for r in ranks)
        plan = stage_memory(cfg, Layout(cp=cp), TrainingSpec(seq_len=S, global_batch_size=1, dtype="fp32",
                                                             kernels="reference"), 0).activations
        lines.append(f"| {cp} | {S // cp} | {most / 2**20:.1f} | {plan / 2**20:.1f} | {most / (base_bytes / cp):.3f} | "
                     f"{cells[0]} | "
                     f"{cells[1]} | {t:.2f} | {t / base_time:.2f} | {c:.2f} | {c / base_cpu:.2f} |")
    body = (f"## Context parallelism: ring attention, one long sequence\n\n"
            f"Command: `python scripts/bench/cp_ring.py --write docs/benchmarks.md` (cp gloo ranks on the 2-core CPU "
            f"machine, shared with other jobs: load average {load:.1f} before the run; {elapsed:.0f} s in all). "
            f"Model: LLaMA-style, {LAYERS} layers, hidden {cfg.hidden_size}, {cfg.num_heads} heads, "
            f"{cfg.num_kv_heads} kv heads, ffn {cfg.ffn_hidden_size}, vocab {cfg.vocab_size}; one sequence of {S} "
            f"tokens, fp32, torch kernels. Activation bytes: every storage the "
            f"forward (embedding to loss) leaves alive for the backward on a rank (parameters and batch excluded), "
            f"beside tpzoo.plan's estimate (stage_memory, torch kernels); "
            f"'vs cp=1 / cp' is that over the ideal 1/cp share of the cp=1 figure. p2p: sends per layer and rank "
            f"(K|V blocks forward; K|V and dK|dV backward, fp32). Time: forward + backward of the whole model, "
            f"median of {REPS} after a warm-up, wall clock on rank 0 and CPU time of each rank's process (less "
            f"sensitive to the machine's load; one thread per rank); cp=1 runs SDPA over the whole sequence, cp > 1 "
            f"ring attention with torch's CPU flash kernel per block, with more ranks than the machine has cores at "
            f"cp=4. Wall-clock ratios move with the machine's load from run to run; the CPU column is the steadier "
            f"comparison of the work per rank.\n\n"
            + "\n".join(lines))
    print(body)
    if args.write:
        write_section(args.write, "cp_ring", body)


if __name__ == "__main__":
    sys.exit(main())
