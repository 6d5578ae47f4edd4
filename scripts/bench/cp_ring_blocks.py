"""Ring attention's block schedule in one process against one fused SDPA over the whole sequence (cp_ring.py
--device): time and peak memory of attention alone, forward + backward.

Every cp rank's forward, then every rank's backward, one rank after another (tpzoo.parallel.ring_local: ring
attention's own loops and the block kernel it picks on the device, the transfers replaced by hand-overs). So the
measured work is all the ranks' blocks, merges and accumulations: what cp ranks compute together, against SDPA
(is_causal, enable_gqa: what cp = 1 runs) on the same tokens. Peak memory: the most bytes allocated beyond the
inputs (q, k, v, the output gradient; for the ring each rank's shards, K|V stacked as the ring passes them on)
during the forward and backward, torch.cuda's peak on CUDA, the live storages at each op on CPU (a dispatch
mode). The outputs and gradients of both are compared (max abs difference, a sanity check).
"""
from __future__ import annotations

import contextlib
import os
import statistics
import time

import torch
import torch.nn.functional as F
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves


def sdpa(q, k, v, d_out, scale: float):
    q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
    out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=q.shape[1] != k.shape[1], scale=scale)
    out.backward(d_out)
    return out.detach(), q.grad, k.grad, v.grad


class _PeakLiveBytes(TorchDispatchMode):
    """CPU: the most bytes held by storages that ops created in the block, sampled after every op (a view of an
    input is not an allocation: the inputs' storages are excluded)."""

    def __init__(self, inputs):
        super().__init__()
        self.live, self.peak = {}, 0
        self.inputs = {StorageWeakRef(t.untyped_storage()).cdata for t in inputs}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                ref = StorageWeakRef(t.untyped_storage())
                if ref.cdata not in self.inputs:
                    self.live.setdefault(ref.cdata, (ref, t.untyped_storage().nbytes()))
        self.live = {key: v for key, v in self.live.items() if not v[0].expired()}
        self.peak = max(self.peak, sum(n for _, n in self.live.values()))
        return out


@contextlib.contextmanager
def peak_bytes(device: torch.device, inputs):
    result = {}
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        before = torch.cuda.memory_allocated(device)
        yield result
        torch.cuda.synchronize(device)
        result["peak"] = torch.cuda.max_memory_allocated(device) - before
    else:
        mode = _PeakLiveBytes(inputs)
        with mode:
            yield result
        result["peak"] = mode.peak


def timed(fn, device, reps: int) -> float:
    """Median seconds of fn() over reps after a warm-up: wall clock on CUDA, this process's CPU time on CPU (one
    thread: steadier than the wall clock on a shared machine)."""
    clock = time.perf_counter if device.type == "cuda" else time.process_time
    times = []
    for i in range(reps + 1):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t0 = clock()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        if i:
            times.append(clock() - t0)
    return statistics.median(times)


def _max_diff(a, b) -> float:
    return max(float((x.double() - y.double()).abs().max()) for x, y in zip(a, b))


def run_blocks(device: str, seq: int | None, cps: list[int], reps: int) -> str:
    from tpzoo.models import get_config
    from tpzoo.parallel.attention_kernels import choose_kernel
    from tpzoo.parallel.ring_attention import local_positions
    from tpzoo.parallel.ring_local import ring_schedule

    device = torch.device(device)
    if device.type == "cpu":
        torch.set_num_threads(1)
    cfg = get_config("llama-3.2-1b")
    h, hkv, d = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    seq = seq or (32768 if device.type == "cuda" else 2048)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    bad = [cp for cp in cps if seq % (2 * cp)]
    if bad:
        raise SystemExit(f"--seq {seq} does not split into 2 * cp chunks for cp = {bad}")
    g = torch.Generator(device=device).manual_seed(0)
    # [b, s, heads, d] in memory, seen as [b, heads, s, d]: the layout the model's attention hands over
    q, k, v, d_out = (torch.randn(1, seq, n, d, generator=g, device=device, dtype=dtype).transpose(1, 2)
                      for n in (h, hkv, hkv, h))
    scale = d ** -0.5
    t0 = time.perf_counter()
    with peak_bytes(device, (q, k, v, d_out)) as mem:
        ref = sdpa(q, k, v, d_out, scale)
    base_time, base_mem = timed(lambda: sdpa(q, k, v, d_out, scale), device, reps), mem["peak"]
    kernel = choose_kernel(q, None)
    rows = []
    for cp in cps:
        idx = [local_positions(seq // (2 * cp), cp, r, device) for r in range(cp)]
        shards = [[t.index_select(2, i) for i in idx] for t in (q, d_out)]
        shards.insert(1, [torch.stack([k.index_select(2, i), v.index_select(2, i)]) for i in idx])
        with peak_bytes(device, [t for part in shards for t in part]) as mem:
            got = ring_schedule(*shards, scale, kernel)
        ring_time = timed(lambda: ring_schedule(*shards, scale, kernel), device, reps)
        full = [torch.zeros_like(t) for t in ref]
        for r, i in enumerate(idx):
            for whole, part in zip(full, (x[r] for x in got)):
                whole.index_copy_(2, i, part)
        rows.append(f"| {cp} | {seq // cp} | {kernel} | {ring_time * 1e3:.1f} | {base_time * 1e3:.1f} | "
                    f"{ring_time / base_time:.2f} | {mem['peak'] / 2**20:.0f} | {base_mem / 2**20:.0f} | "
                    f"{mem['peak'] / base_mem:.2f} | {_max_diff(full, ref):.1e} |")
        del shards, got, full
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else f"CPU ({os.cpu_count()} cores)"
    return (f"## Ring attention blocks vs one fused SDPA ({device.type})\n\n"
            f"Command: `python scripts/bench/cp_ring.py --device {device.type}"
            f"{'' if seq == (32768 if device.type == 'cuda' else 2048) else f' --seq {seq}'} --write "
            f"docs/benchmarks.md` on {name}, torch {torch.__version__}, {time.perf_counter() - t0:.0f} s. "
            f"Attention alone, forward + backward: one sequence of {seq} tokens, llama-3.2-1b heads ({h} query, "
            f"{hkv} kv, head dim {d}), {str(dtype).split('.')[-1]}. Ring: every cp rank's blocks run one rank after "
            f"another in this process with ring attention's own loops and block kernel (transfers replaced by "
            f"hand-overs: the ring overlaps them with the blocks); SDPA: F.scaled_dot_product_attention over the "
            f"whole sequence (is_causal, enable_gqa), what cp = 1 runs. Time: median of {reps} after a warm-up, "
            f"{'wall clock' if device.type == 'cuda' else 'CPU time of the process, one thread'}. "
            f"Peak: the most bytes allocated beyond the inputs during forward and backward "
            f"({'torch.cuda.max_memory_allocated' if device.type == 'cuda' else 'live storages after each op'}). "
            f"Max diff: largest difference of the output and q/k/v gradients from SDPA's.\n\n"
            "| cp | tokens per rank | block kernel | ring ms (all ranks) | SDPA ms | time ratio | ring peak MiB | "
            "SDPA peak MiB | memory ratio | max diff |\n|---|---|---|---|---|---|---|---|---|---|\n"
            + "\n".join(rows))
