"""Multi-GPU acceptance: every parallel path on NCCL against one GPU (scripts/gpu_check.sh's `nccl` phase).

Every layout trains the same tiny model on the same data as a single rank does, on one rank per GPU with NCCL,
and must reach the same losses: tp=2 and tp=2 + SP, pp=2 with 1F1B and zero-bubble, dp=2 with the reduction
overlapped with backward at ZeRO-1 and at ZeRO-3 (next layer prefetched), cp=2 with ring attention and with
all-to-all, ep=2 on a tiny mixture of experts, and greedy generation at tp=2 from the reference's checkpoint
against tp=1. Each runs twice: as users run it, and in strict collective mode (tpzoo/parallel/strict.py: outputs
poisoned until wait(), inputs checked at wait(), every collective waited by the end of each step). With 8 GPUs
or more a (tp, pp, dp) = (2, 2, 2) run is added. Last, the all-reduce bus bandwidth on the tp group (all GPUs).

Ranks are pooled (tpzoo.testing.run_on_ranks with backend nccl): processes and NCCL communicators start once.
On the CPU (`--cpu`, what CI runs through scripts/gpu_check.sh --cpu) the same runs use 2 gloo ranks.

    python scripts/multi_gpu_check.py            # on a node with 2+ GPUs (a few minutes)
    python scripts/multi_gpu_check.py --cpu      # the same code on 2 CPU ranks (gloo), toy sizes
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TOLERANCE = 1e-4  # fp32: a layout changes the order of sums only

# (name, model, config overrides): each against the single-rank run of its model
LAYOUTS = [
    ("tp2", "tiny-llama", dict(tp=2)),
    ("tp2-sp", "tiny-llama", dict(tp=2, sequence_parallel=True)),
    ("pp2-1f1b", "tiny-llama", dict(pp=2, schedule="1f1b")),
    ("pp2-zero-bubble", "tiny-llama", dict(pp=2, schedule="zb")),
    ("dp2-zero1", "tiny-llama", dict(dp=2, zero=1, overlap_grad_reduce=True)),
    ("dp2-zero3", "tiny-llama", dict(dp=2, zero=3, overlap_grad_reduce=True)),
    ("cp2-ring", "tiny-llama", dict(cp=2, cp_mode="ring")),
    ("cp2-a2a", "tiny-llama", dict(cp=2, cp_mode="a2a")),
    ("ep2-moe", "tiny-mixtral", dict(ep=2, dp=2)),
]
WIDE = ("tp2-pp2-dp2", "tiny-llama", dict(tp=2, pp=2, dp=2, sequence_parallel=True))


def _config(model: str, data: str, cpu: bool, save: str = "", **layout):
    from tpzoo.train import load_config

    base = dict(model=model, data=[data], seq_len=32 if cpu else 128, global_batch_size=8, micro_batch_size=2,
                steps=3 if cpu else 6, lr=3e-3, warmup_steps=1, tp=1, pp=1, dp=1, save=save, sample_prompt="",
                quiet=True, eval_fraction=0.0, seed=0, prefetch=0, dtype="fp32", device="cpu" if cpu else "auto")
    base.update(layout)
    return load_config(None, base)


# -- what each rank runs (module-level: pickled by reference into the pooled ranks) ------------------------------

def train_losses(cfg, strict_on: bool) -> list[float]:
    from tpzoo.parallel import strict_collectives
    from tpzoo.train import train

    with strict_collectives(strict_on):
        return train(cfg)["losses"]


def generate_ids(ckpt: str, tp: int, strict_on: bool, device: str) -> list:
    import torch

    import tpzoo
    from tpzoo.checkpoint import load_model
    from tpzoo.generation import generate
    from tpzoo.parallel import strict_collectives

    dims = tpzoo.init_parallel(tp=tp, dp=None, device=device)
    try:
        with strict_collectives(strict_on):
            model = load_model(ckpt, dims, dtype=torch.float32)
            prompt = torch.arange(3, 11).reshape(2, 4)
            return generate(model, prompt, 12, dims=dims).cpu().tolist()
    finally:
        tpzoo.destroy_parallel()


def bus_bandwidth(mib: int, iters: int, device: str) -> float:
    """All-reduce bus bandwidth (GB/s) on the tp group of all ranks: algorithm bytes * 2(n-1)/n per second."""
    import torch

    import tpzoo
    from tpzoo.parallel import comm

    import torch.distributed as dist

    n = dist.get_world_size()
    dims = tpzoo.init_parallel(tp=n, device=device)
    try:
        x = torch.ones(mib * 2**20 // 4, dtype=torch.float32, device=dims.device)
        for _ in range(2):  # warm-up: the communicator and its buffers
            comm.all_reduce(x, dims.tp_group)
        _sync(dims.device)
        t0 = time.perf_counter()
        for _ in range(iters):
            comm.all_reduce(x, dims.tp_group)
        _sync(dims.device)
        seconds = (time.perf_counter() - t0) / iters
        return x.nbytes * 2 * (n - 1) / n / seconds / 1e9
    finally:
        tpzoo.destroy_parallel()


def _sync(device) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


# -- the driver ------------------------------------------------------------------------------------------------

def run(cpu: bool, out: Path, gpus: int, only: list | None = None) -> tuple[list[str], bool]:
    """Run every check (`only`: these layouts); returns (markdown lines: a table and the bandwidth, whether all
    passed)."""
    import sysconfig

    from tpzoo.testing import run_on_ranks, shutdown_pools

    backend, device = ("gloo", "cpu") if cpu else ("nccl", "auto")
    data = str(Path(sysconfig.get_paths()["stdlib"]) / "textwrap.py")
    (out / "data").mkdir(parents=True, exist_ok=True)
    rows, ok = [], True

    def ranks(n, fn, *args):
        return run_on_ranks(n, fn, *args, backend=backend, timeout=600)

    def cfg(model, save="", **layout):
        return _config(model, data, cpu, save=save, data_cache=str(out / "data"), **layout)

    try:
        ckpt_dir = str(out / "reference")
        layouts = [x for x in LAYOUTS + ([WIDE] if gpus >= 8 and not cpu else []) if not only or x[0] in only]
        reference = {"tiny-llama": ranks(1, train_losses, cfg("tiny-llama", save=ckpt_dir), False)[0]}
        if any(model == "tiny-mixtral" for _, model, _ in layouts):
            reference["tiny-mixtral"] = ranks(1, train_losses, cfg("tiny-mixtral"), False)[0]
        for name, model, layout in layouts:
            world = layout.get("tp", 1) * layout.get("pp", 1) * layout.get("dp", 1) * layout.get("cp", 1)
            for strict_on in (False, True):
                t0 = time.perf_counter()
                try:
                    got = ranks(world, train_losses, cfg(model, **layout), strict_on)[0]
                    worst = max(abs(a - b) for a, b in zip(got, reference[model]))
                    good = len(got) == len(reference[model]) and worst <= TOLERANCE
                    detail = f"{worst:.1e}"
                except Exception as e:  # noqa: BLE001 - reported in the table, the other layouts still run
                    good, detail = False, _first_line(e)
                ok &= good
                rows.append(f"| {name} | {'strict' if strict_on else 'plain'} | {world} | {detail} | "
                            f"{time.perf_counter() - t0:.0f} s | {'ok' if good else 'FAILED'} |")
        from tpzoo.train.checkpointing import latest_checkpoint

        ckpt = str(latest_checkpoint(ckpt_dir))
        want = ranks(1, generate_ids, ckpt, 1, False, device)[0]
        for strict_on in (False, True):
            t0 = time.perf_counter()
            try:
                got = ranks(2, generate_ids, ckpt, 2, strict_on, device)
                good, detail = all(g == want for g in got), "same tokens" if got[0] == want else "tokens differ"
            except Exception as e:  # noqa: BLE001
                good, detail = False, _first_line(e)
            ok &= good
            rows.append(f"| generate tp2 | {'strict' if strict_on else 'plain'} | 2 | {detail} | "
                        f"{time.perf_counter() - t0:.0f} s | {'ok' if good else 'FAILED'} |")
        n = 2 if cpu else gpus
        busbw = ranks(n, bus_bandwidth, 4 if cpu else 256, 5 if cpu else 20, device)[0]
    finally:
        shutdown_pools()
    lines = [f"{'2 CPU ranks (gloo)' if cpu else f'{gpus} GPUs (NCCL)'}: each layout against one rank, "
             f"max |loss diff| over {_config('tiny-llama', data, cpu).steps} steps (tolerance {TOLERANCE:g})", "",
             "| layout | mode | ranks | max abs loss diff | time | status |", "|---|---|---|---|---|---|", *rows, "",
             f"all-reduce bus bandwidth on the tp group ({n} ranks, {4 if cpu else 256} MiB fp32): {busbw:.1f} GB/s"]
    return lines, ok


def _first_line(e: Exception) -> str:
    text = f"{type(e).__name__}: {e}"
    errors = [line.strip() for line in text.splitlines() if "Error" in line or "Misuse" in line]
    return (errors[-1] if errors else text.splitlines()[0])[:160].replace("|", "/")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--cpu", action="store_true", help="2 gloo ranks on the CPU, toy sizes")
    p.add_argument("--out", default="runs/multi_gpu_check")
    p.add_argument("--layouts", nargs="+", choices=[name for name, _, _ in LAYOUTS + [WIDE]],
                   help="run only these layouts (default: all; generation at tp=2 always runs)")
    a = p.parse_args(argv)
    import torch

    gpus = torch.cuda.device_count()
    if not a.cpu and gpus < 2:
        print(f"skipped: the multi-GPU checks need 2 GPUs ({gpus} visible)")
        return 0
    out = Path(a.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    lines, ok = run(a.cpu, out, gpus, a.layouts)
    print("\n".join(lines))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT / "scripts"))
    import multi_gpu_check  # the rank functions pickled by module name, not as __main__'s

    sys.exit(multi_gpu_check.main())
