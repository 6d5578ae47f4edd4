"""SFT throughput: packing with document masking vs one padded example per row vs packing without the mask.

    python scripts/bench/sft_packing.py                              # CPU, toy size: prints the markdown section
    python scripts/bench/sft_packing.py --write docs/benchmarks.md   # and (re)writes its section there
    python scripts/bench/sft_packing.py --device cuda --model llama-3.2-1b --seq-len 2048 --dtype bf16 \\
        --micro-batch-size 8 --examples 2000 --write docs/benchmarks.md     # the GPU figure (one GPU)

The examples: synthetic SFT examples whose lengths are drawn log-uniformly from [seq_len / 64, seq_len] tokens
(32..2048 at seq_len 2048: many short chats, a few long ones), the first quarter of each a prompt (no loss). The
same examples are trained three ways, with the data classes `tpzoo finetune` uses:
    padded    PaddedSFTDataset: one example per row, plain causal attention (`--no-packing`)
    packed    PackedSFTDataset: whole examples packed, document masking (FlexAttention on CUDA, the exact masked
              SDPA on CPU): the same loss and gradients as padded (tests/test_documents.py)
    unmasked  the same packed rows without doc_ids / position_ids: attention across examples (packing as it was
              before document masking: a different objective, here as the speed bound)
Each mode runs `--steps` micro-batches of `--micro-batch-size` rows of a seeded shuffle (forward, loss, backward;
no optimizer step, which costs the same per step whatever the rows hold) after one warm-up micro-batch
(FlexAttention compiles there), with the torch kernels on CPU and tpzoo's default kernels on CUDA. Throughput =
example tokens (input slots holding an example, not padding) of the timed micro-batches / (their count x the
median micro-batch time). Goal on an H100/H200: packed >= 2x padded and within 5 % of
unmasked.
"""
from __future__ import annotations

import argparse
import statistics
import time

from mdsection import write_section  # noqa: E402 (a sibling script module)

MODES = ("padded", "packed", "unmasked")


def examples(n: int, seq_len: int, vocab: int, seed: int = 0) -> list:
    import numpy as np

    g = np.random.default_rng(seed)
    lengths = np.exp(g.uniform(np.log(max(2, seq_len // 64)), np.log(seq_len + 1), n)).astype(int)
    out = []
    for length in lengths:
        prompt = length // 4
        out.append((g.integers(0, vocab, length).tolist(), [i >= prompt for i in range(length)]))
    return out


def bench_config(args):
    from tpzoo.models import get_config

    cfg = get_config(args.model)
    if cfg.position == "learned" and cfg.max_position_embeddings < args.seq_len:
        raise SystemExit(f"{args.model} has {cfg.max_position_embeddings} positions, fewer than --seq-len")
    return cfg


def _example_slots(dataset, i: int) -> int:
    """Input slots of sample i that hold an example (the rest is padding)."""
    members = dataset.rows[i] if hasattr(dataset, "rows") else [i]
    return sum(len(dataset.examples[j][0]) - 1 for j in members)


def _rows(dataset, mode: str, first: int, count: int) -> tuple[dict, int]:
    """Rows [first, first + count) of a seeded shuffle (as the loader's; cycling) as a batch, and the example
    tokens they hold."""
    import numpy as np

    from tpzoo.data import collate_long

    order = np.random.default_rng(1).permutation(len(dataset))
    picked = [int(order[i % len(dataset)]) for i in range(first, first + count)]
    batch = collate_long([dataset[i] for i in picked])
    if mode == "unmasked":
        batch = {k: batch[k] for k in ("input_ids", "labels")}
    return batch, sum(_example_slots(dataset, i) for i in picked)


def measure(args, mode: str) -> dict:
    import torch

    from tpzoo import kernels as K
    from tpzoo.data import PackedSFTDataset, PaddedSFTDataset
    from tpzoo.models import Inputs, ModelLayout, Transformer

    device = torch.device(args.device)
    cfg = bench_config(args)
    exs = examples(args.examples, args.seq_len, cfg.vocab_size)
    data = (PaddedSFTDataset if mode == "padded" else PackedSFTDataset)(exs, args.seq_len, 0)
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[args.dtype]
    model = Transformer(cfg, ModelLayout(dtype=dtype, device=device), seed=0)
    b = args.micro_batch_size
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    times, tokens = [], 0
    with K.use_backend("torch" if device.type == "cpu" else None):
        for step in range(args.steps + 1):  # the first is warm-up (and FlexAttention's compilation)
            batch, real = _rows(data, mode, step * b, b)
            batch = {k: v.to(device) for k, v in batch.items()}
            sync()
            t0 = time.perf_counter()
            per_token = model(Inputs(batch["input_ids"], labels=batch["labels"], doc_ids=batch.get("doc_ids"),
                                     positions=batch.get("position_ids")))
            (per_token.sum() / (batch["labels"] != -100).sum()).backward()
            sync()
            if step:
                times.append(time.perf_counter() - t0)
                tokens += real
            model.zero_grad(set_to_none=True)
    rows = len(data)
    # the median step time: robust to other processes' bursts on a shared machine
    return {"rows": rows, "fill": sum(len(ids) - 1 for ids, _ in data.examples) / (rows * args.seq_len),
            "tokens_per_s": tokens / (statistics.median(times) * len(times)), "step_s": statistics.median(times)}


def section(args, results: dict) -> str:
    import torch

    where = (torch.cuda.get_device_name(0) if args.device.startswith("cuda") else
             f"CPU, {torch.get_num_threads()} threads, torch kernels")
    cfg = bench_config(args)
    cmd = (f"python scripts/bench/sft_packing.py --device {args.device} --model {args.model} --seq-len "
           f"{args.seq_len} --dtype {args.dtype} --micro-batch-size {args.micro_batch_size} --examples "
           f"{args.examples} --steps {args.steps}")
    pad, unm = results["padded"]["tokens_per_s"], results["unmasked"]["tokens_per_s"]
    lines = [f"## SFT packing: document masking vs padding ({where})", "",
             f"`{cmd}`", "",
             f"{args.examples} synthetic examples, lengths log-uniform in [{max(2, args.seq_len // 64)}, "
             f"{args.seq_len}] tokens, {cfg.name} ({cfg.num_parameters() / 1e6:.1f}M parameters), {args.dtype}, "
             f"micro-batches of {args.micro_batch_size} x {args.seq_len}; forward + backward, example tokens "
             "(not padding) per second at the median micro-batch time.", "",
             "| mode | rows for the examples | slots holding examples | example tokens/s | vs padded | vs unmasked |",
             "|---|---|---|---|---|---|"]
    for mode in MODES:
        r = results[mode]
        lines.append(f"| {mode} | {r['rows']} | {r['fill']:.1%} | {r['tokens_per_s']:,.0f} | "
                     f"{r['tokens_per_s'] / pad:.2f}x | {r['tokens_per_s'] / unm:.2f}x |")
    lines += ["", "packed = whole examples with document masking (the default of `tpzoo finetune`, same loss as "
                  "padded); unmasked = the same rows attending across examples (the old packing, not the same "
                  "objective: the speed bound). Goal on GPU: packed >= 2x padded, within 5 % of unmasked."]
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", default="cpu")
    p.add_argument("--model", default="tiny-llama")
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--dtype", default="fp32", choices=("fp32", "bf16"))
    p.add_argument("--micro-batch-size", type=int, default=4)
    p.add_argument("--examples", type=int, default=400)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--write", default="", help="(re)write this script's section of a markdown file")
    args = p.parse_args()
    results = {mode: measure(args, mode) for mode in MODES}
    text = section(args, results)
    print(text)
    if args.write:
        write_section(args.write, "sft-packing-" + ("gpu" if args.device.startswith("cuda") else "cpu"), text)


if __name__ == "__main__":
    main()
