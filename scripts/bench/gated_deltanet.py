"""Gated DeltaNet against transformers (its torch fallback: torch_chunk_gated_delta_rule) on the same weights and
inputs, forward + backward and forward alone, side by side: one layer (tpzoo's models/kinds/gated_deltanet.py vs
Qwen3_5GatedDeltaNet), or a cut Qwen3.5 model step (--what model: Qwen3_5ForCausalLM written by transformers and
loaded by tpzoo from that directory; the loss of a micro-batch and its backward).

    python scripts/bench/gated_deltanet.py                               # CPU, fp32: a cut Qwen3.5 layer
    python scripts/bench/gated_deltanet.py --what model                  # CPU, fp32: a cut Qwen3.5 model step
    python scripts/bench/gated_deltanet.py --write docs/benchmarks.md    # and (re)write its section there
    python scripts/bench/gated_deltanet.py --device cuda --dtype bf16    # GPU: adds tpzoo with fla when installed

One process, tp = 1. The layer: hidden 1024, 4 key heads / 8 value heads of 128 (Qwen3.5's head dims and a 1:2
grouping at a quarter of Qwen3.5-2B's width), conv kernel 4; the model: 4 such layers' pattern (3 Gated DeltaNet,
1 gated attention of 8 heads / 2 kv heads of 128), SwiGLU MLPs of 3072, a vocabulary of 8192, untied. A
micro-batch of 1 x 2048 tokens. Variants alternate within each repetition (median of --reps after a warm-up; CPU:
the process's CPU time, one thread). Peak (CPU): the most bytes the step's tensors hold at once
(tpzoo.plan.measure.peak_live_bytes). The outputs (layer) or losses (model) of the variants are compared (max
difference) so a fast wrong variant shows.
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
MODEL = dict(vocab_size=8192, intermediate_size=3072, tie_word_embeddings=False, pad_token_id=None, bos_token_id=None,
             eos_token_id=None)


def _torch_fallback(device) -> None:
    """transformers sends its torch gated-delta functions to fla when it is installed; fla needs a GPU."""
    import inspect

    from transformers.models.qwen3_5 import modeling_qwen3_5 as m35

    if device.type == "cpu":
        for name in ("torch_chunk_gated_delta_rule", "torch_recurrent_gated_delta_rule"):
            setattr(m35, name, inspect.unwrap(getattr(m35, name)))


def build_layer(dtype, device, tokens: int):
    from transformers.models.qwen3_5 import modeling_qwen3_5 as m35
    from transformers.models.qwen3_5.configuration_qwen3_5 import Qwen3_5TextConfig

    from tpzoo.models import ModelLayout
    from tpzoo.models.kinds.gated_deltanet_hf import gated_deltanet_tensor_maps
    from tpzoo.models.kinds.gated_deltanet import GatedDeltaNet
    from tpzoo.models.registry import get_family

    _torch_fallback(device)
    hf_cfg = Qwen3_5TextConfig(**SHAPE)
    torch.manual_seed(0)
    hf = m35.Qwen3_5GatedDeltaNet(hf_cfg, 0).to(device=device, dtype=dtype)
    cfg = get_family("qwen3_5").config_from_hf(hf_cfg.to_dict())  # layer 0: linear attention
    ours = GatedDeltaNet(cfg, 0, ModelLayout(dtype=dtype, device="meta")).to_empty(device=device)
    sd = {f"hf.{k}": v for k, v in hf.state_dict().items()}
    maps = gated_deltanet_tensor_maps(cfg.gated_deltanet, "ours", "hf", "qwen3_5")
    full = {m.name.split(".", 1)[1]: m.to_tpzoo([sd[h] for h in m.hf]) for m in maps}
    with torch.no_grad():
        for n, p in ours.named_parameters():
            p.copy_(full[n])
    x = torch.randn(1, tokens, SHAPE["hidden_size"], device=device, dtype=dtype)
    return {"transformers": lambda: hf(x), "tpzoo": lambda: ours(x)}, [hf, ours]


def build_model(dtype, device, tokens: int):
    """Qwen3_5ForCausalLM written by transformers into a temporary directory, tpzoo's model loaded from it."""
    import tempfile

    from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig

    from tpzoo.checkpoint import load_model
    from tpzoo.models import Inputs

    _torch_fallback(device)
    torch.manual_seed(0)
    hf = Qwen3_5ForCausalLM(Qwen3_5TextConfig(**SHAPE, **MODEL))
    with tempfile.TemporaryDirectory() as d:
        hf.save_pretrained(d)
        ours = load_model(d, device=device, dtype=dtype)
    hf = hf.to(device=device, dtype=dtype)
    ids = torch.randint(0, MODEL["vocab_size"], (1, tokens), generator=torch.Generator().manual_seed(1))
    ids = ids.to(device)
    labels = torch.cat([ids[:, 1:], torch.full_like(ids[:, :1], -100)], dim=1)

    def tpzoo_loss():
        per_token = ours(Inputs(ids, labels=labels))
        return per_token.sum() / (labels != -100).sum()

    return {"transformers": lambda: hf(input_ids=ids, labels=ids).loss, "tpzoo": tpzoo_loss}, [hf, ours]


def clock(device):
    if device.type == "cuda":
        torch.cuda.synchronize()
        return time.perf_counter()
    return time.process_time()


def run(variant, steps, modules, train: bool, device, instrumented=False, kernel: str = "gated_delta_rule"):
    from tpzoo import kernels
    from tpzoo.plan.measure import peak_live_bytes

    kind, _, backend = variant.partition("/")
    for m in modules:
        m.zero_grad(set_to_none=True)
    peak = None

    def step():
        y = steps[kind]()
        if train:
            y.float().square().mean().backward()  # a loss is a scalar: its square's gradient reaches every weight
        return y

    with kernels.use_backend(backend or "torch", kernel=kernel), torch.set_grad_enabled(train):
        t0 = clock(device)
        if instrumented:
            with peak_live_bytes() as r:
                y = step()
            peak = r.peak
        else:
            y = step()
        return clock(device) - t0, peak, y.detach()


def compare(variants, steps, modules, device, reps: int, kernel: str = "gated_delta_rule") -> str:
    """The markdown table of the variants' forward + backward and forward: median time of `reps` after a warm-up
    (variants alternating), speed against transformers (the first variant), peak bytes (CPU), the output's largest
    difference from transformers'."""
    rows = []
    for train in (True, False):
        times, peaks, outs = {v: [] for v in variants}, {}, {}
        for rep in range(reps + 1):
            for v in variants:
                first = rep == 0
                elapsed, peak, y = run(v, steps, modules, train, device, instrumented=first and device.type == "cpu",
                                       kernel=kernel)
                if first:
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
    return "\n".join(["| step | implementation | time | speed vs transformers | peak | max diff |",
                      "|---|---|---|---|---|---|", *rows])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--what", default="layer", choices=["layer", "model"])
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
    steps, modules = (build_model if args.what == "model" else build_layer)(dtype, device, args.tokens)
    variants = ["transformers", "tpzoo/torch"]
    if device.type == "cuda":
        from tpzoo.kernels import gated_delta_fla

        if gated_delta_fla.fla_module() is not None:
            variants.append("tpzoo/triton")  # fla's kernels
    table = compare(variants, steps, modules, device, args.reps)
    cmd = "python scripts/bench/gated_deltanet.py" + (" --what model" if args.what == "model" else "")
    cmd += f" --device {args.device}" if device.type != "cpu" else ""
    cmd += f" --dtype {args.dtype}" if args.dtype != "fp32" else ""
    cmd += f" --tokens {args.tokens}" if args.tokens != 2048 else ""
    cmd += f" --reps {args.reps}" if args.reps != 3 else ""
    cmd += " --write docs/benchmarks.md" if args.write else ""
    if args.what == "model":
        title, what = "A cut Qwen3.5 model step", (
            "Qwen3_5ForCausalLM, 4 layers (3 Gated DeltaNet of 4 key / 8 value heads of 128, conv kernel 4; 1 gated "
            "attention of 8 heads / 2 kv heads of 128), hidden 1024, SwiGLU MLPs of 3072, vocabulary 8192, untied; "
            "tpzoo's model loaded from transformers' save_pretrained directory; the step: the mean loss of the "
            "micro-batch (forward + backward: its backward)")
        compared = "the loss's difference from transformers'"
    else:
        title, what = "Gated DeltaNet layer", (
            "One layer, hidden 1024, 4 key heads / 8 value heads of 128, conv kernel 4; transformers: "
            "Qwen3_5GatedDeltaNet; tpzoo: models/kinds/gated_deltanet.py")
        compared = "the output's largest difference from transformers'"
    body = (f"## {title}: tpzoo vs transformers ({device.type})\n\n"
            f"Command: `{cmd}` on {device.type}, torch {torch.__version__}, {time.time() - start:.0f} s in all; load "
            f"average {load:.1f} before the run. {what}. {args.dtype}, a micro-batch of 1 x {args.tokens} tokens, "
            f"tp = 1. transformers with its torch fallback (torch_chunk_gated_delta_rule); tpzoo with the chunked "
            f"torch rule (kernels/gated_delta.py){'; tpzoo/triton: fla' if 'tpzoo/triton' in variants else ''}. "
            f"Time: median of {args.reps} after a warm-up, variants alternating "
            f"({'CPU time of the process, one thread' if device.type == 'cpu' else 'CUDA-synchronized wall clock'}). "
            f"Peak: the most bytes the step's tensors hold at once. Max diff: {compared}.\n\n{table}\n")
    print(body)
    if args.write:
        write_section(ROOT / args.write if not os.path.isabs(args.write) else args.write,
                      "qwen3.5-step" if args.what == "model" else "gated-deltanet", body)


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    main()
