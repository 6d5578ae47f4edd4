"""Ring attention against one process: every cp rank's output and its q/k/v gradients must equal the matching rows
of full causal attention (SDPA) over the whole sequence, for cp = 2 (two rings side by side, dp = 2) and cp = 4,
with grouped-query heads, a sliding window, a sequence that needs padding, blocks by the CPU flash kernel and by
the torch math, and the ring's p2p count and bytes equal to the plan's analytical count
(tpzoo.plan.volume.ring_layer_volume). One 4-rank pool runs every case."""
import torch
import torch.nn.functional as F

import tpzoo
from tpzoo.models import get_config
from tpzoo.parallel import comm
from tpzoo.parallel.context_parallel import padded_length
from tpzoo.parallel.ring_attention import local_positions, ring_attention
from tpzoo.plan import Layout
from tpzoo.plan.volume import ring_layer_volume
from tpzoo.testing import run_on_ranks

CASES = [  # (cp, heads, kv heads, sequence length, window)
    (2, 4, 4, 8, None),
    (2, 4, 2, 11, None),  # GQA, padded to 12
    (2, 4, 1, 12, 3),     # MQA, sliding window
    (4, 4, 2, 16, None),
    (4, 2, 2, 13, 5),     # padded to 16, sliding window
]
RUNS = [(i, fused) for i in range(len(CASES)) for fused in (None, False)]  # CPU flash blocks (no window), torch math
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


def run_cases():
    results = []
    for i, fused in RUNS:
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
            results.append({"idx": idx, "out": out.detach(), "grads": [t.grad for t in mine], "fwd": fwd,
                            "total": total, "dp_rank": dims.dp_rank})
        finally:
            tpzoo.destroy_parallel()
    return results


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
