"""Post-training step time: DPO and distillation against SFT, at the CPU bench size, through `tpzoo finetune`.

    python scripts/bench/post.py                              # prints the markdown section
    python scripts/bench/post.py --write docs/benchmarks.md   # and (re)writes its section there

Every case is the command a user types (`python -m tpzoo finetune ... --tp 1`, one fresh process each, 1 torch
thread), on the same random bench-llama (scripts/bench/train.py's 15.7 M-parameter LLaMA, saved once as a Hugging
Face directory: the --base), the byte tokenizer, and the same tensor shapes: --seq-len 256, micro-batch = global
batch = 4 rows. An SFT row holds one example of 256 tokens; a DPO row holds one pair (its chosen and rejected
responses, 128 tokens each, document-masked), so both objectives compute on the same tokens per step and the ratio is
what DPO adds: the reference pass (the base without adapters with LoRA; a frozen copy, or nothing with
--dpo-precompute-ref, for the full model). Distillation: the teacher is the same bench-llama, live (one more
forward) or read from a `tpzoo distill-cache` directory (K = 8), whose bytes per trained position are reported.
Step time = the median of the steps after the warm-up (metrics.jsonl's step_time); cases interleaved, each run
--repeats times, the fastest median kept.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

from mdsection import write_section  # noqa: E402 (a sibling script module)

HERE = os.path.dirname(os.path.abspath(__file__))
CHARS = "abcdefghijklmnopqrstuvwxyz "


def _text(rng, n: int) -> str:
    return "".join(rng.choice(CHARS) for _ in range(n))


def write_data(root: str, n: int = 64) -> tuple[str, str]:
    """SFT records of 256 byte tokens (fallback template: 24 of headers, 64 of prompt, the response, EOS) and
    preference pairs of two 128-token sides (the same prompt), filling a 256-token row."""
    import random

    rng = random.Random(0)
    sft, prefs = os.path.join(root, "sft.jsonl"), os.path.join(root, "prefs.jsonl")
    with open(sft, "w") as f, open(prefs, "w") as g:
        for _ in range(n):
            prompt = _text(rng, 64)
            f.write(json.dumps({"prompt": prompt, "response": _text(rng, 168)}) + "\n")
            g.write(json.dumps({"prompt": prompt, "chosen": _text(rng, 40), "rejected": _text(rng, 40)}) + "\n")
    return sft, prefs


CASES = {  # name: (data, extra flags)
    "sft, LoRA": ("sft", ["--lora-rank", "16"]),
    "dpo, LoRA (reference: adapters off)": ("prefs", ["--objective", "dpo", "--lora-rank", "16"]),
    "sft, full": ("sft", []),
    "dpo, full (frozen reference copy)": ("prefs", ["--objective", "dpo"]),
    "dpo, full (--dpo-precompute-ref)": ("prefs", ["--objective", "dpo", "--dpo-precompute-ref"]),
    "distill, full (live teacher)": ("sft", ["--objective", "distill", "--teacher", "{hf}"]),
    "distill, full (teacher cache, K = 8)": ("sft", ["--objective", "distill", "--teacher", "{cache}"]),
}
BASELINE = {"dpo, LoRA (reference: adapters off)": "sft, LoRA"}  # the others: "sft, full"


def run_case(name: str, files: dict, args) -> float | None:
    data, extra = CASES[name]
    log = tempfile.mkdtemp(prefix="tpzoo-bench-post-")
    cmd = [sys.executable, "-m", "tpzoo", "finetune", "--base", files["hf"], "--data", files[data], "--tp", "1",
           "--seq-len", "256", "--global-batch-size", "4", "--micro-batch-size", "4", "--steps",
           str(args.steps + args.warmup), "--eval-fraction", "0", "--save", "", "--log-dir", log, "--no-progress",
           "--quiet", "--template", "fallback", "--lr", "1e-4"] + [x.format(**files) for x in extra]
    out = subprocess.run(cmd, capture_output=True, text=True, env=dict(os.environ, OMP_NUM_THREADS="1"))
    if out.returncode != 0:
        print(f"{name} failed:\n{out.stdout[-2000:]}\n{out.stderr[-3000:]}", file=sys.stderr)
        return None
    rows = [json.loads(line) for line in open(os.path.join(log, "metrics.jsonl"))]
    return statistics.median(r["step_time"] for r in rows[args.warmup:])


def cache_bytes(files: dict, args) -> dict:
    out = subprocess.run([sys.executable, "-m", "tpzoo", "distill-cache", "--teacher", files["hf"], "--data",
                          files["sft"], "--out", files["cache"], "--distill-topk", "8", "--seq-len", "256",
                          "--template", "fallback", "--tokenizer", "byte"], capture_output=True, text=True,
                         env=dict(os.environ, OMP_NUM_THREADS="1"))
    if out.returncode != 0:
        raise SystemExit(f"distill-cache failed:\n{out.stdout}\n{out.stderr}")
    meta = json.loads(open(os.path.join(files["cache"], "index.json")).read())
    total = sum(os.path.getsize(os.path.join(files["cache"], f)) for f in os.listdir(files["cache"]))
    return {"positions": meta["positions"], "records": meta["records"], "arrays": meta["bytes_per_position"],
            "on_disk": total / meta["positions"]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=8, help="timed steps per case")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--write", metavar="MD")
    args = p.parse_args()
    load = os.getloadavg()[0]
    sys.path.insert(0, HERE)
    from train import make_hf_model  # the bench-llama of scripts/bench/train.py

    root = tempfile.mkdtemp(prefix="tpzoo-bench-post-")
    files = {"hf": os.path.join(root, "hf"), "cache": os.path.join(root, "cache")}
    make_hf_model(argparse.Namespace(model="bench-llama"), files["hf"])
    files["sft"], files["prefs"] = write_data(root)
    cache = cache_bytes(files, args)
    best: dict = {}
    for _ in range(args.repeats):
        for name in CASES:
            t = run_case(name, files, args)
            print(f"{name}: {t}", file=sys.stderr, flush=True)
            if t is not None and (name not in best or t < best[name]):
                best[name] = t
    lines = [f"Command: `python scripts/bench/post.py --write docs/benchmarks.md` (every case `python -m tpzoo "
             f"finetune --base BENCH_LLAMA_HF_DIR --tp 1 --seq-len 256 --global-batch-size 4 --micro-batch-size 4 "
             f"--template fallback ...` in a fresh process, 1 torch thread, {args.steps} timed steps after "
             f"{args.warmup} warm-up, cases interleaved, {args.repeats} runs each, the fastest median step kept). "
             f"bench-llama: 15.7 M parameters; an SFT row is one 256-token example, a DPO row one pair of two "
             f"128-token responses (the same tokens per step). Load average of the machine when the run started: "
             f"{load:.1f} (other jobs share the cores).", "",
             "| case | step (median) | over SFT |", "|---|---|---|"]
    for name in CASES:
        base = BASELINE.get(name, "sft, full" if "LoRA" not in name else "sft, LoRA")
        t = best.get(name)
        ratio = f"{t / best[base]:.2f}x" if t and best.get(base) else "-"
        lines.append(f"| {name} | {f'{t:.3f} s' if t else 'failed'} | {ratio} |")
    lines += ["", f"Teacher cache at K = 8 (`tpzoo distill-cache --distill-topk 8`): {cache['positions']:,} trained "
                  f"positions of {cache['records']} records; {cache['arrays']} bytes per position in its arrays "
                  f"(int32 ids + fp32 log-probabilities), {cache['on_disk']:.1f} bytes per position on disk with "
                  f"the offsets, hashes and index."]
    text = "\n".join(lines)
    print(text)
    if args.write:
        write_section(args.write, "post_training", "## Post-training: DPO and distillation step vs SFT (CPU)\n\n"
                      + text)


if __name__ == "__main__":
    main()
