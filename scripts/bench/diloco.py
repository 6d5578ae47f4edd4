"""Training across a slow link: synchronous replicas vs DiLoCo and Streaming DiLoCo (bytes, time, loss).

    python scripts/bench/diloco.py                               # the tables (about 40 minutes on 2 busy cores)
    python scripts/bench/diloco.py --write docs/benchmarks.md    # ... into its section of docs/benchmarks.md

Every run is the command users type: `tpzoo pretrain` on the demo model (tiny-gpt, the byte tokenizer, the
Python standard library's sources) at `--tp 1 --dp 2 --replicas 2` (2 self-spawned ranks, one per replica, so
each rank's whole gradient crosses the link), small steps (8 x 128 tokens) so that the link matters. Forms:
synchronous (--sync-every 1: the hierarchical all-reduce of the fp32 gradients every step), DiLoCo (--sync-every
H) and Streaming DiLoCo (H, 2 fragments, an overlap of 1 step, bf16 outer gradients), H in 10 and 50, all with
--outer-lr 0.5 --outer-momentum 0.5.

- Loss: 300-step runs without an emulated link (the link changes no value), at two seeds: the held-out loss at
  steps 100 and 300 (`--eval-every 100`; a DiLoCo run's is replica 0's model on the same held-out sequences) and
  the bytes one rank sent across replicas per 100 steps (metrics.jsonl's sync_bytes). `--lr-sweep`: DiLoCo H=10 at
  other outer learning rates and momenta (first seed).
- Speed: 60-step runs with `--emulate-link GBPS:5` (and without: the compute alone), tokens/s over steps 11-60
  (the step times rank 0 logs; every step's work is the whole job's 8 x 128 tokens). The machine is shared, so
  its load drifts: the forms run one after another at each link, twice, and the speed-up is the median of the
  two ratios to the synchronous run next to it in time.
"""
from __future__ import annotations

import argparse
import json
import os
import pathlib
import statistics
import subprocess
import sys
import tempfile

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
LINKS = ("none", "0.1", "1", "10")
SEEDS = ("1234", "7")
SWEEP = [("0.7", "0.9"), ("0.5", "0.0"), ("0.3", "0.5"), ("1.0", "0.0")]


def run(flags: list[str], steps: int, out: pathlib.Path, data_cache: str) -> list[dict]:
    """One `tpzoo pretrain` run; its metrics rows (rank 0)."""
    log = out / "log"
    cmd = [sys.executable, "-m", "tpzoo", "pretrain", *BASE, *flags, "--steps", str(steps), "--save", "",
           "--log-dir", str(log), "--data-cache", data_cache]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True,
                          env={k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE")})
    if proc.returncode:
        raise SystemExit(f"failed: {' '.join(cmd)}\n{proc.stderr[-3000:]}")
    return [json.loads(line) for line in (log / "metrics.jsonl").read_text().splitlines()]


def quality(rows: list[dict]) -> dict:
    return {"bytes_100": sum(r["sync_bytes"] for r in rows if r["step"] <= 100),
            "eval": {r["step"]: r["eval_loss"] for r in rows if r.get("eval_loss") is not None}}


def speed(rows: list[dict]) -> dict:
    timed = [r for r in rows if r["step"] > 10]
    seconds = sum(r["step_time"] for r in timed)
    return {"tok_s": len(timed) * TOKENS_PER_STEP / seconds, "link_share": sum(r["sync_s"] for r in timed) / seconds}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--write", type=pathlib.Path, help="markdown file whose section to (re)write")
    parser.add_argument("--lr-sweep", action="store_true", help="also the outer lr / momentum sweep")
    parser.add_argument("--data-cache", default=str(ROOT / "runs" / "data"))
    args = parser.parse_args(argv)
    loads = [os.getloadavg()[0]]
    loss, sweep, fast = {}, {}, {}
    with tempfile.TemporaryDirectory() as tmp:
        n = iter(range(10 ** 6))
        for seed in SEEDS:
            for name, flags in FORMS.items():
                rows = run(flags + OUTER + ["--seed", seed, "--eval-every", "100"], 300,
                           pathlib.Path(tmp) / str(next(n)), args.data_cache)
                loss[(name, seed)] = quality(rows)
                print("loss", name, seed, loss[(name, seed)], flush=True)
        if args.lr_sweep:
            for lr, mom in SWEEP:
                rows = run(FORMS["DiLoCo H=10"] + ["--outer-lr", lr, "--outer-momentum", mom, "--seed", SEEDS[0],
                                                   "--eval-every", "100"], 300, pathlib.Path(tmp) / str(next(n)),
                           args.data_cache)
                sweep[(lr, mom)] = quality(rows)["eval"]
                print("sweep", lr, mom, sweep[(lr, mom)], flush=True)
        loads.append(os.getloadavg()[0])
        for rep in range(2):
            for link in LINKS:
                for name, flags in FORMS.items():
                    emulate = [] if link == "none" else ["--emulate-link", f"{link}:5"]
                    rows = run(flags + OUTER + emulate, 60, pathlib.Path(tmp) / str(next(n)), args.data_cache)
                    fast[(name, link, rep)] = speed(rows)
                    print("speed", name, link, rep, fast[(name, link, rep)], flush=True)
        loads.append(os.getloadavg()[0])
    body = render(loss, sweep, fast, loads, argv)
    print(body)
    if args.write:
        write_section(args.write, "diloco", body)


def _median2(values: list[float]) -> float:
    return statistics.median(values)


def render(loss: dict, sweep: dict, fast: dict, loads: list[float], argv) -> str:
    sync = {seed: loss[("synchronous", seed)]["eval"] for seed in SEEDS}
    ratio = lambda ev, seed, step: ev[step] / sync[seed][step]  # noqa: E731
    cmd = (f"tpzoo pretrain {' '.join(a if a else repr(a) for a in BASE)} <form> {' '.join(OUTER)} "
           f"[--emulate-link GBPS:5]")
    lines = ["## Training across a slow link: synchronous replicas vs DiLoCo (CPU, 2 ranks)", "",
             f"`python scripts/bench/diloco.py{' ' + ' '.join(argv) if argv else ''}`, the 2-core machine shared "
             f"with other jobs (load average {', '.join(f'{x:.0f}' for x in loads)} at the start, after the loss "
             f"runs, at the end). Each run: `{cmd}`: 2 replicas of one rank each, 8 x 128 tokens per step, "
             f"the demo model (tiny-gpt, {loss[('DiLoCo H=10', SEEDS[0])]['bytes_100'] / 40:,.0f} fp32 "
             f"parameters: 10 syncs of 4 bytes each per 100 steps at H=10). Forms: synchronous `--sync-every 1`; "
             f"DiLoCo `--sync-every H`; Streaming `--sync-every H --sync-fragments 2 --sync-overlap 1 "
             f"--sync-dtype bf16`.", "",
             "Loss: 300 steps, held-out loss at steps 100 and 300 (ratio to synchronous at the same seed), seeds "
             f"{' / '.join(SEEDS)}; bytes sent across replicas by one rank per 100 steps (sync_bytes).", "",
             "| form | MB / 100 steps | loss @100 | loss @300 |", "|---|---|---|---|"]
    for name in FORMS:
        cells = []
        for step in (100, 300):
            ev = [loss[(name, seed)]["eval"] for seed in SEEDS]
            cells.append(" / ".join(f"{e[step]:.3f} ({ratio(e, seed, step):.3f})" for e, seed in zip(ev, SEEDS)))
        lines.append(f"| {name} | {loss[(name, SEEDS[0])]['bytes_100'] / 1e6:,.2f} | {cells[0]} | {cells[1]} |")
    if sweep:
        ev0 = loss[("DiLoCo H=10", SEEDS[0])]["eval"]
        lines += ["", f"Outer learning rate and momentum, DiLoCo H=10, 300 steps, seed {SEEDS[0]} (held-out loss, "
                      f"ratio to synchronous):", "",
                  "| outer lr | outer momentum | loss @100 | loss @300 |", "|---|---|---|---|"]
        order = sorted({**sweep, ("0.5", "0.5"): ev0}.items(), key=lambda kv: (-float(kv[0][1]), -float(kv[0][0])))
        for (lr, mom), ev in order:
            lines.append(f"| {lr} | {mom} | {ev[100]:.3f} ({ratio(ev, SEEDS[0], 100):.3f}) | "
                         f"{ev[300]:.3f} ({ratio(ev, SEEDS[0], 300):.3f}) |")
    lines += ["", "Speed: tokens/s over steps 11-60 of 60-step runs, both runs (in brackets the share of the "
                  "step time blocked on the link, sync_s), per emulated link (Gbit/s per rank, + 5 ms; none: "
                  "no emulation).", "",
              "| form | " + " | ".join(f"tok/s @{g}" for g in LINKS) + " |", "|---|" + "---|" * len(LINKS)]
    for name in FORMS:
        runs = {link: [fast[(name, link, rep)] for rep in range(2)] for link in LINKS}
        cells = [" / ".join(f"{r['tok_s']:,.0f} ({100 * r['link_share']:.0f}%)" for r in runs[link]) for link in LINKS]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    lines += ["", "Speed-up over synchronous at each link: measured (the ratio of tokens/s to the synchronous run "
                  "just before, median of the 2 pairs), and at equal compute (every form does the same work per "
                  "step; the load drifts between runs: each run's step split into link seconds, sync_s, and the "
                  "rest, the rest replaced by the median over the forms at that link and pair: (c + link_sync) / "
                  "(c + link_form)).", "",
              "| form | " + " | ".join(f"measured @{g} | equal compute @{g}" for g in LINKS[1:]) + " |",
              "|---|" + "---|" * (2 * len(LINKS) - 2)]
    for name in FORMS:
        cells = []
        for link in LINKS[1:]:
            measured = _median2([fast[(name, link, rep)]["tok_s"] / fast[("synchronous", link, rep)]["tok_s"]
                                 for rep in range(2)])
            equal = _median2([_equal_compute(fast, name, link, rep) for rep in range(2)])
            cells += [f"{measured:.1f}x", f"{equal:.1f}x"]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _split(r: dict) -> tuple[float, float]:
    """(compute, link) seconds per step of a speed run."""
    step = TOKENS_PER_STEP / r["tok_s"]
    return step * (1 - r["link_share"]), step * r["link_share"]


def _equal_compute(fast: dict, name: str, link: str, rep: int) -> float:
    c = statistics.median(_split(fast[(form, link, rep)])[0] for form in FORMS)
    return (c + _split(fast[("synchronous", link, rep)])[1]) / (c + _split(fast[(name, link, rep)])[1])


if __name__ == "__main__":
    main()
