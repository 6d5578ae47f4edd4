"""A LoRA training step with the routed experts adapted (`--lora-experts`) vs without, at the MoE bench size
(moe_train.bench_config: on CUDA Qwen3-30B-A3B's shapes with 8 of its layers in bf16, on CPU a toy Qwen3-MoE in
fp32). Both models: the same random base, all-linear adapters of rank 16 (alpha 32); one of them also one adapter per
expert. A step = forward + backward of the loss with the load-balancing loss + torch AdamW on the adapters; the two
alternate step by step after a warm-up. Each expert path the device runs is timed: on CUDA the grouped GEMMs where
they run (bf16, Hopper), on CPU the loop and the grouped path (grouped_mm_reference, a loop of matmuls too). Goal:
experts adapted <= 1.25x the step without.

    python scripts/bench/lora_experts.py [--device cuda] [--steps 8] [--write docs/benchmarks.md]
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from moe_train import alternate, bench_config  # noqa: E402  (the MoE bench size, its timing)

RANK, ALPHA = 16, 32.0


def build(cfg, dtype, device, experts: bool):
    from tpzoo.models import ModelLayout, Transformer
    from tpzoo.models.lora import LoRAConfig, add_lora, init_lora

    torch.manual_seed(0)
    model = Transformer(cfg, ModelLayout(dtype=dtype, device=device))
    add_lora([model], LoRAConfig(RANK, ALPHA, experts=experts))
    init_lora([model], 0)
    with torch.no_grad():  # B drawn non-zero: the adapters' full backward from the first step
        for n, p in model.named_parameters():
            if ".lora.B." in n:
                p.normal_(std=0.01)
    return model.train()


def step_fn(model, device):
    from tpzoo.models import Inputs

    fused = {"fused": True} if device.type == "cuda" else {}
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=1e-4, **fused)

    def step(ids):
        labels = torch.cat([ids[:, 1:], torch.full_like(ids[:, :1], -100)], 1)
        opt.zero_grad(set_to_none=True)
        loss = model(Inputs(ids, labels=labels)).sum() / (labels != -100).sum()
        loss.backward()
        opt.step()
        return loss.item()
    return step, sum(p.numel() for p in params)


def measure(device: str, n_steps: int) -> str:
    from tpzoo.models.kinds.experts import use_grouped
    from tpzoo.train.metrics import device_name

    device = torch.device(device)
    if device.type == "cpu":
        torch.set_num_threads(1)
    cfg, dtype, batch, seq = bench_config(device)
    t0 = time.perf_counter()
    models = {"without": build(cfg, dtype, device, False), "experts adapted": build(cfg, dtype, device, True)}
    first = next(layer.mlp for layer in models["without"].layers.values() if layer.mlp.kind == "moe")
    rows = torch.zeros(1, cfg.hidden_size, dtype=dtype, device=device)
    paths = ["grouped"] if use_grouped("auto", rows, first.gate_up, first.down, RANK) else ["loop", "grouped"]
    g = torch.Generator().manual_seed(1)
    batches = [torch.randint(0, cfg.vocab_size, (batch, seq), generator=g).to(device) for _ in range(n_steps + 1)]
    rows_md, ratios = [], {}
    for path in paths:
        fns, sizes = {}, {}
        for name, model in models.items():
            for layer in model.layers.values():
                if layer.mlp.kind == "moe":
                    layer.mlp.expert_gemm = path
            fns[name], sizes[name] = step_fn(model, device)
        times, _ = alternate(fns, batches, device)
        med = {name: statistics.median(ts) for name, ts in times.items()}
        ratios[path] = med["experts adapted"] / med["without"]
        for name in fns:
            rows_md.append(f"| {path} | {name} | {sizes[name]:,} | {batch * seq / med[name]:,.0f} | "
                           f"{med[name]:.4f} s | {med[name] / med['without']:.2f}x |")
    model = cfg.name if device.type == "cuda" else "a toy Qwen3-MoE (moe.py's CPU size)"
    text = (f"Command: `python scripts/bench/lora_experts.py --device {device.type} --steps {n_steps} --write "
            f"docs/benchmarks.md` on {device_name(device)}, torch {torch.__version__}, load average "
            f"{os.getloadavg()[0]:.1f} when it ran, {time.perf_counter() - t0:.0f} s. Model: {model} (hidden "
            f"{cfg.hidden_size}, {cfg.num_layers} layers, {cfg.num_experts} experts, top-{cfg.num_experts_per_tok}, "
            f"expert FFN {cfg.expert_ffn}, vocab {cfg.vocab_size}), {str(dtype).split('.')[-1]}, batch {batch} x "
            f"{seq} tokens; LoRA rank {RANK} on every linear layer, with and without one adapter per routed expert "
            f"(`--lora-experts`). A step = forward + backward with the load-balancing loss + AdamW on the "
            f"adapters, the two models alternating, median of {n_steps} after a warm-up "
            f"({'wall clock' if device.type == 'cuda' else 'CPU time of the process, one thread'}). Goal: the "
            f"experts adapted <= 1.25x the step without.")
    verdict = ", ".join(f"{p}: {r:.2f}x" for p, r in ratios.items())
    h, f = cfg.hidden_size, cfg.expert_ffn
    verdict += (f". Per dispatched row an expert's adapters add r (2h + 3f) = {RANK * (2 * h + 3 * f):,} multiply-adds "
                f"to its 3hf = {3 * h * f:,} ({100 * RANK * (2 * h + 3 * f) / (3 * h * f):.0f} %; Qwen3-30B-A3B at "
                f"rank 16: 2 %, DeepSeek-V3: 0.7 %)")
    return (f"## LoRA on the routed experts: step with vs without expert adapters ({device.type})\n\n{text}\n\n"
            "| experts path | adapters | trained elements | tokens/s | step (median) | vs without |\n"
            "|---|---|---|---|---|---|\n" + "\n".join(rows_md) + f"\n\nExperts adapted / without: {verdict}.\n")


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--write", help="replace this script's section of a markdown file (docs/benchmarks.md)")
    args = ap.parse_args(argv)
    body = measure(args.device, args.steps)
    print(body)
    if args.write:
        from mdsection import write_section

        write_section(args.write, f"lora_experts_{torch.device(args.device).type}", body)


if __name__ == "__main__":
    main()
