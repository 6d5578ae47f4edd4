"""Benchmark: `tpzoo convert from-hf --tp 2 --pp 2` on a multi-GB checkpoint, against a plain file copy.

    python scripts/bench/convert.py                       # TinyLlama-1.1B shapes, fp32: a 4.4 GB checkpoint
    python scripts/bench/convert.py --dtype bf16 --layers 22 --dir /scratch/bench --keep
    python scripts/bench/convert.py --out-dtype bf16      # every tensor read into memory and cast

1. Writes a Hugging Face checkpoint of a llama-like config with random weights (sharded safetensors + index),
   streamed piece by piece, so generating it is memory-bounded too.
2. Times shutil.copyfile of those files (the bytes a converter must at least read and write), then
   `python -m tpzoo convert from-hf SRC DST --tp 2 --pp 2` in a subprocess (process start included),
   alternating, `--repeat` times each; each time both until it returns and until its files are on disk (fsync):
   past a couple of GB of dirty pages the kernel throttles every writer to the disk's speed, so the returned
   time of either depends on how much of it the page cache absorbed. Medians are compared. The subprocess's peak
   RSS comes from os.wait4. Then `convert to-hf` of the result, for reference.
3. Prints one JSON line with the numbers and the goal checks (>= half the copy speed, RSS < 15% of the size);
   deletes everything it wrote unless --keep.
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

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from tpzoo.checkpoint.st_writer import SafetensorsWriter  # noqa: E402

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def llama_tensors(h: int, layers: int, heads: int, kv: int, ffn: int, vocab: int) -> list[tuple[str, tuple]]:
    hd = h // heads
    out = [("model.embed_tokens.weight", (vocab, h))]
    for i in range(layers):
        p = f"model.layers.{i}."
        out += [(p + "input_layernorm.weight", (h,)), (p + "self_attn.q_proj.weight", (heads * hd, h)),
                (p + "self_attn.k_proj.weight", (kv * hd, h)), (p + "self_attn.v_proj.weight", (kv * hd, h)),
                (p + "self_attn.o_proj.weight", (h, heads * hd)), (p + "post_attention_layernorm.weight", (h,)),
                (p + "mlp.gate_proj.weight", (ffn, h)), (p + "mlp.up_proj.weight", (ffn, h)),
                (p + "mlp.down_proj.weight", (h, ffn))]
    return out + [("model.norm.weight", (h,)), ("lm_head.weight", (vocab, h))]


def write_from_pool(writer, name: str, numel: int, pool: torch.Tensor, k: int) -> int:
    """Stream `numel` values of tensor `name` from slices of `pool` at varying offsets (random-looking weights at
    disk speed); returns the next offset seed."""
    while numel:
        take = min(numel, pool.numel() // 2)
        k = (k + 7919) % (pool.numel() // 2)
        writer.write(name, pool[k: k + take])
        numel -= take
    return k


def write_hf_checkpoint(path: Path, args) -> int:
    """Random weights streamed into model-0000k-of-0000n.safetensors files of about --shard-gb each."""
    dtype = DTYPES[args.dtype]
    esize = torch.empty((), dtype=dtype).element_size()
    tensors = llama_tensors(args.hidden, args.layers, args.heads, args.kv_heads, args.ffn, args.vocab)
    limit = int(args.shard_gb * 1e9)
    groups, size = [[]], 0
    for name, shape in tensors:
        n = esize * torch.Size(shape).numel()
        if groups[-1] and size + n > limit:
            groups.append([])
            size = 0
        groups[-1].append((name, shape))
        size += n
    # A pool of random values, sliced at varying offsets: random-looking weights at disk speed.
    pool = (torch.randn(16 << 20, generator=torch.Generator().manual_seed(0)) * 0.02).to(dtype)
    path.mkdir(parents=True)
    weight_map, total, k = {}, 0, 0
    for i, group in enumerate(groups):
        fname = f"model-{i + 1:05d}-of-{len(groups):05d}.safetensors"
        w = SafetensorsWriter(path / fname, [(n, dtype, s) for n, s in group], {"format": "pt"})
        for name, shape in group:
            k = write_from_pool(w, name, torch.Size(shape).numel(), pool, k)
            weight_map[name] = fname
        total += w.close()[0]
    index = {"metadata": {"total_size": sum(esize * torch.Size(s).numel() for _, s in tensors)},
             "weight_map": weight_map}
    (path / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": args.hidden,
              "num_hidden_layers": args.layers, "num_attention_heads": args.heads,
              "num_key_value_heads": args.kv_heads, "intermediate_size": args.ffn, "vocab_size": args.vocab,
              "max_position_embeddings": 2048, "rms_norm_eps": 1e-5, "hidden_act": "silu",
              "tie_word_embeddings": False, "rope_theta": 10000.0, "bos_token_id": 1, "eos_token_id": 2,
              "dtype": str(dtype).replace("torch.", "")}
    (path / "config.json").write_text(json.dumps(config, indent=2))
    return total


def add_model_arguments(p: argparse.ArgumentParser, **defaults) -> None:
    """The scratch directory and the random llama-like checkpoint's shape (write_hf_checkpoint's arguments)."""
    p.add_argument("--dir", default=defaults["dir"], help="scratch directory (deleted afterwards)")
    p.add_argument("--dtype", default=defaults["dtype"], choices=sorted(DTYPES))
    for name in ("hidden", "layers", "heads", "kv_heads", "ffn"):
        p.add_argument(f"--{name.replace('_', '-')}", type=int, default=defaults[name])
    p.add_argument("--vocab", type=int, default=defaults.get("vocab", 32000))
    p.add_argument("--shard-gb", type=float, default=2.0, help="HF input shard size (GB)")
    p.add_argument("--keep", action="store_true", help="keep the scratch directory")


def fresh_dir(path) -> Path:
    work = Path(path)
    if work.exists():
        shutil.rmtree(work)
    work.mkdir(parents=True)
    return work


def fsync_tree(path: Path) -> None:
    for f in sorted(path.rglob("*")):
        if f.is_file():
            fd = os.open(f, os.O_RDONLY)
            os.fsync(fd)
            os.close(fd)


def timed_copy(src: Path, dst: Path) -> tuple[float, float]:
    """(seconds until the copy returns, seconds until its files are on disk)."""
    dst.mkdir()
    start = time.perf_counter()
    for f in sorted(src.iterdir()):
        shutil.copyfile(f, dst / f.name)
    returned = time.perf_counter() - start
    fsync_tree(dst)
    return returned, time.perf_counter() - start


def timed_command(cmd: list[str], out: Path) -> tuple[float, float, int]:
    """(seconds until the subprocess exits, seconds until its output is on disk, its peak RSS in bytes)."""
    start = time.perf_counter()
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL)
    _, status, usage = os.wait4(proc.pid, 0)
    returned = time.perf_counter() - start
    if status != 0:
        raise SystemExit(f"{' '.join(cmd)} failed with status {status}")
    fsync_tree(out)
    return returned, time.perf_counter() - start, usage.ru_maxrss * 1024  # Linux reports KiB


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_arguments(p, dir="/tmp/tpzoo-bench-convert", dtype="fp32", hidden=2048, layers=22, heads=32, kv_heads=4,
                        ffn=5632)
    p.add_argument("--tp", type=int, default=2)
    p.add_argument("--pp", type=int, default=2)
    p.add_argument("--out-dtype", default="auto", choices=["auto", "fp32", "bf16", "fp16"],
                   help="convert's --dtype: a change of dtype reads every tensor into memory (no kernel copy)")
    p.add_argument("--repeat", type=int, default=3, help="copy/convert runs each (alternating; medians compared)")
    args = p.parse_args()

    work = fresh_dir(args.dir)
    try:
        start = time.perf_counter()
        size = write_hf_checkpoint(work / "hf", args)
        gen_seconds = time.perf_counter() - start
        os.sync()  # the generator's dirty pages must not slow down what is measured next
        copies, converts = [], []
        convert = [sys.executable, "-m", "tpzoo", "convert", "from-hf", str(work / "hf"), str(work / "tpzoo"),
                   "--tp", str(args.tp), "--pp", str(args.pp), "--dtype", args.out_dtype, "--quiet", "--force"]
        for _ in range(args.repeat):  # alternating, each starting with no dirty pages of ours in the page cache
            copies.append(timed_copy(work / "hf", work / "copy"))
            shutil.rmtree(work / "copy")
            os.sync()
            converts.append(timed_command(convert, work / "tpzoo"))
            os.sync()
        to_hf = timed_command([sys.executable, "-m", "tpzoo", "convert", "to-hf", str(work / "tpzoo"),
                               str(work / "back"), "--quiet"], work / "back")
        med = statistics.median
        copy_ret, copy_dur = med(c[0] for c in copies), med(c[1] for c in copies)
        conv_ret, conv_dur = med(c[0] for c in converts), med(c[1] for c in converts)
        peak = max(c[2] for c in converts)
        result = {
            "checkpoint_bytes": size, "dtype": args.dtype, "out_dtype": args.out_dtype, "tp": args.tp,
            "pp": args.pp,
            "generate_seconds": round(gen_seconds, 2),
            "copy_seconds": [round(c[0], 2) for c in copies], "copy_durable_seconds": [round(c[1], 2) for c in copies],
            "convert_seconds": [round(c[0], 2) for c in converts],
            "convert_durable_seconds": [round(c[1], 2) for c in converts],
            "median_copy_GBps": round(size / copy_ret / 1e9, 3), "median_convert_GBps": round(size / conv_ret / 1e9, 3),
            "speed_vs_copy": round(copy_ret / conv_ret, 3), "durable_speed_vs_copy": round(copy_dur / conv_dur, 3),
            "convert_peak_rss_MiB": round(peak / 2**20, 1), "convert_peak_rss_fraction": round(peak / size, 4),
            "to_hf_seconds": round(to_hf[0], 2), "to_hf_peak_rss_MiB": round(to_hf[2] / 2**20, 1),
        }
        result["goal_speed_ok"] = max(result["speed_vs_copy"], result["durable_speed_vs_copy"]) >= 0.5
        result["goal_memory_ok"] = result["convert_peak_rss_fraction"] < 0.15
        print(json.dumps(result))
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
