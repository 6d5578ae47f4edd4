"""One Gated DeltaNet layer: tpzoo's (models/gated_deltanet.py, the chunked torch gated delta rule) against
transformers' Qwen3_5GatedDeltaNet (its torch fallback: torch_chunk_gated_delta_rule) on the same weights and
inputs, forward + backward and forward alone, side by side.

    python scripts/bench/gated_deltanet.py                               # CPU, fp32: a cut Qwen3.5 layer
    python scripts/bench/gated_deltanet.py --write docs/benchmarks.md    # and (re)write its section there
    python scripts/bench/gated_deltanet.py --device cuda --dtype bf16    # GPU: adds tpzoo with fla when installed

One process, tp = 1. The layer: hidden 1024, 4 key heads / 8 value heads of 128 (Qwen3.5's head dims and a 1:2
grouping at a quarter of Qwen3.5-2B's width), conv kernel 4; a micro-batch of 1 x 2048 tokens. Variants alternate
within each repetition (median of --reps after a warm-up; CPU: the process's CPU time, one thread). Peak (CPU): the
most bytes the step's tensors hold at once (tpzoo.plan.measure.peak_live_bytes). The outputs of the variants are
compared (max difference) so a fast wrong variant shows.
"""
from __future__ import annotations

import argparse
import os
import pathlib
import statistics
import sys
import time

import torch

from mdsection import write_section  # noqa: E402 (a sibling script module)

ROOT = pathlib.Path(__file__).resolve().parents[2]
SHAPE = dict(hidden_size=1024, linear_num_key_heads=4, linear_num_value_heads=8, linear_key_head_dim=128,
             linear_value_head_dim=128, linear_conv_kernel_dim=4, num_hidden_layers=4, num_attention_heads=8,
             num_key_value_heads=2, head_dim=128)


def build(dtype, device):
    import inspect

    from transformers.models.qwen3_5 import modeling_qwen3_5 as m35
    from transformers.models.qwen3_5.configuration_qwen3_5 import Qwen3_5TextConfig

    from tpzoo.models.gated_deltanet import GatedDeltaNet, GatedDeltaNetConfig
    from tpzoo.models.gated_deltanet_hf import gated_deltanet_tensor_maps
    from tpzoo.parallel import ParallelDims

    if device.type == "cpu":  # transformers sends these to fla when it is installed; fla needs a GPU
        for name in ("torch_chunk_gated_delta_rule", "torch_recurrent_gated_delta_rule"):
            setattr(m35, name, inspect.unwrap(getattr(m35, name)))
    hf_cfg = Qwen3_5TextConfig(**SHAPE)
    torch.manual_seed(0)
    hf = m35.Qwen3_5GatedDeltaNet(hf_cfg, 0).to(device=device, dtype=dtype)
    cfg = GatedDeltaNetConfig.from_hf(hf_cfg)
    ours = GatedDeltaNet(cfg, ParallelDims.for_rank(device=device), dtype=dtype)
    sd = {f"hf.{k}": v for k, v in hf.state_dict().items()}
    maps = gated_deltanet_tensor_maps(cfg, "ours", "hf", "qwen3_5")
    full = {m.name.split(".", 1)[1]: m.to_tpzoo([sd[h] for h in m.hf]) for m in maps}
    with torch.no_grad():
        for n, p in ours.named_parameters():
            p.copy_(full[n])
    return hf, ours


def clock(device):
    if device.type == "cuda":
        torch.cuda.synchronize()
        return time.perf_counter()
    return time.process_time()


def run(variant, layers, x, train: bool, instrumented=False):
    from tpzoo import kernels
    from tpzoo.plan.measure import peak_live_bytes

    kind, _, backend = variant.partition("/")
    layer = layers[kind]
    layer.zero_grad(set_to_none=True)
    peak = None
    with kernels.use_backend(backend or "torch", kernel="gated_delta_rule"), torch.set_grad_enabled(train):
        t0 = clock(x.device)
        if instrumented:
            with peak_live_bytes() as r:
                y = layer(x)
                if train:
                    y.float().square().mean().backward()
            peak = r.peak
        else:
            y = layer(x)
            if train:
                y.float().square().mean().backward()
        return clock(x.device) - t0, peak, y.detach()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="fp32", choices=["fp32", "bf16"])
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--write", default=None, help="markdown file whose gated-deltanet section to (re)write")
    args = ap.parse_args()
    device, dtype = torch.device(args.device), {"fp32": torch.float32, "bf16": torch.bfloat16}[args.dtype]
    if device.type == "cpu":
        torch.set_num_threads(1)
    load = os.getloadavg()[0]
    start = time.time()
    hf, ours = build(dtype, device)
    layers = {"transformers": hf, "tpzoo": ours}
    variants = ["transformers", "tpzoo/torch"]
    if device.type == "cuda":
        from tpzoo.kernels import gated_delta_fla

        if gated_delta_fla.fla_module() is not None:
            variants.append("tpzoo/triton")  # fla's kernels
    x = torch.randn(1, args.tokens, SHAPE["hidden_size"], device=device, dtype=dtype)
    rows = []
    for train in (True, False):
        times, peaks, outs = {v: [] for v in variants}, {}, {}
        for rep in range(args.reps + 1):
            for v in variants:
                elapsed, peak, y = run(v, layers, x, train, instrumented=rep == 0 and device.type == "cpu")
                if rep == 0:
                    peaks[v], outs[v] = peak, y
                else:
                    times[v].append(elapsed)
        base = statistics.median(times["transformers"])
        for v in variants:
            med = statistics.median(times[v])
            diff = float((outs[v].float() - outs["transformers"].float()).abs().max())
            peak = f"{peaks[v] / 2**20:.0f} MiB" if peaks[v] is not None else "n/a"
            rows.append(f"| {'forward + backward' if train else 'forward'} | {v} | {med * 1e3:.0f} ms | "
                        f"{base / med:.2f}x | {peak} | {diff:.1e} |")
    table = "\n".join(["| step | implementation | time | speed vs transformers | peak | max diff |",
                       "|---|---|---|---|---|---|", *rows])
    cmd = "python scripts/bench/gated_deltanet.py" + (f" --device {args.device}" if device.type != "cpu" else "")
    cmd += (f" --dtype {args.dtype}" if args.dtype != "fp32" else "") + (" --write docs/benchmarks.md"
                                                                        if args.write else "")
    body = (f"## Gated DeltaNet layer: tpzoo vs transformers ({device.type})\n\n"
            f"Command: `{cmd}` on {device.type}, torch {torch.__version__}, {time.time() - start:.0f} s in all; load "
            f"average {load:.1f} before the run. One layer, hidden 1024, 4 key heads / 8 value heads of 128, conv "
            f"kernel 4, {args.dtype}, a micro-batch of 1 x {args.tokens} tokens, tp = 1. transformers: "
            f"Qwen3_5GatedDeltaNet with its torch fallback (torch_chunk_gated_delta_rule); tpzoo: "
            f"models/gated_deltanet.py with the chunked torch rule (kernels/gated_delta.py)"
            f"{'; tpzoo/triton: fla' if 'tpzoo/triton' in variants else ''}. Time: median of {args.reps} after a "
            f"warm-up, variants alternating ({'CPU time of the process, one thread' if device.type == 'cpu' else 'CUDA-synchronized wall clock'}). "
            f"Peak: the most bytes the step's tensors hold at once. Max diff: the output's largest difference from "
            f"transformers'.\n\n{table}\n")
    print(body)
    if args.write:
        write_section(ROOT / args.write if not os.path.isabs(args.write) else args.write, "gated-deltanet", body)


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    main()
