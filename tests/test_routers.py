"""The 2025 router kinds (models/kinds/routers.py) against transformers' own router modules, fp32, random ties-free
inputs: DeepSeek-V3's and GLM-4.5's sigmoid router with a non-zero selection bias and group-limited routing
(n_group 4, topk_group 2), with and without norm_topk_prob, chooses the same experts with the same weights (times
routed_scaling_factor); gpt-oss's biased top-k softmax router likewise. The comparisons can fail: without the
selection bias, or without the group limit, the chosen experts differ; the bias never weights (the weights are
the unbiased scores). The load count equals a bincount (token mask honoured); the bias update moves each expert
by rate * sign(mean - load) (worked example) and rate 0 freezes it; seq_aux_loss equals the DeepSeek-V3 paper's
per-sequence formula written out (and Megatron's normalized sigmoid scores), its gradient too."""
import pytest
import torch

import tpzoo
from tpzoo.models import AttentionConfig, MLPConfig, ModelConfig, ModelLayout, MoEConfig
from tpzoo.models.kinds.routers import (expert_load, make_router, seq_aux_loss, sigmoid_group_topk,
                                        updated_expert_bias)

E, K, H, T = 16, 4, 24, 40


def _router(kind: str, **moe):
    """A router module of `kind` as the mixture-of-experts layer builds it (moe.router), materialized on the CPU."""
    cfg = ModelConfig(family="mixtral", vocab_size=8, hidden_size=H, num_layers=1, attention=AttentionConfig(4),
                      mlp=MLPConfig(8), moe=MoEConfig(num_experts=E, num_experts_per_tok=K, router=kind, **moe))
    router = make_router(cfg, ModelLayout(tpzoo.parallel.local_dims())).to_empty(device="cpu")
    router.reset_parameters()
    return router


def _sorted(weights, index):
    order = index.argsort(dim=-1)
    return weights.gather(1, order), index.gather(1, order)


def _hf_router(kind: str, norm: bool):
    import transformers as tf

    common = dict(hidden_size=H, n_routed_experts=E, num_experts_per_tok=K, n_group=4, topk_group=2,
                  routed_scaling_factor=2.5, norm_topk_prob=norm, num_attention_heads=4, num_key_value_heads=4)
    if kind == "deepseek_v3":
        from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter as Router
        cfg = tf.DeepseekV3Config(**common)
    else:
        from transformers.models.glm4_moe.modeling_glm4_moe import Glm4MoeTopkRouter as Router
        cfg = tf.Glm4MoeConfig(**common)
    torch.manual_seed(0)
    router = Router(cfg)
    with torch.no_grad():
        router.weight.normal_(std=0.5)
        router.e_score_correction_bias.normal_(std=0.3)  # large enough to change choices
    return router


@pytest.mark.parametrize("kind,norm", [("deepseek_v3", True), ("glm4_moe", True), ("deepseek_v3", False)])
def test_sigmoid_group_router_equals_transformers(kind, norm):
    hf = _hf_router(kind, norm)
    x = torch.randn(T, H, generator=torch.Generator().manual_seed(1))
    _, want_w, want_i = hf(x)
    ours = _router("sigmoid", n_group=4, topk_group=2, norm_topk_prob=norm, routed_scaling_factor=2.5)
    ours.load_state_dict(hf.state_dict())
    logits, weights, index, _ = ours(x)
    got_w, got_i = _sorted(weights, index)
    want_w, want_i = _sorted(want_w, want_i)
    assert torch.equal(got_i, want_i)
    torch.testing.assert_close(got_w, want_w, rtol=1e-6, atol=1e-7)
    # The groups bind: every token's experts lie in at most topk_group = 2 of the 4 groups.
    assert (torch.stack([(index // 4 == g).any(-1) for g in range(4)]).sum(0) <= 2).all()
    # The comparison can fail: without the selection bias, or without the group limit, other experts are chosen.
    bias = hf.e_score_correction_bias
    _, no_bias = sigmoid_group_topk(logits, None, K, 4, 2, norm, 2.5)
    _, no_groups = sigmoid_group_topk(logits, bias, K, 1, 1, norm, 2.5)
    for wrong in (no_bias, no_groups):
        assert (wrong.sort(-1).values != want_i).any(-1).sum() >= 3
    # The bias chooses but does not weight: the weights are the unbiased sigmoid scores of the chosen experts.
    scores = logits.sigmoid().gather(1, index)
    expected = scores / scores.sum(-1, keepdim=True) if norm else scores
    torch.testing.assert_close(weights, expected * 2.5, rtol=1e-6, atol=1e-7)


def test_gpt_oss_router_equals_transformers():
    import transformers as tf
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssTopKRouter

    hf = GptOssTopKRouter(tf.GptOssConfig(hidden_size=H, num_local_experts=E, num_experts_per_tok=K))
    with torch.no_grad():
        hf.weight.normal_(std=0.5)
        hf.bias.normal_(std=1.0)
    x = torch.randn(T, H, generator=torch.Generator().manual_seed(2))
    want_logits, want_w, want_i = hf(x)
    ours = _router("topk_softmax", router_bias=True)
    ours.load_state_dict(hf.state_dict())
    logits, weights, index, _ = ours(x)
    torch.testing.assert_close(logits, want_logits)
    assert torch.equal(index, want_i)
    torch.testing.assert_close(weights, want_w, rtol=1e-6, atol=1e-7)
    with torch.no_grad():  # the router's bias matters: without it the choices differ
        ours.bias.zero_()
    assert (ours(x)[2] != want_i).any(-1).sum() >= 3


def test_expert_load_and_bias_update():
    index = torch.tensor([[0, 2], [2, 3], [0, 2], [1, 3]])
    assert expert_load(index, 5).tolist() == torch.bincount(index.flatten(), minlength=5).float().tolist()
    mask = torch.tensor([1, 1, 0, 1])
    assert expert_load(index, 5, mask).tolist() == [1.0, 1.0, 2.0, 2.0, 0.0]
    # loads 3, 1, 2, 2 (mean 2): the busy expert down, the idle one up, the ones at the mean kept
    bias = torch.tensor([0.5, 0.5, -0.25, 0.0])
    new = updated_expert_bias(bias, torch.tensor([3.0, 1.0, 2.0, 2.0]), 1e-3)
    assert new.dtype == torch.float32
    torch.testing.assert_close(new, torch.tensor([0.5 - 1e-3, 0.5 + 1e-3, -0.25, 0.0]), rtol=0, atol=1e-7)
    assert torch.equal(updated_expert_bias(bias, torch.tensor([3.0, 1.0, 2.0, 2.0]), 0.0), bias)


def _paper_seq_aux_loss(logits, b, k, coeff, mask=None):
    """DeepSeek-V3 (eq. 17-20) per sequence: alpha * sum_i f_i P_i, f_i = E / (k T) * #{t: i in top-k(s'_t)},
    P_i = 1/T sum_t s'_i,t, s' the sigmoid scores normalized over the experts; the mean over sequences (T: the
    counted tokens per sequence on average, as Megatron's padding mask)."""
    e = logits.shape[-1]
    rows = logits.view(b, -1, e)
    m = torch.ones(rows.shape[:2]) if mask is None else mask.view(b, -1).float()
    t_mean = m.sum() / b
    total = 0.0
    for seq in range(b):
        s = rows[seq].sigmoid()
        s = s / s.sum(-1, keepdim=True)
        chosen = torch.zeros_like(s).scatter_(1, s.topk(k, -1).indices, 1.0) * m[seq, :, None]
        f = e / (k * t_mean) * chosen.sum(0)
        p = (s * m[seq, :, None]).sum(0) / t_mean
        total = total + coeff * (f * p).sum()
    return total / b


@pytest.mark.parametrize("masked", [False, True])
def test_seq_aux_loss_equals_the_paper_formula(masked):
    g = torch.Generator().manual_seed(3)
    b, s = 3, 10
    logits = torch.randn(b * s, E, generator=g, requires_grad=True)
    mask = (torch.rand(b * s, generator=g) > 0.3) if masked else None
    got = seq_aux_loss(logits, K, 0.01, b, token_mask=mask)
    (g1,) = torch.autograd.grad(got, logits)
    ref_logits = logits.detach().clone().requires_grad_()
    want = _paper_seq_aux_loss(ref_logits, b, K, 0.01, mask)
    (g2,) = torch.autograd.grad(want, ref_logits)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-9)
    torch.testing.assert_close(g1, g2, rtol=1e-5, atol=1e-9)
    # per sequence, not per batch: the batch-level loss (one sequence of b * s tokens) differs
    assert abs(seq_aux_loss(logits, K, 0.01, 1, token_mask=mask).item() - got.item()) > 1e-4 * got.item()
