"""Mixture of experts: a training step (forward + backward with the load-balancing loss) of tpzoo vs transformers on
the same tiny Mixtral, on CPU, side by side in one process (alternating, median step); and the expert all-to-all
traffic of one forward at ep = 2, measured by tpzoo's collective counter, against the analytical count.

    python scripts/bench/moe.py                      # prints the markdown section
    python scripts/bench/moe.py --write docs/benchmarks.md
    python scripts/bench/moe.py --device cuda        # qwen3-30b-a3b-8l vs transformers on one GPU (moe_train.py)
    python scripts/bench/moe.py --device cpu --write docs/benchmarks.md   # the same at a toy size
    python scripts/bench/moe.py --family deepseek_v3 --write docs/benchmarks.md  # a cut DeepSeek-V3 (moe_deepseek.py)

Both implementations get the same weights (tpzoo loads transformers' save_pretrained) and the same batches;
transformers runs MixtralForCausalLM(input_ids, labels, output_router_logits=True).loss.backward(), tpzoo
Transformer(Inputs(ids, labels=labels)) (per-token loss with the router loss added) .sum() / tokens .backward(). Single thread.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from mdsection import write_section  # noqa: E402

SHAPE = dict(vocab_size=4096, hidden_size=256, intermediate_size=512, num_hidden_layers=4, num_attention_heads=8,
             num_key_value_heads=4, num_local_experts=8, num_experts_per_tok=2, max_position_embeddings=512,
             output_router_logits=True, router_aux_loss_coef=0.02)
BATCH, SEQ = 4, 256


def hf_model():
    import transformers as tf

    torch.manual_seed(0)
    return tf.MixtralForCausalLM(tf.MixtralConfig(**SHAPE)).train()


def tpzoo_model(path):
    from safetensors.torch import load_file

    from tpzoo.checkpoint.tensors import hf_to_full, load_full_tensors
    from tpzoo.models import Transformer, from_hf_config

    cfg = from_hf_config(path)
    model = Transformer(cfg)
    load_full_tensors(model, dict(hf_to_full(cfg, load_file(f"{path}/model.safetensors"))).__getitem__, 0, 1)
    return model.train()


def step_fns(hf, tz):
    from tpzoo.models import Inputs

    def hf_step(ids):
        hf.zero_grad(set_to_none=True)
        hf(input_ids=ids, labels=ids).loss.backward()

    labels_of = lambda ids: torch.cat([ids[:, 1:], torch.full_like(ids[:, :1], -100)], 1)  # noqa: E731

    def tz_step(ids):
        tz.zero_grad(set_to_none=True)
        labels = labels_of(ids)
        (tz(Inputs(ids, labels=labels)).sum() / (labels != -100).sum()).backward()
    return hf_step, tz_step


def a2a_forward(path, tokens_per_rank):
    """One forward at ep=2 on this rank (2 ranks): the counted expert traffic."""
    import tpzoo
    from tpzoo.checkpoint import load_model
    from tpzoo.parallel import count_collectives

    dims = tpzoo.init_parallel(ep=2)
    try:
        model = load_model(path)
        ids = torch.randint(0, SHAPE["vocab_size"], (1, tokens_per_rank), generator=torch.Generator().manual_seed(
            dims.rank))
        with torch.no_grad(), count_collectives() as c:
            model(ids)
        return {k: vars(v) for (k, g), v in c.stats.items() if g == "ep"}
    finally:
        tpzoo.destroy_parallel()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--write", help="markdown file to update (section moe)")
    ap.add_argument("--device", help="cpu or cuda: training steps of a Qwen3-MoE, tpzoo vs transformers "
                    "(moe_train.py) instead of the CPU Mixtral forward + backward and all-to-all count")
    ap.add_argument("--hf-experts", help="--device: transformers' experts implementation (default: its own "
                    "default, grouped_mm where it can)")
    ap.add_argument("--family", choices=("mixtral", "deepseek_v3"), default="mixtral",
                    help="deepseek_v3: a cut DeepSeek-V3's training step vs transformers on CPU (moe_deepseek.py)")
    args = ap.parse_args()
    if args.family == "deepseek_v3":
        from moe_deepseek import run

        body = run(args.steps)
        print(body)
        if args.write:
            write_section(args.write, "moe_deepseek_v3_cpu", body)
        return
    if args.device:
        from moe_train import run_device

        body = run_device(args.device, args.steps, args.hf_experts)
        print(body)
        if args.write:
            write_section(args.write, f"moe_train_{args.device.split(':')[0]}", body)
        return
    torch.set_num_threads(1)
    hf = hf_model()
    with tempfile.TemporaryDirectory() as d:
        hf.save_pretrained(d)
        tz = tpzoo_model(d)
        hf_step, tz_step = step_fns(hf, tz)
        g = torch.Generator().manual_seed(1)
        times = {"transformers": [], "tpzoo": []}
        for i in range(args.steps + 1):  # alternating; the first of each is warm-up
            ids = torch.randint(0, SHAPE["vocab_size"], (BATCH, SEQ), generator=g)
            for name, fn in (("transformers", hf_step), ("tpzoo", tz_step)):
                t = time.perf_counter()
                fn(ids)
                if i:
                    times[name].append(time.perf_counter() - t)
        from tpzoo.testing import run_on_ranks, shutdown_pools

        per_rank = run_on_ranks(2, a2a_forward, d, SEQ)
        shutdown_pools()
    layers, k, h = SHAPE["num_hidden_layers"], SHAPE["num_experts_per_tok"], SHAPE["hidden_size"]
    rows = [f"| {n} | {BATCH * SEQ / statistics.median(ts):,.0f} | {statistics.median(ts):.3f} s |"
            for n, ts in times.items()]
    counts = per_rank[0]
    v = counts["all_to_all_v"]
    sent_total = sum(r["all_to_all_v"]["payload_bytes"] for r in per_rank)
    analytic = 2 * 2 * layers * SEQ * k * h * 4  # 2 ranks, there and back, T*k rows of h fp32 per layer
    load = os.getloadavg()[0]
    body = f"""## Mixture of experts: training step vs transformers, expert all-to-all (CPU)

Command: `python scripts/bench/moe.py --write docs/benchmarks.md` (one process, 1 thread, the two implementations
alternating, {args.steps} timed steps each after one warm-up; load average {load:.1f} when it ran: the cores are
shared, compare the two rows, not absolute numbers). Model: Mixtral-shaped, hidden {h}, {layers} layers, 8 experts,
top-{k}, expert FFN {SHAPE['intermediate_size']}, vocab {SHAPE['vocab_size']}; batch {BATCH} x {SEQ} tokens, fp32;
a step = forward + backward of the loss with the load-balancing loss (no optimizer). Same weights (tpzoo reads
transformers' save_pretrained). tpzoo sorts the assignments by expert once and runs each expert on one contiguous
row block; transformers loops over the experts hit with a one-hot mask and `index_add_`.

| implementation | tokens/s (median step) | step (median) |
|---|---|---|
{chr(10).join(rows)}

Expert all-to-all of one forward at ep = 2 (2 gloo ranks, {SEQ} tokens each, counted by
`tpzoo.parallel.count_collectives`): rank 0 issued {counts['all_to_all']['calls']} all-to-alls of the expert counts
({counts['all_to_all']['payload_bytes']} bytes: {layers} layers x 8 int64) and {v['calls']} `all_to_all_v` of rows
(2 per layer: dispatch and return). Their payload on both ranks (every dispatched row, those a rank keeps for its own
experts included): {sent_total:,} bytes; analytical 2 ranks x 2 x {layers}
layers x {SEQ} tokens x top-{k} x {h} x 4 bytes = {analytic:,} bytes ({'equal' if sent_total == analytic else 'DIFFERENT'}).
"""
    print(body)
    if args.write:
        write_section(args.write, "moe", body)


if __name__ == "__main__":
    main()
