"""Ring attention against one process: every cp rank's output and its q/k/v gradients must equal the matching rows
of full causal attention (SDPA) over the whole sequence, for cp = 2 (two rings side by side, dp = 2) and cp = 4,
with grouped-query heads, sliding windows (binding in every block, in some blocks, ending before others), a
sequence that needs padding, blocks by the CPU flash kernel, by the torch math, and by the CUDA kernels' wrappers
(tpzoo.parallel.attention_kernels) over CPU emulations of the private CUDA ops with their signatures and output
layouts (flash's random-number state handed back per block, the memory-efficient kernel's log-sum-exp padded to 32
rows with NaN), and the ring's p2p count and bytes equal to the plan's analytical count
(tpzoo.plan.volume.ring_layer_volume). One 4-rank pool runs every case. Without a pool: the classification of
every ring step's block (all / causal / none / mask) equals what its explicit mask says, the kernel choice, and
the one-process schedule of every rank (tpzoo.parallel.ring_local: the benchmark's, and the GPU check's in
tests/test_cuda.py) equals SDPA with each kernel."""
import math

import pytest
import torch
import torch.nn.functional as F

import tpzoo
from tpzoo.models import get_config
from tpzoo.parallel import attention_kernels, comm
from tpzoo.parallel.context_parallel import padded_length
from tpzoo.parallel.ring_attention import (_block_slices, _mask, block_visibility, local_positions,
                                           ring_attention)
from tpzoo.parallel.ring_local import ring_schedule
from tpzoo.plan import Layout
from tpzoo.plan.volume import ring_layer_volume
from tpzoo.testing import run_on_ranks

CASES = [  # (cp, heads, kv heads, sequence length, window)
    (2, 4, 4, 8, None),
    (2, 4, 2, 11, None),  # GQA, padded to 12
    (2, 4, 1, 12, 3),     # MQA, sliding window
    (4, 4, 2, 16, None),
    (4, 2, 2, 13, 5),     # padded to 16, sliding window (some blocks wholly outside it: skipped)
    (4, 4, 2, 16, 12),    # a window that binds in some blocks only (the others fused)
]
# None: CPU flash blocks; False: torch math; the CUDA wrappers over the emulated ops
RUNS = [(i, fused) for i in range(len(CASES)) for fused in (None, False, "cuda_flash", "cuda_efficient")]
B, D = 2, 8


def _data(h, hkv, s, seed):
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(B, n, s, D, generator=g, dtype=torch.float64) for n in (h, hkv, hkv))
    return q, k, v, torch.randn(B, h, s, D, generator=g, dtype=torch.float64)


def _reference(q, k, v, grad, window):
    q, k, v = (t.clone().requires_grad_() for t in (q, k, v))
    s = q.shape[2]
    pos = torch.arange(s)
    mask = pos[None, :] <= pos[:, None]
    if window is not None:
        mask &= pos[:, None] - pos[None, :] < window
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=q.shape[1] != k.shape[1])
    out.backward(grad)
    return out.detach(), q.grad, k.grad, v.grad


class _EmulatedCudaOps:
    """The private CUDA attention ops, emulated on CPU by the CPU flash kernel with the CUDA ops' signatures and
    output layouts; the backward checks it gets the state its own block's forward returned."""
    cpu_fwd = staticmethod(torch.ops.aten._scaled_dot_product_flash_attention_for_cpu)
    cpu_bwd = staticmethod(torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward)

    def __init__(self):
        self.blocks = {}  # id(seed) -> (sq, sk, causal) of the forward that made it

    def _state(self, q, k, causal):
        seed = torch.zeros(2, dtype=torch.int64)
        self.blocks[id(seed)] = (q.shape[2], k.shape[2], causal)
        return seed, torch.zeros((), dtype=torch.int64)

    def _check(self, q, k, causal, seed):
        assert self.blocks[id(seed)] == (q.shape[2], k.shape[2], causal), (self.blocks.get(id(seed)), causal)
        assert q.stride(-1) == k.stride(-1) == 1

    def flash(self, q, k, v, dropout_p, is_causal, return_debug_mask, *, scale):
        assert dropout_p == 0.0 and not return_debug_mask and q.stride(-1) == 1
        out, lse = self.cpu_fwd(q.contiguous(), k.contiguous(), v.contiguous(), 0.0, is_causal, scale=scale)
        return (out, lse, None, None, q.shape[2], k.shape[2], *self._state(q, k, is_causal), torch.empty(0))

    def flash_backward(self, grad_out, q, k, v, out, lse, cum_q, cum_k, max_q, max_k, dropout_p, is_causal, seed,
                       offset, *, scale):
        self._check(q, k, is_causal, seed)
        assert cum_q is None and cum_k is None and (max_q, max_k) == (q.shape[2], k.shape[2])
        assert lse.shape == q.shape[:3] and lse.is_contiguous()
        return self.cpu_bwd(grad_out.contiguous(), q.contiguous(), k.contiguous(), v.contiguous(), out.contiguous(),
                            lse, 0.0, is_causal, scale=scale)

    def efficient(self, q, k, v, bias, compute_lse, dropout_p, is_causal, *, scale):
        assert bias is None and compute_lse and dropout_p == 0.0
        out, lse = self.cpu_fwd(q.contiguous(), k.contiguous(), v.contiguous(), 0.0, is_causal, scale=scale)
        width = math.ceil(q.shape[2] / 32) * 32  # padded rows, NaN: they must never reach the merge
        padded = torch.full((*lse.shape[:-1], width), float("nan"), dtype=lse.dtype)
        padded[..., : q.shape[2]] = lse
        return (out, padded, *self._state(q, k, is_causal))

    def efficient_backward(self, grad_out, q, k, v, bias, out, lse, seed, offset, dropout_p, grad_input_mask,
                           is_causal, *, scale):
        self._check(q, k, is_causal, seed)
        assert bias is None and list(grad_input_mask) == [True, True, True, False]
        assert lse.shape[-1] == math.ceil(q.shape[2] / 32) * 32 and lse.is_contiguous()
        grads = self.cpu_bwd(grad_out.contiguous(), q.contiguous(), k.contiguous(), v.contiguous(),
                             out.contiguous(), lse[..., : q.shape[2]].contiguous(), 0.0, is_causal, scale=scale)
        return (*grads, None)

    def install(self) -> dict:
        saved = dict(attention_kernels.OPS)
        attention_kernels.OPS.update({
            "_scaled_dot_product_flash_attention": self.flash,
            "_scaled_dot_product_flash_attention_backward": self.flash_backward,
            "_scaled_dot_product_efficient_attention": self.efficient,
            "_scaled_dot_product_efficient_attention_backward": self.efficient_backward})
        return saved


def run_cases():
    results = []
    saved = _EmulatedCudaOps().install()
    try:
        for i, fused in RUNS:
            results.append(_run_case(i, fused))
    finally:
        attention_kernels.OPS.update(saved)
    return results


def _run_case(i, fused):
    cp, h, hkv, s, window = CASES[i]
    dims = tpzoo.init_parallel(cp=cp)
    try:
        padded = padded_length(s, cp)
        q, k, v, grad = _data(h, hkv, s, i)
        pad = lambda t: F.pad(t, (0, 0, 0, padded - s))  # noqa: E731
        idx = local_positions(padded // (2 * cp), cp, dims.cp_rank, "cpu")
        mine = [pad(t).index_select(2, idx).clone().requires_grad_() for t in (q, k, v)]
        with comm.count_collectives() as counter:
            out = ring_attention(*mine, dims.cp_group, dims.ranks("cp"), dims.cp_rank, window=window, fused=fused)
            fwd = {kind: vars(counter.get(kind, "cp")).copy() for kind in ("send", "recv")}
            out.backward(pad(grad).index_select(2, idx))
        total = {kind: vars(counter.get(kind, "cp")) for kind in ("send", "recv")}
        return {"idx": idx, "out": out.detach(), "grads": [t.grad for t in mine], "fwd": fwd,
                "total": total, "dp_rank": dims.dp_rank}
    finally:
        tpzoo.destroy_parallel()


def test_ring_attention_matches_full_attention():
    per_rank = run_on_ranks(4, run_cases)
    for run, (i, fused) in enumerate(RUNS):
        cp, h, hkv, s, window = CASES[i]
        q, k, v, grad = _data(h, hkv, s, i)
        ref = _reference(q, k, v, grad, window)
        seen = torch.zeros(s, dtype=torch.bool)
        for rank in per_rank:
            r = rank[run]
            real = r["idx"] < s  # padding rows have no reference
            for name, got, want in zip(("out", "dq", "dk", "dv"), [r["out"], *r["grads"]], ref):
                torch.testing.assert_close(got[:, :, real], want[:, :, r["idx"][real]], rtol=1e-9, atol=1e-9,
                                           msg=lambda m: f"case {i} fused={fused} {name}: {m}")
            if r["dp_rank"] == 0:
                seen[r["idx"][real]] = True
            # p2p volume: the plan's analytical count (forward N-1 K|V sends, backward N-1 K|V and N dK|dV sends;
            # fp64 here, like the inputs), and a hand count of the same.
            want = ring_layer_volume(get_config("nano-llama").replace(num_heads=h, num_kv_heads=hkv, hidden_size=h * D),
                                     Layout(cp=cp, micro_batch_size=B), padded_length(s, cp), 8)
            kv_bytes = 2 * B * hkv * (padded_length(s, cp) // cp) * D * 8
            assert want["forward"] == (cp - 1, (cp - 1) * kv_bytes)
            assert want["backward"] == (2 * cp - 1, (2 * cp - 1) * kv_bytes)
            assert (r["fwd"]["send"]["calls"], r["fwd"]["send"]["payload_bytes"]) == want["forward"]
            bwd = [r["total"]["send"][k] - r["fwd"]["send"][k] for k in ("calls", "payload_bytes")]
            assert tuple(bwd) == want["backward"]
            assert r["total"]["recv"]["calls"] == r["total"]["send"]["calls"]
        assert seen.all(), f"case {i}: tokens {torch.nonzero(~seen).flatten().tolist()} on no rank"


@pytest.mark.parametrize("cp", [2, 3, 4])
def test_block_visibility_matches_the_explicit_mask(cp):
    """Every ring step's block of every rank, for windows from 1 to beyond the sequence: "none" has no visible pair,
    "all" only visible pairs, "causal" exactly the causal mask by local index, "mask" is neither."""
    chunk = 3
    seen = set()
    for window in [None, *range(1, 2 * cp * chunk + 2)]:
        for rank in range(cp):
            pos = local_positions(chunk, cp, rank, "cpu")
            for step in range(cp):
                owner = (rank - step) % cp
                rows, cols = _block_slices(owner, rank, chunk)
                kpos = local_positions(chunk, cp, owner, "cpu")
                mask = _mask(pos[rows], kpos[cols], window, causal=True)  # (causal: every block is)
                kind = block_visibility(rank, owner, cp, chunk, window)
                seen.add(kind)
                where = (window, rank, owner, kind)
                if kind == "none":
                    assert not mask.any(), where
                elif kind == "all":
                    assert mask.all(), where
                elif kind == "causal":
                    assert owner == rank and torch.equal(mask, torch.ones_like(mask).tril()), where
                else:
                    assert mask.any() and not mask.all(), where
                    assert owner != rank or not torch.equal(mask, torch.ones_like(mask).tril()), where
    assert seen == {"none", "all", "causal", "mask"}


def test_block_kernel_choice():
    pick = attention_kernels.pick_kernel
    every = set(attention_kernels.FUSED)
    bf16, fp32 = torch.bfloat16, torch.float32
    assert pick("cuda", bf16, 64, (9, 0), every) == "cuda_flash"          # H100/H200
    assert pick("cuda", torch.float16, 256, (8, 0), every) == "cuda_flash"
    assert pick("cuda", bf16, 64, (7, 5), every) == "cuda_efficient"      # flash needs sm80+
    assert pick("cuda", fp32, 64, (9, 0), every) == "cuda_efficient"      # flash: 16-bit only
    assert pick("cuda", bf16, 512, (9, 0), every) == "cuda_efficient"     # flash: head dim <= 256
    # flash's backward: no head dim in (192, 224] on sm86-89 and sm120-121
    assert pick("cuda", bf16, 208, (8, 9), every) == "cuda_efficient"
    assert pick("cuda", bf16, 208, (9, 0), every) == "cuda_flash"
    assert pick("cuda", bf16, 256, (8, 9), every) == "cuda_flash"
    assert pick("cuda", bf16, 200, (12, 0), every) == "cuda_efficient"
    assert pick("cuda", bf16, 64, (9, 0), every - {"cuda_flash"}) == "cuda_efficient"
    assert pick("cuda", bf16, 60, (9, 0), every) == "torch"               # head dim not a multiple of 8
    assert pick("cuda", bf16, 64, (9, 0), {"cpu_flash"}) == "torch"
    assert pick("cpu", fp32, 60, None, every) == "cpu_flash"
    assert pick("cpu", fp32, 64, None, set()) == "torch"
    q = torch.zeros(1, 1, 2, 8)
    assert attention_kernels.choose_kernel(q, False) == "torch"
    assert attention_kernels.choose_kernel(q, "cuda_efficient") == "cuda_efficient"
    assert attention_kernels.choose_kernel(q, None) == "cpu_flash"
    with pytest.raises(ValueError, match="unknown block kernel"):
        attention_kernels.choose_kernel(q, "cudnn")


def one_process_case(kernel, cp, h, hkv, s, window, dtype=torch.float64, device="cpu", head_dim=D):
    """Every rank's schedule in this process (ring_local) against SDPA over the whole sequence (fp64): the largest
    difference of the output and q/k/v gradients, relative to the largest entry of each. Shared with
    tests/test_cuda.py (the real CUDA kernels)."""
    g = torch.Generator().manual_seed(cp * 100 + s)
    q, k, v, grad = (torch.randn(B, n, s, head_dim, generator=g, dtype=torch.float64) for n in (h, hkv, hkv, h))
    ref = _reference(q, k, v, grad, window)
    idx = [local_positions(s // (2 * cp), cp, r, "cpu") for r in range(cp)]
    on = lambda t: t.to(device, dtype)  # noqa: E731
    shards = ([on(q.index_select(2, i)) for i in idx], [on(torch.stack([k, v]).index_select(3, i)) for i in idx],
              [on(grad.index_select(2, i)) for i in idx])
    got = ring_schedule(*shards, head_dim ** -0.5, kernel, window)
    worst = 0.0
    for r, i in enumerate(idx):
        for part, whole in zip((x[r] for x in got), ref):
            diff = (part.double().cpu() - whole.index_select(2, i)).abs().max() / whole.abs().max()
            worst = max(worst, float(diff))
    return worst


@pytest.mark.parametrize("kernel", ["cpu_flash", "torch", "cuda_flash", "cuda_efficient"])
def test_one_process_schedule_equals_sdpa(kernel):
    saved = _EmulatedCudaOps().install()
    try:
        for case in [(4, 4, 2, 16, None), (4, 4, 2, 16, 5)]:  # GQA; a window: blocks skipped, masked, fused
            assert one_process_case(kernel, *case) < 1e-9, (kernel, case)
    finally:
        attention_kernels.OPS.update(saved)
