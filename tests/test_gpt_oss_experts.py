"""gpt-oss's experts through tpzoo's expert_mlp (models/kinds/experts.py) against transformers' GptOssExperts, fp32:
HF's interleaved gate_up_proj converted to tpzoo's fused gate|up halves (models/hf_experts.py), expert biases,
the clamped SwiGLU (alpha 1.702, limit 7.0, (up + 1) * glu; inputs large enough that both clamps bind), routed by
HF's own router: the loop and the grouped paths give HF's output, and the grouped path's gradients equal the
loop's (an expert without tokens included). The conversion round trip is bit-exact. The comparison can fail: gate|up
left interleaved, the gate_up bias or the down bias dropped, or the plain SwiGLU each change the output beyond the
tolerance. The MXFP4 dequantization equals transformers' own convert_moe_packed_tensors bit for bit (bf16 and
fp32), and its layout is HF's unquantized [E, h, 2f]. Under expert tensor parallelism (tp 2, gloo) with gate|up and
its bias split by parts and the down bias on one tp rank, the reduced output equals HF's and every rank's
gradient shards equal the one-process gradients' shards (the down bias's whole on its rank)."""
import functools

import pytest
import torch

import tpzoo
from tpzoo.models.kinds.experts import clamped_swiglu, expert_mlp
from tpzoo.models.hf_experts import dequantize_mxfp4, gpt_oss_experts_from_hf, gpt_oss_experts_to_hf
from tpzoo.parallel import ShardSpec, reduce_from_tp, shard
from tpzoo.testing import run_on_ranks

E, K, H, F_ = 4, 2, 16, 12


@functools.lru_cache(maxsize=1)
def _hf():
    import transformers as tf
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssExperts, GptOssTopKRouter

    cfg = tf.GptOssConfig(hidden_size=H, intermediate_size=F_, num_local_experts=E, num_experts_per_tok=K)
    cfg._experts_implementation = "eager"
    torch.manual_seed(0)
    experts, router = GptOssExperts(cfg), GptOssTopKRouter(cfg)
    with torch.no_grad():
        for p in experts.parameters():
            p.normal_(std=1.0)  # pre-activations of several units: both clamps bind
        router.weight.normal_(std=1.0)
        router.bias.normal_(std=1.0)
    x = torch.randn(10, H, generator=torch.Generator().manual_seed(1)) * 2
    with torch.no_grad():
        _, weights, index = router(x)
        want = experts(x, index, weights)
    return experts, x, weights, index, want


def _moe(x, weights, index, params, gemm, activation=clamped_swiglu):
    """tpzoo's ep = 1 dispatch: assignments grouped by expert, the experts, the weighted combine."""
    flat = index.reshape(-1)
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=E)
    y = expert_mlp(x[order // K], counts, params["gate_up"], params["down"], activation, gemm,
                   params.get("gate_up_bias"), params.get("down_bias"))
    y = torch.empty_like(y).index_copy_(0, order, y)
    return (y.view(-1, K, H) * weights.unsqueeze(-1)).sum(1)


def _params(experts):
    return gpt_oss_experts_from_hf(experts.gate_up_proj.detach(), experts.gate_up_proj_bias.detach(),
                                   experts.down_proj.detach(), experts.down_proj_bias.detach())


def test_round_trip_is_bit_exact():
    experts = _hf()[0]
    back = gpt_oss_experts_to_hf(**_params(experts))
    for name, t in back.items():
        assert torch.equal(t, getattr(experts, name).detach()), name
    ours = _params(experts)
    assert ours["gate_up"].shape == (E, 2 * F_, H) and ours["down"].shape == (E, H, F_)
    # the gate is HF's even columns: unit j's gate row equals column 2j
    assert torch.equal(ours["gate_up"][:, 3], experts.gate_up_proj.detach()[:, :, 6])
    assert torch.equal(ours["gate_up"][:, F_ + 3], experts.gate_up_proj.detach()[:, :, 7])


@pytest.mark.parametrize("gemm", ["loop", "grouped"])
def test_experts_equal_transformers(gemm):
    experts, x, weights, index, want = _hf()
    params = _params(experts)
    got = _moe(x, weights, index, params, gemm)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    pre = torch.einsum("th,tkhf->tkf", x, experts.gate_up_proj.detach()[index]) + experts.gate_up_proj_bias[index]
    assert pre[..., 0::2].max() > 7 and pre[..., 1::2].abs().max() > 7  # both clamps bind on chosen experts
    # The comparison can fail: each mistake moves the output well beyond the tolerance.
    interleaved = dict(params, gate_up=experts.gate_up_proj.detach().transpose(1, 2).contiguous(),
                       gate_up_bias=experts.gate_up_proj_bias.detach())
    wrongs = [interleaved, dict(params, gate_up_bias=None), dict(params, down_bias=None)]
    for wrong in wrongs:
        assert (_moe(x, weights, index, wrong, gemm) - want).abs().max() > 1e-2
    assert (_moe(x, weights, index, params, gemm, activation="swiglu") - want).abs().max() > 1e-2


def test_grouped_gradients_equal_the_loop():
    experts, x, weights, index, _ = _hf()
    keep = index[:, 0] != 3  # expert 3 gets no token
    x, weights, index = x[keep], weights[keep], index[keep].clone()
    index[index == 3] = 0
    dy = torch.randn(x.shape[0], H, generator=torch.Generator().manual_seed(2))
    grads = []
    for gemm in ("loop", "grouped"):
        params = {n: t.clone().requires_grad_() for n, t in _params(experts).items()}
        xi = x.clone().requires_grad_()
        _moe(xi, weights, index, params, gemm).backward(dy)
        grads.append([xi.grad] + [params[n].grad for n in sorted(params)])
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    assert all(not g[3].any() for g in grads[1][1:])  # expert 3 had no token: zero gradients, biases included


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_mxfp4_dequantize_equals_transformers(dtype):
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    g = torch.Generator().manual_seed(4)
    e, rows, groups = 2, 6, 3  # a gate_up_proj of [E, h = 96, 2f = 6]
    blocks = torch.randint(0, 256, (e, rows, groups, 16), generator=g, dtype=torch.uint8)
    scales = torch.randint(115, 135, (e, rows, groups), generator=g, dtype=torch.uint8)
    got = dequantize_mxfp4(blocks, scales, dtype)
    want = convert_moe_packed_tensors(blocks.clone(), scales.clone(), dtype=dtype)
    assert got.dtype == dtype and got.shape == (e, groups * 32, rows) == want.shape
    assert torch.equal(got, want)
    # spot check of the encoding: byte 0x21 with scale 128 holds (e2m1 1 -> 0.5, 2 -> 1.0) * 2
    one = dequantize_mxfp4(torch.full((1, 1, 1, 16), 0x21, dtype=torch.uint8),
                           torch.full((1, 1, 1), 128, dtype=torch.uint8), torch.float32)
    assert one[0, :2, 0].tolist() == [1.0, 2.0]


SPECS = {"gate_up": ShardSpec(1, parts=(F_, F_)), "gate_up_bias": ShardSpec(1, parts=(F_, F_)),
         "down": ShardSpec(2), "down_bias": ShardSpec(None)}


def _tp_worker(params, x, weights, index, dy):
    dims = tpzoo.init_parallel(tp=2)
    try:
        mine = {n: shard(t, SPECS[n], dims.tp_rank, 2).clone().requires_grad_() for n, t in params.items()}
        used = dict(mine, down_bias=mine["down_bias"] if dims.tp_rank == 0 else None)  # added once, before the sum
        out = reduce_from_tp(_moe(x, weights, index, used, "grouped"), dims.tp_group)
        out.backward(dy)
        return out.detach(), {n: t.grad for n, t in mine.items()}
    finally:
        tpzoo.destroy_parallel()


def test_expert_biases_under_expert_tensor_parallelism():
    experts, x, weights, index, want = _hf()
    dy = torch.randn(x.shape[0], H, generator=torch.Generator().manual_seed(5))
    full = {n: t.clone().requires_grad_() for n, t in _params(experts).items()}
    _moe(x, weights, index, full, "loop").backward(dy)
    per_rank = run_on_ranks(2, _tp_worker, _params(experts), x, weights, index, dy)
    for rank, (out, grads) in enumerate(per_rank):
        torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5)
        for name, g in grads.items():
            if name == "down_bias" and rank == 1:
                assert g is None  # unused on the other rank: the trainer sums this gradient over tp
                continue
            torch.testing.assert_close(g, shard(full[name].grad, SPECS[name], rank, 2), rtol=1e-5, atol=1e-5)
