"""Ring attention's block schedule in one process against one fused SDPA over the whole sequence (cp_ring.py
--device): time and peak memory of attention alone, forward + backward.

Every cp rank's forward (all ranks), then every rank's backward, run one rank after another with the library's own
loops (tpzoo.parallel.ring_attention.ring_forward / ring_backward) and the block kernel it picks on the device; the
ring's transfers are replaced by a stand-in that hands each rank the K/V block it would have received and adds the
dK/dV it would have passed on into the owner's gradient. So the measured work is all the ranks' blocks, merges and
accumulations: what cp ranks compute together, against SDPA (is_causal, enable_gqa: what cp = 1 runs) on the
same tokens. Peak memory: the most bytes allocated beyond the inputs (q, k, v, the output gradient; for the ring
each rank's shards, K|V stacked as the ring passes them on) during the forward and backward, torch.cuda's peak on CUDA, the live storages at each op on CPU (a dispatch mode). The
outputs and gradients of both are compared (max abs difference, a sanity check).
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


class LocalExchange:
    """The ring's exchange for rank r when every rank runs in this process, one after another: the i-th K/V
    receive is rank (r - i)'s block; a dK/dV send adds the block's gradient into its owner's total (then zeroes the
    buffer the rank keeps accumulating into), so the totals are complete once every rank has run its backward."""

    def __init__(self, kv_blocks: list, dkv_totals: list, rank: int):
        self.kv, self.totals, self.rank = kv_blocks, dkv_totals, rank
        self.kv_sends = self.dkv_sends = 0

    def start(self, t, tag):
        from tpzoo.parallel.ring_attention import KV_TAG

        cp = len(self.kv)
        if tag == KV_TAG:
            self.kv_sends += 1
            return self.kv[(self.rank - self.kv_sends) % cp]
        self.totals[(self.rank - self.dkv_sends) % cp] += t  # the block this rank's dK/dV belongs to
        self.dkv_sends += 1
        return t.zero_()

    @staticmethod
    def wait(pending):
        return pending


def ring_schedule(q, kv, d_out, cp: int, scale: float, kernel: str):
    """out, dq, dk, dv of every rank ([cp] lists, the load-balanced shards) from the cp ranks' blocks; kv: each
    rank's K|V stacked (the tensor the ring passes on)."""
    from tpzoo.parallel.ring_attention import ring_backward, ring_forward

    totals = [torch.zeros(t.shape, dtype=torch.promote_types(t.dtype, torch.float32), device=t.device) for t in kv]
    saved = [ring_forward(q[r], kv[r][0], kv[r][1], LocalExchange(kv, None, r), r, cp, scale, None, kernel)
             for r in range(cp)]
    dq = [ring_backward(d_out[r], q[r], kv[r][0], kv[r][1], out, lse, states, LocalExchange(kv, totals, r), r, cp,
                        scale, None, kernel)[0] for r, (out, lse, states) in enumerate(saved)]
    return [s[0] for s in saved], dq, [t[0].to(q[0].dtype) for t in totals], [t[1].to(q[0].dtype) for t in totals]


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
            got = ring_schedule(*shards, cp, scale, kernel)
        ring_time = timed(lambda: ring_schedule(*shards, cp, scale, kernel), device, reps)
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
