"""Training across a slow link: synchronous replicas vs DiLoCo and Streaming DiLoCo (bytes, time, loss).

    python scripts/bench/diloco.py                               # the table (about an hour on 2 busy cores)
    python scripts/bench/diloco.py --write docs/benchmarks.md    # ... into its section of docs/benchmarks.md

Every run is the command users type: `tpzoo pretrain` on the demo model (tiny-gpt, the byte tokenizer, the
Python standard library's sources) at `--tp 1 --dp 2 --replicas 2` (2 self-spawned ranks, one per replica, so
each rank's whole gradient crosses the link), small steps (8 x 128 tokens) so that the link matters, with
`--emulate-link GBPS:5` between the replicas. Forms: synchronous (--sync-every 1, the hierarchical
all-reduce of the fp32 gradients every step), DiLoCo (--sync-every H) and Streaming DiLoCo (H, 2 fragments, an
overlap of 1 step, bf16 outer gradients), H in 10 and 50, with --outer-lr 0.5 --outer-momentum 0.5. Per form:
the bytes a rank sent across replicas per 100 steps (metrics.jsonl's sync_bytes), the held-out loss at steps
100 and 300 (`--eval-every 100`; a DiLoCo run's is replica 0's model on the whole held-out set) and, at each link
speed, tokens/s over steps 11 to 100 (wall time of the steps, both ranks in one run). The link does not change
what is computed (the 300-step runs use the slowest link; the others run 100 steps). `--lr-sweep` adds
300-step runs of DiLoCo H=10 at other outer learning rates and momenta (no emulated link).
"""
from __future__ import annotations

import argparse
import json
import os
import pathlib
import subprocess
import sys
import tempfile
import time

from mdsection import write_section  # noqa: E402 (a sibling script module)

ROOT = pathlib.Path(__file__).resolve().parents[2]
BASE = ["--model", "tiny-gpt", "--tp", "1", "--dp", "2", "--replicas", "2", "--seq-len", "128",
        "--global-batch-size", "8", "--micro-batch-size", "4", "--warmup-steps", "15", "--lr", "3e-3",
        "--min-lr", "3e-4", "--eval-batches", "8", "--sample-prompt", "", "--log-interval", "50", "--quiet"]
FORMS = {  # name -> flags
    "synchronous": ["--sync-every", "1"],
    "DiLoCo H=10": ["--sync-every", "10"],
    "Streaming H=10": ["--sync-every", "10", "--sync-fragments", "2", "--sync-overlap", "1", "--sync-dtype", "bf16"],
    "DiLoCo H=50": ["--sync-every", "50"],
    "Streaming H=50": ["--sync-every", "50", "--sync-fragments", "2", "--sync-overlap", "1", "--sync-dtype", "bf16"],
}
OUTER = ["--outer-lr", "0.5", "--outer-momentum", "0.5"]
TOKENS_PER_STEP = 8 * 128
LINKS = ("0.1", "1", "10")
SWEEP = [("0.7", "0.9"), ("0.5", "0.5"), ("0.5", "0.0"), ("0.3", "0.5"), ("1.0", "0.0")]


def run(flags: list[str], steps: int, out: pathlib.Path, data_cache: str) -> dict:
    """One `tpzoo pretrain` run; its metrics rows (rank 0) and wall time."""
    log = out / "log"
    cmd = [sys.executable, "-m", "tpzoo", "pretrain", *BASE, *flags, "--steps", str(steps), "--save", "",
           "--log-dir", str(log), "--data-cache", data_cache]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True,
                          env={k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE")})
    if proc.returncode:
        raise SystemExit(f"failed: {' '.join(cmd)}\n{proc.stderr[-3000:]}")
    rows = [json.loads(line) for line in (log / "metrics.jsonl").read_text().splitlines()]
    return {"rows": rows, "wall": time.perf_counter() - t0}


def summary(rows: list[dict]) -> dict:
    timed = [r for r in rows if 10 < r["step"] <= 100]
    tokens = len(timed) * TOKENS_PER_STEP  # the whole job's (a DiLoCo row's "tokens" is replica 0's)
    return {"tok_s": tokens / sum(r["step_time"] for r in timed),
            "bytes_100": sum(r["sync_bytes"] for r in rows if r["step"] <= 100),
            "sync_s": sum(r["sync_s"] for r in timed) / len(timed),
            "eval": {r["step"]: r["eval_loss"] for r in rows if r.get("eval_loss") is not None}}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--write", type=pathlib.Path, help="markdown file whose section to (re)write")
    parser.add_argument("--lr-sweep", action="store_true", help="also the outer lr / momentum sweep")
    parser.add_argument("--data-cache", default=str(ROOT / "runs" / "data"))
    args = parser.parse_args(argv)
    load = os.getloadavg()[0]
    results: dict = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name, flags in FORMS.items():
            for link in LINKS:
                steps = 300 if link == LINKS[0] else 100
                where = pathlib.Path(tmp) / f"{len(results)}"
                r = run(flags + OUTER + ["--emulate-link", f"{link}:5", "--eval-every", "100"], steps, where,
                        args.data_cache)
                results[(name, link)] = summary(r["rows"])
                print(name, link, {k: v for k, v in results[(name, link)].items()}, f"{r['wall']:.0f}s",
                      flush=True)
        sweep = {}
        if args.lr_sweep:
            for lr, mom in SWEEP:
                where = pathlib.Path(tmp) / f"sweep-{lr}-{mom}"
                r = run(FORMS["DiLoCo H=10"] + ["--outer-lr", lr, "--outer-momentum", mom, "--eval-every", "100"],
                        300, where, args.data_cache)
                sweep[(lr, mom)] = summary(r["rows"])["eval"]
                print("sweep", lr, mom, sweep[(lr, mom)], flush=True)
    body = render(results, sweep, load, argv)
    print(body)
    if args.write:
        write_section(args.write, "diloco", body)


def render(results: dict, sweep: dict, load: float, argv) -> str:
    sync = results[("synchronous", LINKS[0])]["eval"]
    lines = ["## Training across a slow link: synchronous replicas vs DiLoCo (CPU, 2 ranks)", "",
             f"`python scripts/bench/diloco.py{' ' + ' '.join(argv) if argv else ''}` (load average "
             f"{load:.0f} at the start). `tpzoo pretrain {' '.join(BASE[:-1])} --steps 300 <form> "
             f"{' '.join(OUTER)} --emulate-link GBPS:5 --eval-every 100`: 2 replicas of one rank each, 8 x 128 "
             f"tokens per step. Bytes: sent across replicas by one rank per 100 steps (sync_bytes); loss: held-out, "
             f"at steps 100 and 300 (ratio to synchronous); tokens/s over steps 11-100 at each emulated link "
             f"(Gbit/s, + 5 ms).", "",
             "| form | MB / 100 steps | loss @100 | loss @300 | " + " | ".join(f"tok/s @{g}" for g in LINKS)
             + " | speed-up @0.1 |",
             "|---|---|---|---|---|" + "---|" * len(LINKS)]
    base = results[("synchronous", LINKS[0])]["tok_s"]
    for name in FORMS:
        r = results[(name, LINKS[0])]
        losses = [f"{r['eval'][s]:.4f} ({r['eval'][s] / sync[s]:.3f})" for s in (100, 300)]
        lines.append(f"| {name} | {r['bytes_100'] / 1e6:,.2f} | {losses[0]} | {losses[1]} | "
                     + " | ".join(f"{results[(name, g)]['tok_s']:,.0f}" for g in LINKS)
                     + f" | {r['tok_s'] / base:.1f}x |")
    if sweep:
        lines += ["", "Outer learning rate and momentum, DiLoCo H=10, 300 steps (held-out loss at 100 / 300; "
                      "synchronous: " + f"{sync[100]:.4f} / {sync[300]:.4f}):", "",
                  "| outer lr | outer momentum | loss @100 | loss @300 |", "|---|---|---|---|"]
        for (lr, mom), ev in sweep.items():
            lines.append(f"| {lr} | {mom} | {ev[100]:.4f} ({ev[100] / sync[100]:.3f}) | "
                         f"{ev[300]:.4f} ({ev[300] / sync[300]:.3f}) |")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
