"""The experts as grouped GEMMs (models/kinds/experts.py) against the loop of matmuls, on CPU where the grouped op is
grouped_mm_reference (torch._grouped_mm's function, in plain torch): the reference equals per-group matmuls in
both of its layouts (empty groups included); GroupedLinear's input and weight gradients equal the loop's; a tiny
Mixtral (SwiGLU) and a GeGLU (geglu_tanh) variant give the same loss and every gradient (fp32, 1e-5) through the
grouped path as through the loop, in one process and at (tp, ep) = (1, 2) and (2, 2) + SP on 4 ranks, with routers drawn
large so that routing is uneven and some expert receives no token; at ep = 1 the grouped layer runs its forward
and backward on the meta device (any read of a value on the host would raise: no host synchronization), which
the loop cannot. Bad input: offsets that are not int32, an unknown GEMM choice."""
import pytest
import torch

import tpzoo
from tpzoo.models import (AttentionConfig, Context, Inputs, MLPConfig, ModelConfig, ModelLayout, MoEConfig,
                          Transformer)
from tpzoo.models.kinds.experts import GroupedLinear, expert_mlp, grouped_mm_reference
from tpzoo.parallel import grad_of
from tpzoo.testing import run_on_ranks

CFG = ModelConfig(family="mixtral", vocab_size=64, hidden_size=32, num_layers=2,
                  attention=AttentionConfig(num_heads=4, num_kv_heads=2), mlp=MLPConfig(32),
                  moe=MoEConfig(num_experts=8, num_experts_per_tok=2, norm_topk_prob=True, router_aux_loss_coef=0.05,
                                output_router_logits=True))
SIZES = [3, 0, 5, 1, 0, 7]  # rows per group: uneven, two empty groups


def _groups(sizes):
    return torch.cumsum(torch.tensor(sizes), 0).to(torch.int32)


def test_grouped_mm_reference_is_per_group_matmuls():
    g = torch.Generator().manual_seed(0)
    t, k, n = sum(SIZES), 8, 4
    offs = _groups(SIZES)
    a, b3 = torch.randn(t, k, generator=g), torch.randn(len(SIZES), k, n, generator=g)
    bounds = list(zip([0, *offs.tolist()[:-1]], offs.tolist()))
    want = torch.cat([a[s:e] @ b3[i] for i, (s, e) in enumerate(bounds)])
    torch.testing.assert_close(grouped_mm_reference(a, b3, offs), want, rtol=1e-6, atol=1e-6)
    a2, b2 = torch.randn(k, t, generator=g), torch.randn(t, n, generator=g)
    want = torch.stack([a2[:, s:e] @ b2[s:e] for s, e in bounds])  # an empty group: zeros
    got = grouped_mm_reference(a2, b2, offs)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    assert not got[1].any() and not got[4].any()
    with pytest.raises(ValueError, match="int32"):
        grouped_mm_reference(a, b3, offs.long())


def test_grouped_linear_gradients_equal_the_loop():
    g = torch.Generator().manual_seed(1)
    t, k, n = sum(SIZES), 8, 4
    x = torch.randn(t, k, generator=g, requires_grad=True)
    w = torch.randn(len(SIZES), n, k, generator=g, requires_grad=True)
    dy = torch.randn(t, n, generator=g)
    GroupedLinear.apply(x, w, _groups(SIZES)).backward(dy)
    x2, w2 = x.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
    out, start = [], 0
    for i, rows in enumerate(SIZES):
        out.append(x2[start:start + rows] @ w2[i].t())
        start += rows
    torch.cat(out).backward(dy)
    torch.testing.assert_close(x.grad, x2.grad, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(w.grad, w2.grad, rtol=1e-6, atol=1e-6)
    assert not w.grad[1].any() and not w.grad[4].any()


def _loss_and_grads(model, ids, labels, gemm: str):
    for layer in model.layers.values():
        if hasattr(layer.mlp, "router"):
            layer.mlp.expert_gemm = gemm
    model.zero_grad(set_to_none=True)
    per_token = model(Inputs(ids, labels=labels))
    per_token.sum().backward()
    empty = max(int((mlp.last_stats["counts"] == 0).sum()) for mlp in _moe(model))
    return per_token.detach(), {n: grad_of(p).clone() for n, p in model.named_parameters()}, empty


def _moe(model) -> list:
    """The model's mixture-of-experts channel mixers, in layer order."""
    return [layer.mlp for layer in model.layers.values() if layer.mlp.kind == "moe"]


def _uneven(model):
    g = torch.Generator(device=model.device).manual_seed(5)  # the same routers on every rank and run
    with torch.no_grad():
        for mlp in _moe(model):
            mlp.router.weight.normal_(std=4.0, generator=g)  # confident, uneven routing
    return model


def _batch(seed=4):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, CFG.vocab_size, (2, 4), generator=g)  # 16 assignments over 8 experts
    return ids, torch.roll(ids, -1, 1)


def _assert_same(a, b):
    loss_a, grads_a, _ = a
    loss_b, grads_b, _ = b
    torch.testing.assert_close(loss_a, loss_b, rtol=1e-5, atol=1e-6)
    for name in grads_a:
        scale = grads_a[name].abs().max().clamp_min(1e-12)
        torch.testing.assert_close(grads_a[name] / scale, grads_b[name] / scale, rtol=1e-5, atol=1e-5,
                                   msg=lambda m: f"{name}: {m}")


@pytest.mark.parametrize("activation", ["swiglu", "geglu_tanh"])
def test_grouped_experts_equal_the_loop_in_one_process(activation):
    model = _uneven(Transformer(CFG.replace(activation=activation), seed=3))
    ids, labels = _batch()
    loop = _loss_and_grads(model, ids, labels, "loop")
    grouped = _loss_and_grads(model, ids, labels, "grouped")
    _assert_same(grouped, loop)
    assert loop[2] > 0  # some expert of some layer received no token


def _compare_layouts(layouts):
    out = []
    for layout in layouts:
        dims = tpzoo.init_parallel(tp=layout["tp"], ep=layout["ep"])
        try:
            model = _uneven(Transformer(CFG, ModelLayout(dims, sequence_parallel=layout.get("sp", False)), seed=3))
            ids, labels = _batch(seed=10 + dims.dp_rank)  # each data-parallel rank its own tokens
            loop = _loss_and_grads(model, ids, labels, "loop")
            grouped = _loss_and_grads(model, ids, labels, "grouped")
            _assert_same(grouped, loop)
            out.append(loop[2])
        finally:
            tpzoo.destroy_parallel()
    return out


def test_grouped_experts_equal_the_loop_with_expert_parallelism():
    per_rank = run_on_ranks(4, _compare_layouts, [dict(tp=1, ep=2), dict(tp=2, ep=2, sp=True)])
    assert any(e > 0 for rank in per_rank for e in rank)  # some rank routed no token to some expert


def test_grouped_experts_need_no_host_sync_at_ep1():
    """On meta no value can reach the host: the grouped layer's forward and backward run there, the loop's not."""
    layer = Transformer(CFG, ModelLayout(device="meta")).layers["0"].mlp
    x = torch.randn(2, 8, CFG.hidden_size, device="meta", requires_grad=True)
    ctx = Context(length=8)
    layer.expert_gemm = "grouped"
    layer(x, ctx).sum().backward()
    assert layer.gate_up.grad.shape == layer.gate_up.shape and x.grad.device.type == "meta"
    layer.expert_gemm = "loop"
    with pytest.raises(NotImplementedError):
        layer(x, ctx)


def test_expert_gemm_choice_is_checked():
    rows, gate_up, down = torch.zeros(4, 8), torch.zeros(2, 16, 8), torch.zeros(2, 8, 8)
    with pytest.raises(ValueError, match="expert gemm 'cutlass'"):
        expert_mlp(rows, [2, 2], gate_up, down, "swiglu", "cutlass")
