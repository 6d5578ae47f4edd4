"""DeepSeek Sparse Attention's cost: one "sparse_mla" layer (models/kinds/sparse_mla.py: MLA plus the lightning
indexer's scores, its top-k and the masked attention) against the dense MLA layer it extends (models/kinds/mla.py),
the same MLA weights and input, forward + backward and forward alone, at several sequence lengths.

    python scripts/bench/sparse_mla.py                                   # CPU, fp32: 1K, 2K and 4K tokens
    python scripts/bench/sparse_mla.py --write docs/benchmarks.md        # and (re)write its section there
    python scripts/bench/sparse_mla.py --device cuda --dtype bf16 --seqs 4096 8192 16384

One process, tp = 1. The layer: DeepSeek-V3.2's head shapes (q_lora_rank 1536 -> 384 at a quarter of the width,
kv_lora_rank 512, heads of 128 + 64 rotary, v 128) at hidden 1024 and 8 heads; the indexer at DeepSeek-V3.2's ratio
to the heads (64 of 128 -> 4 heads of 128) choosing its 2048 keys. Variants: mla (dense, the causal mask), sparse_mla
with its indexer frozen (the default: no gradient through it), and sparse_mla training its indexer with the KL loss
(--dsa-indexer-loss-scale: the main attention's probabilities recomputed without gradient, the indexer's backward).
The step's loss is the output's mean square (plus the indexer's KL where it trains), so its backward reaches every
weight. Variants alternate within each repetition (median of --reps after a warm-up; CPU: the process's CPU time,
one thread). Peak (CPU): the most bytes the step's tensors hold at once (tpzoo.plan.measure.peak_live_bytes).
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import pathlib
import statistics
import sys
import time

import torch

from mdsection import write_section  # noqa: E402 (a sibling script module)

ROOT = pathlib.Path(__file__).resolve().parents[2]
HIDDEN, HEADS, TOPK = 1024, 8, 2048


def config(kind: str):
    from tpzoo.models import get_config
    from tpzoo.models.config import SparseMLAConfig

    base = get_config("deepseek-v3.2")
    # (a small vocabulary and MLP: only the token mixer runs)
    cfg = base.replace(name="", hidden_size=HIDDEN, num_layers=1, token_mixers=[kind], channel_mixers=["mlp"],
                       vocab_size=256, mlp=dataclasses.replace(base.mlp, ffn_hidden_size=256),
                       attention=dataclasses.replace(base.attention, num_heads=HEADS, num_kv_heads=HEADS),
                       mla=dataclasses.replace(base.mla, q_lora_rank=384))
    trains = kind == "sparse_mla+kl"
    sparse = SparseMLAConfig(index_topk=TOPK, index_n_heads=4, index_head_dim=128,
                             rope_interleave=base.sparse_mla.rope_interleave, indexer_loss_scale=1.0 if trains else 0.0)
    if kind == "mla":
        return cfg.replace(sparse_mla=None)
    return cfg.replace(token_mixers=["sparse_mla"], sparse_mla=sparse)


def build(kind: str, tokens: int, dtype, device):
    """(the step: loss of one forward, the model) for variant `kind` on `tokens` tokens."""
    from tpzoo.models import Inputs, ModelLayout, Transformer
    from tpzoo.models.kinds.sparse_mla_indexer import KEY

    model = Transformer(config(kind), ModelLayout(dtype=dtype, device=device), seed=0)
    model.train()
    ids = torch.zeros(1, tokens, dtype=torch.long, device=device)
    x = torch.randn(1, tokens, HIDDEN, generator=torch.Generator().manual_seed(1)).to(device=device, dtype=dtype)
    attn = model.layers["0"].attn

    def step():
        ctx, _ = model._enter(Inputs(ids), None)  # the Context: rotary tables, no documents
        y = attn(x, ctx)
        loss = y.float().square().mean()
        for kl_sum, rows in ctx.recorded(KEY):
            loss = loss + kl_sum / rows
        return loss, y

    return step, model


def clock(device):
    if device.type == "cuda":
        torch.cuda.synchronize()
        return time.perf_counter()
    return time.process_time()


def run(step, model, train: bool, device, instrumented=False):
    from tpzoo.plan.measure import peak_live_bytes

    model.zero_grad(set_to_none=True)
    peak = None
    with torch.set_grad_enabled(train):
        t0 = clock(device)
        if instrumented:
            with peak_live_bytes() as r:
                loss, y = step()
                if train:
                    loss.backward()
            peak = r.peak
        else:
            loss, y = step()
            if train:
                loss.backward()
        return clock(device) - t0, peak, y.detach()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="fp32", choices=["fp32", "bf16"])
    ap.add_argument("--seqs", type=int, nargs="+", default=[1024, 2048, 4096])
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--write", default=None, help="markdown file whose sparse-mla section to (re)write")
    args = ap.parse_args()
    device, dtype = torch.device(args.device), {"fp32": torch.float32, "bf16": torch.bfloat16}[args.dtype]
    if device.type == "cpu":
        torch.set_num_threads(1)
    load, start = os.getloadavg()[0], time.time()
    variants = ["mla", "sparse_mla", "sparse_mla+kl"]
    rows = []
    for tokens in args.seqs:
        built = {v: build(v, tokens, dtype, device) for v in variants}
        for train in (True, False):
            times, peaks, outs = {v: [] for v in variants}, {}, {}
            for rep in range(args.reps + 1):
                for v in variants:
                    if v.endswith("+kl") and not train:
                        continue  # (the forward alone: the frozen variant's)
                    first = rep == 0
                    elapsed, peak, y = run(*built[v], train, device, instrumented=first and device.type == "cpu")
                    if first:
                        peaks[v], outs[v] = peak, y
                    else:
                        times[v].append(elapsed)
            base = statistics.median(times["mla"])
            for v in (v for v in variants if times[v]):
                med = statistics.median(times[v])
                # a sparse output equals the dense one where the top-k holds every key (seq <= index_topk)
                diff = float((outs[v].float() - outs["mla"].float()).abs().max())
                peak = f"{peaks[v] / 2**20:.0f} MiB" if peaks[v] is not None else "n/a"
                rows.append(f"| {tokens} | {'forward + backward' if train else 'forward'} | {v} | {med * 1e3:.0f} ms "
                            f"| {med / base:.2f}x | {peak} | {diff:.1e} |")
    table = "\n".join(["| tokens | step | layer | time | vs mla | peak | max diff from mla |",
                       "|---|---|---|---|---|---|---|", *rows])
    cmd = "python scripts/bench/sparse_mla.py"
    cmd += f" --device {args.device}" if device.type != "cpu" else ""
    cmd += f" --dtype {args.dtype}" if args.dtype != "fp32" else ""
    cmd += f" --seqs {' '.join(map(str, args.seqs))}" if args.seqs != [1024, 2048, 4096] else ""
    cmd += f" --reps {args.reps}" if args.reps != 3 else ""
    cmd += " --write docs/benchmarks.md" if args.write else ""
    clock_name = "CPU time of the process, one thread" if device.type == "cpu" else "CUDA-synchronized wall clock"
    body = (f"## DeepSeek Sparse Attention layer vs dense MLA ({device.type})\n\n"
            f"Command: `{cmd}` on {device.type}, torch {torch.__version__}, {time.time() - start:.0f} s in all; load "
            f"average {load:.1f} before the run. One layer, hidden {HIDDEN}, {HEADS} heads of 128 + 64 rotary (v 128), "
            f"q_lora_rank 384, kv_lora_rank 512; sparse_mla: an indexer of 4 heads of 128 choosing {TOPK} keys "
            f"(models/kinds/sparse_mla.py), frozen (the default) or training with the KL loss (+kl); mla: "
            f"models/kinds/mla.py on the same weights. {args.dtype}, a micro-batch of 1 sequence, tp = 1; the step's "
            f"loss: the output's mean square (+ the indexer's KL). Time: median of {args.reps} after a warm-up, "
            f"variants alternating ({clock_name}). "
            f"Peak: the most bytes the step's tensors hold at once. Max diff: the output's largest difference from "
            f"mla's (0 while the top-k holds every key: seq <= {TOPK}).\n\n{table}\n")
    print(body)
    if args.write:
        write_section(ROOT / args.write if not os.path.isabs(args.write) else args.write, "sparse-mla", body)


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    main()
