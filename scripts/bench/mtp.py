"""Multi-token prediction (models/mtp.py): what one depth costs a training step, and what it buys as a draft.

    python scripts/bench/mtp.py                              # prints the markdown section
    python scripts/bench/mtp.py --write docs/benchmarks.md   # and (re)writes its section there

1. Step time with one MTP depth over without, at the CPU bench size: bench-llama (scripts/bench/train.py's
   15.7 M-parameter LLaMA, vocabulary 8192) pretrained from scratch at tp 1 (`--mtp-layers 1` for the MTP case,
   the default weight 0.1), seq 256, batch 4, fp32, 1 torch thread, in one process: the two trainers' steps
   alternate (every case sees the same load of a shared machine), the median after the warm-up.
2. Drafting: a small LLaMA (hidden 192, 4 layers, the byte tokenizer) with one depth pretrained for --train-steps
   steps on Python's own source (the standard library's argparse.py and textwrap.py), then `tpzoo generate CKPT
   --draft mtp --json` as a user types it, greedy and sampling (temperature 0.8, seed 1), on the first lines of
   another file of the library: the drafts' acceptance, tokens per verifying forward and tokens/s beside plain
   decoding's (both measured by the command, in one process).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import sysconfig
import tempfile
from pathlib import Path

from mdsection import write_section  # noqa: E402 (a sibling script module)

HERE = os.path.dirname(os.path.abspath(__file__))
STDLIB = Path(sysconfig.get_paths()["stdlib"])


def _small():
    from tpzoo.models import ModelConfig

    return ModelConfig.from_dict(dict(family="llama", vocab_size=259, hidden_size=192, num_layers=4, num_heads=6,
                                      num_kv_heads=2, ffn_hidden_size=512, max_position_embeddings=1024,
                                      name="bench-mtp-small"))


def step_times(corpus: str, cache: str, steps: int) -> dict:
    """The bench-llama trainers without and with one depth, steps alternating: {case: [seconds per step]}."""
    from tpzoo.models.registry import register_config
    from tpzoo.train import load_config

    sys.path.insert(0, HERE)
    from post import alternating_steps
    from train import bench_config

    register_config("bench-llama", bench_config(argparse.Namespace(model="bench-llama")))
    cases = {"without MTP": 0, "one MTP depth (S = 0.1)": 1}
    return alternating_steps({name: load_config(None, {
        "task": "pretrain", "model": "bench-llama", "vocab_size": 8192, "data": [corpus], "data_cache": cache,
        "tp": 1, "seq_len": 256, "global_batch_size": 4, "micro_batch_size": 4, "steps": steps, "eval_fraction": 0.0,
        "save": "", "quiet": True, "progress": False, "lr": 1e-4, "warmup_steps": 0, "sample_prompt": "",
        "mtp_layers": depths}) for name, depths in cases.items()}, steps)


def train_drafter(corpus: str, cache: str, save: str, steps: int) -> dict:
    """Pretrain the small model with one depth; its last logged losses."""
    import torch

    from tpzoo.models.registry import register_config
    from tpzoo.train import load_config
    from tpzoo.train.loop import train

    register_config("bench-mtp-small", _small())
    torch.set_num_threads(2)
    cfg = load_config(None, {"task": "pretrain", "model": "bench-mtp-small", "data": [corpus], "data_cache": cache,
                             "tp": 1, "seq_len": 128, "global_batch_size": 8, "micro_batch_size": 8,
                             "steps": steps, "eval_fraction": 0.0, "save": save, "save_every": steps,
                             "quiet": True, "progress": False, "lr": 2e-3, "warmup_steps": 20,
                             "sample_prompt": "", "mtp_layers": 1, "log_interval": 10})
    train(cfg)
    rows = [json.loads(line) for line in (Path(save) / "metrics.jsonl").read_text().splitlines()]
    rows = [r for r in rows if "loss" in r]
    return {"loss": rows[-1]["loss"], "mtp_loss": rows[-1]["mtp_loss"], "step": rows[-1]["step"]}


def draft(ckpt: str, prompt: str, new: int, *sampling) -> dict:
    out = subprocess.run([sys.executable, "-m", "tpzoo", "generate", ckpt, "--prompt", prompt, "--draft", "mtp",
                          "--max-new-tokens", str(new), "--tp", "1", "--ignore-eos", "--json", *sampling],
                         capture_output=True, text=True, env=dict(os.environ, OMP_NUM_THREADS="2"))
    if out.returncode != 0:
        raise SystemExit(f"generate failed:\n{out.stdout}\n{out.stderr}")
    return json.loads(out.stdout.strip().splitlines()[-1])["draft"]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=8, help="timed steps per case (part 1)")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--train-steps", type=int, default=300, help="the drafter's pretraining steps (part 2)")
    p.add_argument("--new-tokens", type=int, default=200)
    p.add_argument("--write", metavar="MD")
    args = p.parse_args()
    load = os.getloadavg()[0]
    root = tempfile.mkdtemp(prefix="tpzoo-bench-mtp-")
    corpus = os.path.join(root, "corpus.txt")
    Path(corpus).write_text((STDLIB / "argparse.py").read_text() + (STDLIB / "textwrap.py").read_text())
    times = step_times(corpus, os.path.join(root, "cache"), args.warmup + args.steps)
    median = {name: statistics.median(t[args.warmup:]) for name, t in times.items()}
    base = median["without MTP"]
    trained = train_drafter(corpus, os.path.join(root, "cache"), os.path.join(root, "small"), args.train_steps)
    ckpt = os.path.join(root, "small", f"step_{args.train_steps:08d}")
    prompt = "\n".join((STDLIB / "shlex.py").read_text().splitlines()[:12]) + "\n"
    greedy = draft(ckpt, prompt, args.new_tokens, "--greedy")
    sampled = draft(ckpt, prompt, args.new_tokens, "--temperature", "0.8", "--seed", "1")
    lines = [f"Command: `python scripts/bench/mtp.py --write docs/benchmarks.md`. Load average of the machine when "
             f"the run started: {load:.1f} (other jobs share the cores: compare rows of one table).", "",
             f"Training step, bench-llama (15.7 M parameters, vocabulary 8192) pretrained at tp 1, fp32, batch 4 x 256 "
             f"tokens, 1 torch thread, the two trainers' steps alternating, {args.steps} timed steps each after "
             f"{args.warmup} warm-up (median):", "",
             "| case | step (median) | over without |", "|---|---|---|"]
    for name, t in median.items():
        lines.append(f"| {name} | {t:.3f} s | {t / base:.2f}x |")
    lines += ["", f"Drafting: a LLaMA of hidden 192, 4 layers, the byte tokenizer, one MTP depth, pretrained for "
                  f"{trained['step']} steps (8 x 128 tokens, lr 2e-3) on the standard library's argparse.py and "
                  f"textwrap.py (last logged loss {trained['loss']:.3f}, mtp_loss {trained['mtp_loss']:.3f}); "
                  f"`tpzoo generate CKPT --draft mtp --tp 1 --json` of {args.new_tokens} tokens after the first 12 "
                  f"lines of shlex.py, 2 threads:", "",
             "| decoding | drafts accepted | tokens per verifying forward | tokens/s (draft) | tokens/s (plain) | "
             "speed-up | output = plain |", "|---|---|---|---|---|---|---|"]
    for name, r in (("greedy", greedy), ("sampling, T 0.8, seed 1", sampled)):
        same = {True: "yes", False: "NO", None: "(sampling)"}[r["same_as_plain"]]
        lines.append(f"| {name} | {r['accepted']}/{r['drafted']} ({100 * r['acceptance']:.1f}%) | "
                     f"{r['tokens_per_step']:.2f} | {r['tokens_per_s']:.1f} | {r['plain_tokens_per_s']:.1f} | "
                     f"{r['tokens_per_s'] / r['plain_tokens_per_s']:.2f}x | {same} |")
    text = "\n".join(lines)
    print(text)
    if args.write:
        write_section(args.write, "mtp", "## Multi-token prediction: step time and the MTP draft (CPU)\n\n" + text)


if __name__ == "__main__":
    main()
