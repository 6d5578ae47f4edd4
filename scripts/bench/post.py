"""Post-training step time: DPO and distillation against SFT, side by side, at the CPU bench size.

    python scripts/bench/post.py                              # prints the markdown section
    python scripts/bench/post.py --write docs/benchmarks.md   # and (re)writes its section there

The trainers are `tpzoo finetune`'s (tpzoo.train.loop.Trainer: what each rank runs), one per case, built in one
process (1 torch thread) on the same random bench-llama (scripts/bench/train.py's 15.7 M-parameter LLaMA, saved
once as a Hugging Face directory: the --base) with the byte tokenizer and the same tensor shapes: seq_len 256,
micro-batch = global batch = 4 rows. Their steps alternate (step 1 of every case, then step 2, ...), so every case
sees the same load of a shared machine, and each case's step time is the median of its steps after the warm-up.
An SFT row holds one example of 256 tokens; a DPO row one pair (chosen and rejected, 128 tokens each,
document-masked): both objectives compute on the same tokens per step, and the ratio is what DPO adds: the
reference pass (the base without adapters with LoRA; a frozen copy, or nothing with --dpo-precompute-ref, for the
full model). Distillation: the teacher is the same bench-llama, live (one more forward) or read from a
`tpzoo distill-cache` directory (K = 8), whose bytes per trained position are reported.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

from mdsection import write_section  # noqa: E402 (a sibling script module)

HERE = os.path.dirname(os.path.abspath(__file__))
CHARS = "abcdefghijklmnopqrstuvwxyz "

# name: (data, config overrides, the SFT case it is compared with)
CASES = {
    "sft, LoRA": ("sft", {"lora_rank": 16}, None),
    "dpo, LoRA (reference: adapters off)": ("prefs", {"objective": "dpo", "lora_rank": 16}, "sft, LoRA"),
    "sft, full": ("sft", {}, None),
    "dpo, full (frozen reference copy)": ("prefs", {"objective": "dpo"}, "sft, full"),
    "dpo, full (--dpo-precompute-ref)": ("prefs", {"objective": "dpo", "dpo_precompute_ref": True}, "sft, full"),
    "distill, full (live teacher)": ("sft", {"objective": "distill", "teacher": "{hf}"}, "sft, full"),
    "distill, full (teacher cache, K = 8)": ("sft", {"objective": "distill", "teacher": "{cache}"}, "sft, full"),
}


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


def write_cache(files: dict) -> dict:
    """`tpzoo distill-cache --distill-topk 8` of the SFT file; its bytes per trained position."""
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


def step_times(files: dict, names: list, steps: int) -> dict:
    """Every case's trainer in this process, their steps alternating: {name: [seconds per step]}."""
    from tpzoo.train import load_config

    return alternating_steps({name: load_config(None, {
        "task": "sft", "base": files["hf"], "data": [files[CASES[name][0]]], "tp": 1, "seq_len": 256,
        "global_batch_size": 4, "micro_batch_size": 4, "steps": steps, "eval_fraction": 0.0, "save": "",
        "quiet": True, "progress": False, "template": "fallback", "lr": 1e-4, "warmup_steps": 0, "sample_prompt": "",
        **{k: v.format(**files) if isinstance(v, str) else v for k, v in CASES[name][1].items()}}) for name in names},
        steps)


def alternating_steps(configs: dict, steps: int) -> dict:
    """A `tpzoo` trainer per TrainConfig of `configs` ({name: config}) in this process at tp 1 on one torch thread,
    their steps alternating (every case sees the same load of a shared machine): {name: [seconds per step]}
    (also scripts/bench/mtp.py's)."""
    import torch

    import tpzoo
    from tpzoo.train.loop import Trainer

    torch.set_num_threads(1)
    dims = tpzoo.init_parallel(tp=1, device="cpu")
    trainers, times = {}, {name: [] for name in configs}
    try:
        for name, cfg in configs.items():
            trainers[name] = Trainer(cfg, dims)
        for step in range(1, steps + 1):
            for name, trainer in trainers.items():
                t0 = time.perf_counter()
                trainer.train_step(step)
                times[name].append(time.perf_counter() - t0)
    finally:
        for trainer in trainers.values():
            trainer.close()
        tpzoo.destroy_parallel()
    return times


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=10, help="timed steps per case")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--write", metavar="MD")
    args = p.parse_args()
    load = os.getloadavg()[0]
    sys.path.insert(0, HERE)
    from train import make_hf_model  # the bench-llama of scripts/bench/train.py

    root = tempfile.mkdtemp(prefix="tpzoo-bench-post-")
    files = {"hf": os.path.join(root, "hf"), "cache": os.path.join(root, "cache")}
    make_hf_model(argparse.Namespace(model="bench-llama"), files["hf"])
    files["sft"], files["prefs"] = write_data(root)
    cache = write_cache(files)
    times = step_times(files, list(CASES), args.warmup + args.steps)
    median = {name: statistics.median(t[args.warmup:]) for name, t in times.items()}
    lines = [f"Command: `python scripts/bench/post.py --write docs/benchmarks.md` (one process, 1 torch thread: a "
             f"`tpzoo finetune` trainer per case at tp 1, their steps alternating so that every case sees the same "
             f"load; {args.steps} timed steps each after {args.warmup} warm-up, the median reported). bench-llama: "
             f"15.7 M parameters, fp32, batch 4 x 256 tokens; an SFT row is one 256-token example, a DPO row one "
             f"pair of two 128-token responses (the same tokens per step); LoRA rank 16 on every linear layer. Load "
             f"average of the machine when the run started: {load:.1f} (other jobs share the cores).", "",
             "| case | step (median) | over its SFT |", "|---|---|---|"]
    for name, (_, _, base) in CASES.items():
        ratio = f"{median[name] / median[base]:.2f}x" if base else "1.00x"
        lines.append(f"| {name} | {median[name]:.3f} s | {ratio} |")
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
