"""Kimi Delta Attention against transformers (its torch fallback: chunk_kimi_delta_attention) on the same weights and
inputs, one layer, forward + backward and forward alone, side by side: tpzoo's models/kinds/kimi_delta.py (the
per-channel chunked rule of kernels/gated_delta.py) vs KimiLinearDeltaAttention.

    python scripts/bench/kimi_delta.py                               # CPU, fp32
    python scripts/bench/kimi_delta.py --write docs/benchmarks.md    # and (re)write its section there
    python scripts/bench/kimi_delta.py --device cuda --dtype bf16    # GPU: adds tpzoo with fla's KDA when installed

One process, tp = 1. The layer: hidden 1024, 8 heads of 128 (Kimi Linear's head size, a quarter of its 32 heads),
conv kernel 4; a micro-batch of 1 x --tokens tokens. Variants alternate within each repetition (median of --reps
after a warm-up; CPU: the process's CPU time, one thread). Peak (CPU): the most bytes the step's tensors hold at once
(tpzoo.plan.measure.peak_live_bytes). The outputs are compared (max difference) so a fast wrong variant shows.
"""
from __future__ import annotations

import argparse
import inspect
import os
import pathlib
import sys
import time

import torch

from gated_deltanet import compare  # noqa: E402 (sibling script modules)
from mdsection import write_section  # noqa: E402

ROOT = pathlib.Path(__file__).resolve().parents[2]
SHAPE = dict(hidden_size=1024, linear_num_heads=8, linear_head_dim=128, linear_conv_kernel_dim=4, num_hidden_layers=1,
             num_attention_heads=8, num_key_value_heads=8, layer_types=["linear_attention"])


def build_layer(dtype, device, tokens: int):
    from transformers import KimiLinearConfig
    from transformers.models.kimi_linear import modeling_kimi_linear as mk

    from tpzoo.models import ModelLayout
    from tpzoo.models.kinds.kimi_delta import KimiDeltaAttention
    from tpzoo.models.kinds.kimi_delta_hf import kimi_delta_tensor_maps
    from tpzoo.models.registry import get_family

    if device.type == "cpu":  # transformers sends these to fla when installed; fla needs a GPU
        for name in ("chunk_kimi_delta_attention", "recurrent_kimi_delta_attention"):
            setattr(mk, name, inspect.unwrap(getattr(mk, name)))
    hf_cfg = KimiLinearConfig(**SHAPE)
    torch.manual_seed(0)
    hf = mk.KimiLinearDeltaAttention(hf_cfg, 0)
    with torch.no_grad():  # the module alone leaves some tensors empty (its model's _init_weights fills them)
        for p in hf.parameters():
            p.normal_(0, 0.02)
        hf.forget_gate.A_log.uniform_(1, 16).log_()  # fla's init, as tpzoo's reset_parameters
        dt = torch.empty_like(hf.forget_gate.dt_bias).uniform_(-6.9, -2.3).exp()
        hf.forget_gate.dt_bias.copy_(dt + torch.log(-torch.expm1(-dt)))
        hf.o_norm.weight.fill_(1.0)
    hf = hf.to(device=device, dtype=dtype)
    cfg = get_family("kimi_linear").config_from_hf(hf_cfg.to_dict())
    ours = KimiDeltaAttention(cfg, 0, ModelLayout(dtype=dtype, device="meta")).to_empty(device=device)
    sd = {}  # the module's names -> the hub's (the conv split into q, k, v; the forget gate's tensors one level up)
    for k, v in hf.state_dict().items():
        if k == "conv1d.weight":
            sd.update({f"hf.{p}_conv1d.weight": t for p, t in zip("qkv", v.chunk(3))})
        else:
            sd[f"hf.{k.replace('forget_gate.', '')}"] = v
    maps = kimi_delta_tensor_maps(cfg.kimi_delta, "ours", "hf")
    full = {m.name.split(".", 1)[1]: m.to_tpzoo([sd[h] for h in m.hf]) for m in maps}
    with torch.no_grad():
        for n, p in ours.named_parameters():
            p.copy_(full[n].to(p.dtype))
    x = torch.randn(1, tokens, SHAPE["hidden_size"], device=device, dtype=dtype)
    return {"transformers": lambda: hf(x), "tpzoo": lambda: ours(x)}, [hf, ours]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="fp32", choices=["fp32", "bf16"])
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--write", default=None, help="markdown file whose kimi-delta section to (re)write")
    args = ap.parse_args()
    device, dtype = torch.device(args.device), {"fp32": torch.float32, "bf16": torch.bfloat16}[args.dtype]
    if device.type == "cpu":
        torch.set_num_threads(1)
    load, start = os.getloadavg()[0], time.time()
    steps, modules = build_layer(dtype, device, args.tokens)
    variants = ["transformers", "tpzoo/torch"]
    if device.type == "cuda":
        from tpzoo.kernels import gated_delta_fla

        if gated_delta_fla.fla_module(gated_delta_fla.FORMS[True][1]) is not None:
            variants.append("tpzoo/triton")  # fla's KDA kernels
    table = compare(variants, steps, modules, device, args.reps, kernel="kimi_delta_rule")
    cmd = "python scripts/bench/kimi_delta.py"
    cmd += f" --device {args.device}" if device.type != "cpu" else ""
    cmd += f" --dtype {args.dtype}" if args.dtype != "fp32" else ""
    cmd += f" --tokens {args.tokens}" if args.tokens != 2048 else ""
    cmd += f" --reps {args.reps}" if args.reps != 3 else ""
    cmd += " --write docs/benchmarks.md" if args.write else ""
    body = (f"## Kimi Delta Attention layer: tpzoo vs transformers ({device.type})\n\n"
            f"Command: `{cmd}` on {device.type}, torch {torch.__version__}, {time.time() - start:.0f} s in all; load "
            f"average {load:.1f} before the run. One layer, hidden 1024, 8 heads of 128, conv kernel 4; transformers: "
            f"KimiLinearDeltaAttention with its torch fallback (chunk_kimi_delta_attention); tpzoo: "
            f"models/kinds/kimi_delta.py with the per-channel chunked torch rule (kernels/gated_delta.py)"
            f"{'; tpzoo/triton: fla' if 'tpzoo/triton' in variants else ''}. {args.dtype}, a micro-batch of 1 x "
            f"{args.tokens} tokens, tp = 1. Time: median of {args.reps} after a warm-up, variants alternating "
            f"({'CPU time of the process, one thread' if device.type == 'cpu' else 'CUDA-synchronized wall clock'}). "
            f"Peak: the most bytes the step's tensors hold at once. Max diff: the output's largest difference from "
            f"transformers'.\n\n{table}\n")
    print(body)
    if args.write:
        write_section(ROOT / args.write if not os.path.isabs(args.write) else args.write, "kimi-delta", body)


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    main()
