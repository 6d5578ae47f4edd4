"""Benchmark: `tpzoo convert from-megatron` of a ~1 GB Megatron-LM torch_dist checkpoint vs `convert from-hf` of the
same model (both to tp 2), time and peak memory; `convert to-megatron` for reference.

    python scripts/bench/megatron_convert.py                  # 500M parameters, bf16: a 1.0 GB checkpoint
    python scripts/bench/megatron_convert.py --repeat 3 --write docs/benchmarks.md

1. Writes a Hugging Face checkpoint of a Llama-like config with random weights, streamed (scripts/bench/convert.py).
2. `python -m tpzoo convert to-megatron HF MEGATRON --tp 2` writes the same model as Megatron-LM's torch_dist
   checkpoint at tp 2: the chunks Megatron's two ranks save (grouped linear_qkv rows, [all gates | all ups],
   padded vocabulary), the format tests/test_megatron_convert.py proves Megatron-Core loads.
3. Alternating, --repeat times each: `convert from-megatron MEGATRON DST --tp 2` and `convert from-hf HF DST --tp 2`
   in subprocesses (process start included), each until it returns and until its files are on disk (fsync);
   peak RSS from os.wait4. Medians compared. Prints one JSON line; --write puts the table in a markdown file.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from convert import add_model_arguments, fresh_dir, timed_command, write_hf_checkpoint  # noqa: E402
from mdsection import write_section  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_arguments(p, dir="/tmp/tpzoo-bench-megatron", dtype="bf16", hidden=1536, layers=16, heads=12, kv_heads=4,
                        ffn=4096)
    p.add_argument("--tp", type=int, default=2)
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--write", metavar="MD", help="write the result table into this markdown file's section")
    args = p.parse_args()

    work = fresh_dir(args.dir)
    tpzoo = [sys.executable, "-m", "tpzoo", "convert"]
    try:
        size = write_hf_checkpoint(work / "hf", args)
        os.sync()
        to_mg = timed_command(tpzoo + ["to-megatron", str(work / "hf"), str(work / "mg"), "--tp", str(args.tp),
                                       "--quiet"], work / "mg")
        mg_bytes = sum(f.stat().st_size for f in (work / "mg").rglob("*") if f.is_file())
        os.sync()
        runs = {"from-megatron": [], "from-hf": []}
        for _ in range(args.repeat):
            for kind, src in (("from-megatron", work / "mg"), ("from-hf", work / "hf")):
                runs[kind].append(timed_command(tpzoo + [kind, str(src), str(work / "out"), "--tp", str(args.tp),
                                                         "--quiet", "--force"], work / "out"))
                os.sync()
        load = os.getloadavg()
        med = statistics.median
        result = {"hf_bytes": size, "megatron_bytes": mg_bytes, "dtype": args.dtype, "tp": args.tp,
                  "to_megatron_seconds": round(to_mg[0], 2), "to_megatron_peak_rss_MiB": round(to_mg[2] / 2**20, 1),
                  "load_average": [round(x, 1) for x in load]}
        for kind, rs in runs.items():
            result[kind] = {"seconds": [round(r[0], 2) for r in rs], "durable_seconds": [round(r[1], 2) for r in rs],
                            "median_seconds": round(med(r[0] for r in rs), 2),
                            "peak_rss_MiB": round(max(r[2] for r in rs) / 2**20, 1)}
        result["time_ratio"] = round(result["from-megatron"]["median_seconds"] / result["from-hf"]["median_seconds"], 3)
        result["rss_ratio"] = round(result["from-megatron"]["peak_rss_MiB"] / result["from-hf"]["peak_rss_MiB"], 3)
        print(json.dumps(result))
        if args.write:
            write_section(args.write, "megatron_convert", _table(result, args))
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)


def _table(r: dict, args) -> str:
    rows = "\n".join(f"| `convert {k}` | {', '.join(map(str, r[k]['seconds']))} | {r[k]['median_seconds']} | "
                     f"{r[k]['peak_rss_MiB']} MiB | {100 * r[k]['peak_rss_MiB'] * 2**20 / r['hf_bytes']:.1f} % |"
                     for k in ("from-megatron", "from-hf"))
    return f"""## Megatron-LM conversion: `convert from-megatron` vs `convert from-hf` of the same model

Command: `python scripts/bench/megatron_convert.py --repeat {args.repeat} --write docs/benchmarks.md` (a Llama-like
model, hidden {args.hidden}, {args.layers} layers, {args.heads} heads / {args.kv_heads} kv, ffn {args.ffn}, vocabulary
{args.vocab}, random {args.dtype} weights: a {r['hf_bytes'] / 1e9:.2f} GB Hugging Face checkpoint; `convert to-megatron
--tp {args.tp}` of it gives the {r['megatron_bytes'] / 1e9:.2f} GB torch_dist checkpoint, in {r['to_megatron_seconds']} s
with a peak RSS of {r['to_megatron_peak_rss_MiB']} MiB; then each conversion to a tpzoo checkpoint at tp {args.tp} in a
subprocess, process start included, alternating; peak RSS from `os.wait4`). Machine: 2 CPU cores, shared with
other jobs (load average {', '.join(map(str, r['load_average']))} at the end).

| conversion | seconds ({args.repeat} runs) | median s | peak RSS | RSS / checkpoint |
|---|---|---|---|---|
{rows}

from-megatron / from-hf: time {r['time_ratio']}x, peak memory {r['rss_ratio']}x."""


if __name__ == "__main__":
    main()
