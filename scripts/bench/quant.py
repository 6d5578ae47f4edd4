"""Benchmark: block-FP8 checkpoints in tpzoo, against the same model in bf16.

    python scripts/bench/quant.py                        # both parts, prints one JSON line each
    python scripts/bench/quant.py --part convert --layers 44 --write docs/benchmarks.md
    python scripts/bench/quant.py --part lora --steps 10

convert: a Hugging Face checkpoint of TinyLlama's layer shapes (hidden 2048, 32 heads / 4 kv heads of 64, ffn 5632:
every projection a whole number of 128 x 128 blocks) with --layers layers, written twice with random weights,
streamed: block FP8 (the projections e4m3 + float32 scale_inv, embeddings / head / norms bf16; about 2 GB at 44
layers) and bf16. Each conversion runs as `python -m tpzoo convert from-hf SRC DST --tp 2` in a subprocess (process
start included; peak RSS from os.wait4; `--repeat` runs each, alternating, medians): the FP8 checkpoint dequantized
(to its bf16), the FP8 checkpoint kept (--keep-quantized), the bf16 checkpoint.

lora: bench-llama (scripts/bench/train.py's CPU size: hidden 384, 6 layers, 6 heads / 2 kv heads, ffn 1024, vocab
8192) with random weights, imported in bf16 and, quantized to block FP8, kept; a LoRA step (rank 16 on every linear
layer, bf16, batch 4 x 256, forward + backward + clipping + AdamW over the adapters, the base frozen) on each in a
fresh process, `--repeat` times interleaved, the fastest median reported. Weight memory: the bytes of the frozen
base's tensors (values and scales) as the model holds them, and the peak resident set over the one before the build.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from convert import add_model_arguments, fresh_dir, llama_tensors, write_from_pool  # noqa: E402 (sibling scripts)
from megatron_convert import timed_command  # noqa: E402

from tpzoo.checkpoint.st_writer import SafetensorsWriter  # noqa: E402
from tpzoo.quant.formats import Fp8Block  # noqa: E402


def _quantized(name: str) -> bool:
    return name.endswith("proj.weight")


def write_checkpoint(path: Path, args, fp8: bool) -> int:
    """Random weights streamed into model-0000k-of-0000n safetensors files of about 1 GB (FP8: each projection's
    values and scales, its scales in the next file); returns the bytes written."""
    tensors = llama_tensors(args.hidden, args.layers, args.heads, args.kv_heads, args.ffn, args.vocab)
    entries = []
    for name, shape in tensors:
        if fp8 and _quantized(name):
            entries += [(name, torch.float8_e4m3fn, shape),
                        (name + "_scale_inv", torch.float32, Fp8Block().scale_shape(shape))]
        else:
            entries.append((name, torch.bfloat16, shape))
    groups, size = [[]], 0
    for e in entries:
        n = e[1].itemsize * torch.Size(e[2]).numel()
        if groups[-1] and size + n > 1e9:
            groups.append([])
            size = 0
        groups[-1].append(e)
        size += n
    pool = (torch.randn(16 << 20, generator=torch.Generator().manual_seed(0)) * 0.02).to(torch.bfloat16)
    pool8 = (pool.float() * 2000).clamp(-448, 448).to(torch.float8_e4m3fn)
    path.mkdir(parents=True)
    weight_map, total, k = {}, 0, 0
    for i, group in enumerate(groups):
        fname = f"model-{i + 1:05d}-of-{len(groups):05d}.safetensors"
        w = SafetensorsWriter(path / fname, group, {"format": "pt"})
        for name, dtype, shape in group:
            if dtype == torch.float32:  # scales
                w.write(name, torch.full(shape, 0.02 / 448, dtype=dtype))
            else:
                k = write_from_pool(w, name, torch.Size(shape).numel(), pool8 if dtype.itemsize == 1 else pool, k)
            weight_map[name] = fname
        total += w.close()[0]
    (path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {"total_size": total},
                                                                  "weight_map": weight_map}))
    config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": args.hidden,
              "num_hidden_layers": args.layers, "num_attention_heads": args.heads,
              "num_key_value_heads": args.kv_heads, "intermediate_size": args.ffn, "vocab_size": args.vocab,
              "max_position_embeddings": 2048, "rms_norm_eps": 1e-5, "hidden_act": "silu",
              "tie_word_embeddings": False, "rope_theta": 10000.0, "dtype": "bfloat16"}
    if fp8:
        config["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                         "weight_block_size": [128, 128]}
    (path / "config.json").write_text(json.dumps(config))
    return total


def part_convert(args, work: Path) -> dict:
    sizes = {"fp8": write_checkpoint(work / "fp8", args, True), "bf16": write_checkpoint(work / "bf16", args, False)}
    os.sync()
    cases = {"fp8 dequantized": (work / "fp8", []), "fp8 kept": (work / "fp8", ["--keep-quantized"]),
             "bf16": (work / "bf16", [])}
    runs = {c: [] for c in cases}
    for _ in range(args.repeat):
        for case, (src, extra) in cases.items():
            out = work / "out"
            cmd = ["convert", "from-hf", str(src), str(out), "--tp", "2", "--quiet", "--force", *extra]
            seconds, durable, rss = timed_command(cmd, out)  # (the converter's own peak RSS)
            out_bytes = sum(f.stat().st_size for f in out.iterdir() if f.suffix == ".safetensors")
            runs[case].append((seconds, durable, rss, out_bytes))
            shutil.rmtree(out)
            os.sync()
    result = {"part": "convert", "layers": args.layers, "source_bytes": sizes, "cases": {}}
    for case, r in runs.items():
        result["cases"][case] = {"seconds": [round(x[0], 2) for x in r],
                                 "median_s": round(statistics.median(x[0] for x in r), 2),
                                 "durable_median_s": round(statistics.median(x[1] for x in r), 2),
                                 "peak_rss_MiB": round(max(x[2] for x in r) / 2**20, 1), "output_bytes": r[0][3]}
    kept, bf16 = result["cases"]["fp8 kept"], result["cases"]["bf16"]
    result["kept_bytes_vs_bf16"] = round(kept["output_bytes"] / bf16["output_bytes"], 3)
    return result


# -- LoRA steps ---------------------------------------------------------------------------------------------------

def lora_case(args) -> None:
    """One LoRA run on --ckpt in this process; prints RESULT {json}."""
    import tpzoo
    from tpzoo.checkpoint import load_weights_into
    from tpzoo.checkpoint.lora_io import is_base_param
    from tpzoo.checkpoint.sources import CheckpointSource
    from tpzoo.models.lora import LoRAConfig, add_lora, init_lora
    from tpzoo.pipeline import build_model_chunks, materialize_chunks
    from tpzoo.train.optim import DistributedAdamW
    from train import timed_steps  # (a sibling script: the step scripts/bench/train.py times)

    torch.set_num_threads(args.threads)
    base_rss = _rss("VmRSS")
    dims = tpzoo.init_parallel(device=args.device)
    source = CheckpointSource(args.ckpt)
    cfg = source.cfg
    source.close()
    chunks = build_model_chunks(cfg, dims, device="meta", dtype=torch.bfloat16)
    add_lora(chunks, LoRAConfig(args.lora_rank, 2.0 * args.lora_rank))
    materialize_chunks(chunks, dims.device, init=False)
    load_weights_into(chunks, args.ckpt, select=is_base_param)
    init_lora(chunks, 0)
    frozen = sum(p.numel() * p.element_size() for c in chunks for p in c.parameters() if not p.requires_grad)
    from tpzoo.quant.modules import quantizable_tensors

    names = {n + suffix for c in chunks for n in quantizable_tensors(c) for suffix in ("", "_scale_inv")}
    projections = sum(p.numel() * p.element_size() for c in chunks for n, p in c.named_parameters() if n in names)
    opt = DistributedAdamW([p for c in chunks for p in c.parameters() if p.requires_grad], dims,
                           model_dtype=torch.bfloat16)
    g = torch.Generator().manual_seed(0)
    batches = [torch.randint(0, cfg.vocab_size, (args.batch, args.seq_len + 1), generator=g)
               for _ in range(args.warmup + args.steps)]
    times = [wall for wall, _ in timed_steps(chunks, opt, dims, batches)]
    peak = (torch.cuda.max_memory_allocated() if dims.device.type == "cuda" else (_rss("VmHWM") - base_rss))
    print("RESULT " + json.dumps({"step_s_median": statistics.median(times[args.warmup:]),
                                  "weight_bytes": frozen, "projection_bytes": projections, "peak_bytes": peak}),
          flush=True)


def _rss(key: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    return 0


def part_lora(args, work: Path) -> dict:
    from transformers import AutoConfig, AutoModelForCausalLM

    from tpzoo.checkpoint import convert_from_hf
    from tpzoo.models import ModelConfig, to_hf_config

    cfg = ModelConfig.from_dict(dict(family="llama", vocab_size=8192, hidden_size=384, num_layers=6, num_heads=6,
                                     num_kv_heads=2, ffn_hidden_size=1024, max_position_embeddings=1024))
    torch.manual_seed(0)
    hf = AutoModelForCausalLM.from_config(AutoConfig.for_model(**to_hf_config(cfg))).to(torch.bfloat16)
    hf.save_pretrained(work / "hf")
    from safetensors.torch import load_file, save_file

    state, fmt = load_file(str(work / "hf" / "model.safetensors")), Fp8Block()
    out = {}
    for name, t in state.items():
        if _quantized(name):
            out[name], out[name + "_scale_inv"] = fmt.quantize(t)
        else:
            out[name] = t
    shutil.copytree(work / "hf", work / "hf-fp8")
    save_file(out, str(work / "hf-fp8" / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((work / "hf-fp8" / "config.json").read_text())
    config["quantization_config"] = fmt.hf_config()
    (work / "hf-fp8" / "config.json").write_text(json.dumps(config))
    convert_from_hf(work / "hf", work / "bf16", dtype="bf16", progress=False)
    convert_from_hf(work / "hf-fp8", work / "kept", keep_quantized=True, progress=False)
    runs = {"bf16 base": [], "fp8 kept base": []}
    for _ in range(args.repeat):
        for case, ckpt in (("bf16 base", work / "bf16"), ("fp8 kept base", work / "kept")):
            cmd = [sys.executable, __file__, "--lora-case", "--ckpt", str(ckpt), "--steps", str(args.steps),
                   "--warmup", str(args.warmup), "--threads", str(args.threads), "--device", args.device]
            text = subprocess.run(cmd, check=True, capture_output=True, text=True, cwd=ROOT).stdout
            runs[case].append(json.loads(text.split("RESULT ", 1)[1]))
    best = {case: min(r, key=lambda x: x["step_s_median"]) for case, r in runs.items()}
    b, k = best["bf16 base"], best["fp8 kept base"]
    return {"part": "lora", "device": args.device, "threads": args.threads, "cases": best,
            "all_step_s": {c: [round(x["step_s_median"], 4) for x in r] for c, r in runs.items()},
            "weight_bytes_ratio": round(k["weight_bytes"] / b["weight_bytes"], 3),
            "projection_bytes_ratio": round(k["projection_bytes"] / b["projection_bytes"], 3),
            "peak_ratio": round(k["peak_bytes"] / b["peak_bytes"], 3),
            "step_time_ratio": round(k["step_s_median"] / b["step_s_median"], 3)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--part", choices=["convert", "lora", "both"], default="both")
    add_model_arguments(p, dir="/tmp/tpzoo-bench-quant", dtype="bf16", hidden=2048, layers=44, heads=32, kv_heads=4,
                        ffn=5632)
    p.add_argument("--repeat", type=int, default=2)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--device", default="cpu")
    p.add_argument("--lora-rank", type=int, default=16)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--lora-case", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--ckpt", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.lora_case:
        return lora_case(args)
    work = fresh_dir(args.dir)
    try:
        for part in (("convert", "lora") if args.part == "both" else (args.part,)):
            (work / part).mkdir()
            print(json.dumps((part_convert if part == "convert" else part_lora)(args, work / part)), flush=True)
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
