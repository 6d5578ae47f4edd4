"""Tensor-parallel communication per transformer layer per micro-batch: counted vs Megatron's analysis.

    python scripts/bench/tp_comm.py                       # print the markdown table
    python scripts/bench/tp_comm.py --write docs/benchmarks.md   # and (re)write its section there

Runs a stack of layers (no embedding, no head) forward + backward on 4 gloo ranks at tp = 2 and 4, with and
without sequence parallelism (and with full recomputation), counting every collective with
tpzoo.parallel.count_collectives. Analysis (Korthikanti et al. 2022), per layer, for activations of b*s*h elements:
  TP:      4 all-reduces (forward: the attention and MLP output projections; backward: the input gradients
           of the two column-parallel entries), each sending 2(t-1)/t * b*s*h elements from every rank;
  TP + SP: 4 all-gathers + 4 reduce-scatters, each (t-1)/t * b*s*h: the same bytes (a ring all-reduce is a
           reduce-scatter followed by an all-gather), with activations between them sharded t ways; plus 2
           all-gathers in backward: the qkv and fc_in layers keep only their input's sequence shard and gather it
           again for the weight gradient (Megatron-Core does the same), 6 all-gathers in all.
"""
from __future__ import annotations

import argparse
import pathlib
import sys

from mdsection import write_section  # noqa: E402 (a sibling script module)

B, S, LAYERS = 2, 128, 2


def bench_config():
    from tpzoo.models import get_config

    return get_config("nano-llama").replace(hidden_size=256, num_heads=8, num_kv_heads=4, ffn_hidden_size=704,
                                            num_layers=LAYERS, max_position_embeddings=S)


def measure(tp: int, sp: bool, recompute: str) -> dict:
    """{kind: (calls, elements, sent bytes)} over the TP group, per layer per micro-batch, on this rank."""
    import tpzoo
    from tpzoo.plan.measure import tp_layer_collectives

    tpzoo.init_parallel(tp=tp)
    try:
        counts = tp_layer_collectives(bench_config(), B, S, sequence_parallel=sp, recompute=recompute)
        return {k: (calls / LAYERS, elements / LAYERS, sent / LAYERS) for k, (calls, elements, sent) in counts.items()}
    finally:
        tpzoo.destroy_parallel()


def analytical(tp: int, sp: bool, hidden: int) -> dict:
    bsh, ring = B * S * hidden, (tp - 1) / tp
    if not sp:
        return {"all_reduce": (4, 4 * bsh, 4 * 2 * ring * bsh * 4)}
    return {"all_gather": (6, 6 * bsh, 6 * ring * bsh * 4), "reduce_scatter": (4, 4 * bsh, 4 * ring * bsh * 4)}


def table(rows) -> str:
    head = ("| tp | SP | recompute | collective | calls/layer (measured / analytical) | elements/layer "
            "(measured / analytical) | MB sent per rank/layer, fp32 (measured / analytical) |\n"
            "|---|---|---|---|---|---|---|\n")
    lines = []
    for tp, sp, recompute, kind, got, want in rows:
        w = want or ("-", "-", None)
        lines.append(f"| {tp} | {'on' if sp else 'off'} | {recompute} | {kind} | {got[0]:g} / {w[0]} | "
                     f"{got[1]:,.0f} / {w[1] if w[1] == '-' else format(w[1], ',')} | "
                     f"{got[2] / 2**20:.3f} / {'-' if w[2] is None else format(w[2] / 2**20, '.3f')} |")
    return head + "\n".join(lines) + "\n"


def main(argv=None) -> None:
    from tpzoo.testing import run_on_ranks, shutdown_pools

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--write", type=pathlib.Path, help="markdown file whose tp_comm section to (re)write")
    args = parser.parse_args(argv)
    hidden = bench_config().hidden_size
    rows = []
    try:
        for tp in (2, 4):
            for sp, recompute in ((False, "none"), (True, "none"), (False, "full"), (True, "full")):
                got = run_on_ranks(4, measure, tp, sp, recompute)[0]
                want = analytical(tp, sp, hidden) if recompute == "none" else {}
                for kind in sorted(got):
                    rows.append((tp, sp, recompute, kind, got[kind], want.get(kind)))
    finally:
        shutdown_pools()
    body = (f"## Tensor-parallel communication per layer\n\n"
            f"Command: `python scripts/bench/tp_comm.py --write docs/benchmarks.md` (4 gloo ranks; a LLaMA-style "
            f"layer, hidden {hidden}, micro-batch {B} x {S} tokens, forward + backward, {LAYERS} layers averaged). "
            f"Elements are those of the full activation each collective covers (b*s*h = {B * S * hidden:,}); "
            f"bytes are what a bandwidth-optimal ring sends from each rank. With full recomputation the forward "
            f"runs again up to the last saved activation, which repeats the attention's forward collective "
            f"(torch's non-reentrant checkpoint stops early, so the MLP's is not repeated); no analysis given.\n\n"
            + table(rows))
    print(body)
    if args.write:
        write_section(args.write, "tp_comm", body)


if __name__ == "__main__":
    sys.exit(main())
