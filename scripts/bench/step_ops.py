"""Count the ops of one training step's parts with torch.profiler (CPU): what a GPU would launch, op by op.

    python scripts/bench/step_ops.py [--model tiny-llama] [--dtype bf16] [--zero 0] [--write docs/benchmarks.md]

Op counts, not times, are what a CPU can measure of a GPU step: every aten op that is not a view (slice,
select, view, ...) becomes at least one kernel launch there. Counted, one process, tp = dp = 1, DistributedAdamW
(weight decay on, so both update classes run), the backward with gradient-accumulation fusion off and on:

    backward     every op of one micro-batch's backward; of them `add_` (a gradient added into a main gradient,
                 or an in-place accumulation) and `cat` (a split's backward)
    grad norm    DistributedAdamW.global_grad_norm()
    step         DistributedAdamW.step(lr, grad_scale=0.5) (clipping active), publish included

Runs against an older checkout too (PYTHONPATH=<tree>): options its DistributedAdamW lacks are left out. With
TRITON_INTERPRET=1 TPZOO_KERNELS=triton the kernels take their Triton path (interpreted; counted per launch), as
on a GPU; otherwise the CPU's torch references run (the SwiGLU reference still splits gate|up, so its backward
cats).
"""
from __future__ import annotations

import argparse
import collections
import inspect
import sys

import torch

def count(fn) -> collections.Counter:
    """Launches of fn() by kind (tpzoo.kernels.launch.count_launches: top-level aten ops, Triton launches, views
    and allocations apart as "views")."""
    from tpzoo.kernels import launch

    return launch.count_launches(fn)


def kernels(c: collections.Counter) -> int:
    from tpzoo.kernels import launch

    return launch.launches(c)


def measure(args, fusion: bool) -> dict:
    import tpzoo
    from tpzoo.models import Inputs, Transformer, get_config
    from tpzoo.train.optim import DistributedAdamW

    cfg = get_config(args.model)
    dims = tpzoo.init_parallel(tp=1)
    try:
        model = Transformer(cfg, dims, seed=1)
        kw = dict(model_dtype={"bf16": torch.bfloat16, "fp32": torch.float32}[args.dtype], zero=args.zero,
                  weight_decay=0.1, bucket_elems=args.bucket_elems)
        if "grad_accumulation_fusion" in inspect.signature(DistributedAdamW).parameters:
            kw["grad_accumulation_fusion"] = fusion
        elif fusion:
            return {}
        opt = DistributedAdamW(list(model.parameters()), dims, **kw)
        ids = torch.randint(0, cfg.vocab_size, (args.batch, args.seq), generator=torch.Generator().manual_seed(0))
        for _ in range(2):  # warm: the optimizer's first step builds what it keeps
            opt.zero_grad()
            model(Inputs(ids, labels=ids)).sum().backward()
            opt.reduce_grads()
            opt.global_grad_norm()
            opt.step(1e-3, 0.5)
        opt.zero_grad()
        loss = model(Inputs(ids, labels=ids)).sum()
        backward = count(loss.backward)
        opt.reduce_grads()
        return {"backward": backward, "norm": count(opt.global_grad_norm),
                "step": count(lambda: opt.step(1e-3, 0.5)), "params": sum(p.numel() for p in model.parameters()),
                "tensors": len(list(model.parameters())), "layers": cfg.num_layers}
    finally:
        tpzoo.destroy_parallel()


def fmt(c: collections.Counter, top: int = 4) -> str:
    return ", ".join(f"{k.replace('aten::', '')} {v}" for k, v in c.most_common(top) if k != "views")


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="tiny-llama")
    p.add_argument("--dtype", default="bf16", choices=["bf16", "fp32"])
    p.add_argument("--zero", type=int, default=0)
    p.add_argument("--bucket-elems", type=int, default=1 << 24, help="gradient bucket (the norm ran per bucket)")
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--label", default="this checkout")
    p.add_argument("--fusion", choices=["both", "on", "off"], default="both")
    p.add_argument("--write", help="markdown file to write the table into (section step_ops)")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    rows = []
    for fusion in {"both": (False, True), "on": (True,), "off": (False,)}[args.fusion]:
        got = measure(args, fusion)
        if not got:
            continue
        r = got
        b = r["backward"]
        n, st = r["norm"], r["step"]
        rows.append(f"| {args.label} | {'on' if fusion else 'off'} | {kernels(b)} | {b['aten::add_']} | "
                    f"{b['aten::cat']} | {kernels(n)} + {n['views']} ({fmt(n)}) | "
                    f"{kernels(st)} + {st['views']} ({fmt(st)}) |")
    head = (f"{args.model}, {r['layers']} layers, {r['params']:,} parameters in {r['tensors']} tensors, "
            f"{args.dtype} weights, ZeRO {args.zero}, {args.bucket_elems:,}-element gradient buckets, micro-batch "
            f"{args.batch} x {args.seq}, kernels "
            f"{__import__('os').environ.get('TPZOO_KERNELS', 'auto')}")
    table = "\n".join(["| code | grad-acc fusion | backward ops | of them add_ | of them cat | grad-norm ops + views | "
                       "step ops + views (clipping on) |", "|---|---|---|---|---|---|---|", *rows])
    print(head)
    print(table)
    if args.write:
        sys.path.insert(0, str(__import__("pathlib").Path(__file__).parent))
        from mdsection import write_section
        write_section(args.write, "step_ops", f"{head}\n\n{table}\n")


if __name__ == "__main__":
    main()
