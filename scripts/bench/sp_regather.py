"""Sequence parallelism: what re-gathering the column-parallel inputs in backward saves, and what it costs.

    python scripts/bench/sp_regather.py                            # print the markdown section
    python scripts/bench/sp_regather.py --write docs/benchmarks.md # and (re)write its section there

On 4 gloo ranks, a stack of LLaMA-style layers (no embedding, no head) with sequence parallelism at tp = 1, 2, 4,
side by side in one run: "keep" = autograd keeps the all-gathered, full-sequence input of the qkv and fc_in
matmuls (tpzoo before; tpzoo.parallel.column_linear.keep_gathered_inputs), "re-gather" = only this rank's
sequence shard is kept and gathered again in backward, overlapped with the input-gradient matmul (the default).
Per layer and micro-batch: the bytes autograd saves (unique storages, bf16, torch kernels), the plan's estimate,
Korthikanti et al.'s s*b*h*(34/t + 5as/(ht)) for reference (a GPT layer with dropout and materialized scores:
not tpzoo's kernels, docs/plan.md explains the terms), the TP collectives forward and backward, and the time of a
forward + backward (median of the timed repetitions, the two variants alternating).
"""
from __future__ import annotations

import argparse
import contextlib
import pathlib
import statistics
import sys
import time

from mdsection import write_section  # noqa: E402 (a sibling script module)

B, S, LAYERS, REPS = 1, 512, 4, 7


def bench_config(layers: int = LAYERS):
    from tpzoo.models import get_config

    return get_config("nano-llama").replace(hidden_size=256, num_heads=8, num_kv_heads=4, ffn_hidden_size=704,
                                            num_layers=layers, max_position_embeddings=S)


def _variant(keep: bool):
    from tpzoo.parallel.column_linear import keep_gathered_inputs

    return keep_gathered_inputs() if keep else contextlib.nullcontext()


def _model(tp: int, layers: int, dtype):
    from tpzoo.models import ModelLayout, Stage, Transformer

    return Transformer(bench_config(layers), ModelLayout(sequence_parallel=tp > 1, dtype=dtype),
                       Stage(pre_process=False, post_process=False))


def measure(tp: int) -> dict:
    """On this rank, for both variants: saved bytes per layer, collectives per layer (fwd, bwd), step times."""
    import torch

    import tpzoo
    from tpzoo import kernels as K
    from tpzoo.parallel import count_collectives
    from tpzoo.plan.measure import forward_activation_bytes

    tpzoo.init_parallel(tp=tp)
    out = {}
    try:
        with K.use_backend("torch"):
            for keep in (False, True):
                with _variant(keep):
                    one, many = (forward_activation_bytes(_model(tp, n, torch.bfloat16), B, S, hooks=True)
                                 for n in (1, 2))
                    model = _model(tp, LAYERS, torch.float32)
                    x = torch.randn(B, S // tp, model.cfg.hidden_size, requires_grad=True)
                    with count_collectives() as fwd:
                        y = model(Inputs(hidden=x))
                    with count_collectives() as bwd:
                        y.square().sum().backward()
                comm = {phase: {k: (s.calls / LAYERS, s.sent_bytes / LAYERS) for (k, g), s in c.stats.items()
                                if g == "tp"} for phase, c in (("forward", fwd), ("backward", bwd))}
                out[keep] = {"bytes": many - one, "comm": comm, "times": []}
            model = _model(tp, LAYERS, torch.float32)
            x = torch.randn(B, S // tp, model.cfg.hidden_size, requires_grad=True)
            for rep in range(REPS + 1):
                for keep in (False, True):  # alternating, so drift on a shared machine hits both alike
                    with _variant(keep):
                        torch.distributed.barrier()
                        t0 = time.perf_counter()
                        model(Inputs(hidden=x)).square().sum().backward()
                        torch.distributed.barrier()
                        if rep:  # the first is warm-up
                            out[keep]["times"].append(time.perf_counter() - t0)
        return out
    finally:
        tpzoo.destroy_parallel()


def paper_bytes(cfg, tp: int) -> float:
    """Korthikanti et al., TP + SP, no recomputation, 16-bit: s*b*h*(34/t + 5as/(ht)) per layer."""
    s, b, h, a = S, B, cfg.hidden_size, cfg.num_heads
    return s * b * h * (34 / tp + 5 * a * s / (h * tp))


def _comm(c: dict) -> str:
    return ", ".join(f"{k} {calls:g} ({sent / 2**20:.2f} MB)" for k, (calls, sent) in sorted(c.items())) or "-"


def main(argv=None) -> None:
    from tpzoo.plan import RankLayout, layer_activation_bytes
    from tpzoo.testing import run_on_ranks, shutdown_pools

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--write", type=pathlib.Path, help="markdown file whose sp_regather section to (re)write")
    args = parser.parse_args(argv)
    cfg = bench_config()
    try:
        results = {tp: run_on_ranks(4, measure, tp)[0] for tp in (1, 2, 4)}
    finally:
        shutdown_pools()
    lines = ["| tp | variant | saved KiB/layer (measured) | plan estimate | paper formula | TP collectives/layer, "
             "forward | backward | fwd+bwd ms (median) | vs keep |", "|---|---|---|---|---|---|---|---|---|"]
    for tp, res in results.items():
        est = layer_activation_bytes(cfg, 0, RankLayout(tp=tp, sequence_parallel=tp > 1, kernels="reference"), B, S)
        base = statistics.median(res[True]["times"])
        for keep in ((True, False) if tp > 1 else (False,)):
            r = res[keep]
            t = statistics.median(r["times"])
            name = "keep (before)" if keep else "re-gather"
            lines.append(f"| {tp} | {name if tp > 1 else '-'} | {r['bytes'] / 1024:.1f} | "
                         f"{'-' if keep else format(est / 1024, '.1f')} | {paper_bytes(cfg, tp) / 1024:.1f} | "
                         f"{_comm(r['comm']['forward'])} | {_comm(r['comm']['backward'])} | {t * 1e3:.1f} | "
                         f"{format(t / base, '.2f') if tp > 1 else '-'} |")
    body = (f"## Sequence parallelism: re-gathering the column inputs in backward\n\n"
            f"Command: `python scripts/bench/sp_regather.py --write docs/benchmarks.md` (4 gloo ranks on the "
            f"2-core CPU machine, tp = 1, 2, 4 with SP; {LAYERS} LLaMA-style layers, hidden {cfg.hidden_size}, "
            f"{cfg.num_heads} heads, {cfg.num_kv_heads} kv heads, ffn {cfg.ffn_hidden_size}, one micro-batch of "
            f"{B} x {S} tokens). Saved bytes: unique storages autograd keeps per layer (bf16, torch kernels; a "
            f"2-layer minus a 1-layer stack). Paper formula: Korthikanti et al.'s s*b*h*(34/t + 5as/(ht)) bytes "
            f"for a GPT layer with dropout and materialized attention scores, for scale only (tpzoo keeps no "
            f"scores or dropout masks; docs/plan.md maps the terms). Collectives: per layer, calls and MB each "
            f"rank sends (fp32). Time: forward + backward of the {LAYERS}-layer stack in fp32, median of {REPS} "
            f"repetitions, the two variants alternating in the same processes.\n\n" + "\n".join(lines))
    print(body)
    if args.write:
        write_section(args.write, "sp_regather", body)


if __name__ == "__main__":
    sys.exit(main())
