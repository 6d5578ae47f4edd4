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
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from convert import ROOT, add_model_arguments, fresh_dir, fsync_tree, write_hf_checkpoint  # noqa: E402
from mdsection import write_section  # noqa: E402


# The converter's own peak: its VmHWM at exit. (os.wait4's ru_maxrss would not do: Linux counts in it the RSS the
# child had when it forked from this process, which holds a whole rank of the legacy checkpoint while writing it.)
_MEASURED = """import atexit, sys
def _peak():
    kib = open("/proc/self/status").read().split("VmHWM:")[1].split()[0]
    print(f"tpzoo-bench-peak-kib {kib}", file=sys.stderr)
atexit.register(_peak)
if sys.argv[1:]:
    from tpzoo.cli import main
    sys.exit(main(sys.argv[1:]))
import torch, torch.distributed.checkpoint, tpzoo.checkpoint, tpzoo.checkpoint.megatron, tpzoo.commands.convert
"""


def timed_command(argv: list[str], out: Path) -> tuple[float, float, int]:
    """(seconds until `tpzoo ARGV` exits, seconds until its output is on disk, its peak RSS in bytes); no ARGV:
    only the imports."""
    start = time.perf_counter()
    proc = subprocess.run([sys.executable, "-c", _MEASURED, *argv], cwd=ROOT, stdout=subprocess.DEVNULL,
                          stderr=subprocess.PIPE, text=True)
    returned = time.perf_counter() - start
    if proc.returncode != 0:
        raise SystemExit(f"tpzoo {' '.join(argv)} failed ({proc.returncode}): {proc.stderr[-2000:]}")
    if argv:
        fsync_tree(out)
    peak = int(proc.stderr.rsplit("tpzoo-bench-peak-kib ", 1)[1].split()[0]) * 1024
    return returned, time.perf_counter() - start, peak


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_arguments(p, dir="/tmp/tpzoo-bench-megatron", dtype="bf16", hidden=1536, layers=16, heads=12, kv_heads=4,
                        ffn=4096)
    p.add_argument("--tp", type=int, default=2)
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--write", metavar="MD", help="write the result table into this markdown file's section")
    args = p.parse_args()

    work = fresh_dir(args.dir)
    tpzoo = ["convert"]
    try:
        size = write_hf_checkpoint(work / "hf", args)
        os.sync()
        to_mg = timed_command(tpzoo + ["to-megatron", str(work / "hf"), str(work / "mg"), "--tp", str(args.tp),
                                       "--quiet"], work / "mg")
        mg_bytes = sum(f.stat().st_size for f in (work / "mg").rglob("*") if f.is_file())
        legacy_bytes = write_legacy(work / "mg", work / "legacy", args.tp)
        os.sync()
        sources = {"from-megatron": work / "mg", "from-megatron (legacy)": work / "legacy", "from-hf": work / "hf"}
        runs = {k: [] for k in sources}
        for _ in range(args.repeat):
            for kind, src in sources.items():
                runs[kind].append(timed_command(tpzoo + [kind.split()[0], str(src), str(work / "out"), "--tp",
                                                         str(args.tp), "--quiet", "--force"], work / "out"))
                os.sync()
        base = timed_command([], work)[2]  # what the process holds before converting: the imports
        load = os.getloadavg()
        med = statistics.median
        result = {"hf_bytes": size, "megatron_bytes": mg_bytes, "legacy_bytes": legacy_bytes, "dtype": args.dtype,
                  "tp": args.tp,
                  "to_megatron_seconds": round(to_mg[0], 2), "to_megatron_peak_rss_MiB": round(to_mg[2] / 2**20, 1),
                  "baseline_rss_MiB": round(base / 2**20, 1), "load_average": [round(x, 1) for x in load]}
        for kind, rs in runs.items():
            result[kind] = {"seconds": [round(r[0], 2) for r in rs], "durable_seconds": [round(r[1], 2) for r in rs],
                            "median_seconds": round(med(r[0] for r in rs), 2),
                            "peak_rss_MiB": round(max(r[2] for r in rs) / 2**20, 1),
                            "above_baseline_MiB": round((max(r[2] for r in rs) - base) / 2**20, 1)}
        result["time_ratio"] = round(result["from-megatron"]["median_seconds"] / result["from-hf"]["median_seconds"], 3)
        result["rss_ratio"] = round(result["from-megatron"]["peak_rss_MiB"] / result["from-hf"]["peak_rss_MiB"], 3)
        print(json.dumps(result))
        if args.write:
            write_section(args.write, "megatron_convert", _table(result, args))
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)


def write_legacy(dist_dir: Path, out: Path, tp: int) -> int:
    """The torch_dist checkpoint rewritten in Megatron-LM's legacy per-rank form (mp_rank_TT/model_optim_rng.pt:
    each rank's local shards under local names, as legacy_format.py reads them), one rank in memory at a time."""
    import torch

    from tpzoo.checkpoint.megatron.legacy_format import COLUMN, ROW
    from tpzoo.checkpoint.megatron.source import open_store

    store, iteration = open_store(dist_dir, {})
    args, gated = store.state["args"], bool(store.args.get("swiglu"))
    (out / "iter_0000001").mkdir(parents=True)
    (out / "latest_checkpointed_iteration.txt").write_text("1")
    for r in range(tp):
        model = {}
        for key, t in store.tensors.items():
            layered = key.startswith("decoder.layers.")
            short = key[len("decoder.layers."):] if layered else key
            for j in range(t.shape[0] if layered else 1):
                full = store.read_box(key, [(j, 1)] + [(0, n) for n in t.shape[1:]] if layered
                                      else [(0, n) for n in t.shape])
                full = full[0] if layered else full
                if short in COLUMN and gated and "linear_fc1" in short:
                    gate, up = full.chunk(2)
                    local = torch.cat([gate.chunk(tp)[r], up.chunk(tp)[r]])
                elif short in COLUMN or short in ROW:
                    local = full.chunk(tp, dim=0 if short in COLUMN else 1)[r]
                else:
                    local = full
                model[f"decoder.layers.{j}.{short}" if layered else key] = local.clone()
        (out / "iter_0000001" / f"mp_rank_{r:02d}").mkdir()
        torch.save({"args": args, "checkpoint_version": 3.0, "iteration": 1, "model": model},
                   out / "iter_0000001" / f"mp_rank_{r:02d}" / "model_optim_rng.pt")
        del model
    store.close()
    return sum(f.stat().st_size for f in out.rglob("*.pt"))


def runs_of(r: dict) -> list[str]:
    return [k for k in r if k.startswith("from-")]


def _table(r: dict, args) -> str:
    names = {"from-megatron": "`convert from-megatron` (torch_dist)", "from-megatron (legacy)":
             "`convert from-megatron` (legacy: mp_rank_*/model_optim_rng.pt)", "from-hf": "`convert from-hf`"}
    rows = "\n".join(f"| {names[k]} | {', '.join(map(str, r[k]['seconds']))} | {r[k]['median_seconds']} | "
                     f"{r[k]['peak_rss_MiB']} MiB |" for k in runs_of(r))
    return f"""## Megatron-LM conversion: `convert from-megatron` vs `convert from-hf` of the same model

Command: `python scripts/bench/megatron_convert.py --repeat {args.repeat} --write docs/benchmarks.md`. A Llama-like
model (hidden {args.hidden}, {args.layers} layers, {args.heads} heads / {args.kv_heads} kv, ffn {args.ffn}, vocabulary
{args.vocab}, random {args.dtype} weights) written as a {r['hf_bytes'] / 1e9:.2f} GB Hugging Face checkpoint; `convert
to-megatron --tp {args.tp}` of it gives the same model as a {r['megatron_bytes'] / 1e9:.2f} GB torch_dist checkpoint
({r['to_megatron_seconds']} s, peak RSS {r['to_megatron_peak_rss_MiB']} MiB), rewritten by the script in the legacy
per-rank form ({r['legacy_bytes'] / 1e9:.2f} GB). Then each conversion to a tpzoo checkpoint at tp {args.tp} in a
subprocess, process start included, alternating, {args.repeat} runs each; peak RSS is the converter's own (VmHWM at
exit). Machine: 2 CPU cores, shared with other jobs (load average {', '.join(map(str, r['load_average']))} at the
end: the seconds vary by 2-3x from run to run, compare medians).

| conversion | seconds | median s | peak RSS |
|---|---|---|---|
{rows}

from-megatron (torch_dist) / from-hf: time {r['time_ratio']}x, peak memory {r['rss_ratio']}x. Python, torch and
both converters' imports alone take {r['baseline_rss_MiB']} MiB (torch.distributed.checkpoint, which the torch_dist
reader uses, is the difference): every conversion streams, a few 16 MiB pieces above its imports whatever the
checkpoint's size. from-megatron reads the .distcp files as from-hf reads safetensors: each chunk's torch.save
archive is located once (its zip directory and data.pkl), then the byte ranges a shard takes unchanged are copied by
the kernel (`copy_file_range`: runs of rows; linear_qkv's come per query group, a row-parallel weight's one per
row), the rest read with positioned reads of exactly its bytes. The legacy files likewise, after their
torch.load(weights_only=True) check: reading their tensors through torch.load's memory map instead (the first
version) kept every page read resident: 1279 MiB peak and 30.4 s for the same checkpoint (one run, load average
about 50)."""
