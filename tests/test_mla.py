"""Multi-head latent attention (models/mla.py) against transformers' DeepseekV3Attention (eager), fp32, with YaRN
(mscale != mscale_all_dim: both the rotary's attention factor and the softmax scale's mscale^2 bite), interleaved
rotary, v_head_dim != qk_head_dim, q_lora_rank set (with attention biases) and null: the output, the input's
gradient and every parameter's gradient, in one process, with packed documents (block-diagonal mask, restarting
positions), and decoding token by token with the latent cache. On 2 gloo ranks: tp 2, tp 2 + SP, ring cp 2 (the
CPU flash block kernel with V padded to the key width; documents through the torch math) and Ulysses cp 2, each rank's rows and the gathered gradients against the same HF reference. The
comparison can fail: without the mscale in the softmax scale the output is off by far more than the tolerance."""
import functools
import math

import pytest
import torch
import torch.nn.functional as F

import tpzoo
from tpzoo.models.documents import Documents, document_positions
from tpzoo.models.mla import LatentAttention, MLAConfig
from tpzoo.models.rope import rope_tables, yarn_inv_freq
from tpzoo.parallel import finish_tp_grads, gather_tp_param, param_spec, shard
from tpzoo.parallel.ring_attention import local_positions
from tpzoo.testing import run_on_ranks

B, S = 2, 8
ROPE = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 4,
        "mscale": 1.0, "mscale_all_dim": 0.8, "beta_fast": 32, "beta_slow": 1}
HF = dict(hidden_size=32, num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=16, qk_nope_head_dim=8,
          qk_rope_head_dim=4, v_head_dim=6, max_position_embeddings=32, rope_parameters=ROPE, rope_interleave=True)
DOC_IDS = torch.tensor([[0, 0, 0, 1, 1, 1, 1, 1], [0, 0, 0, 0, 0, 1, 1, 2]])


@functools.lru_cache(maxsize=None)
def _hf(q_lora: bool, docs: bool = False):
    """(config dict, HF state, x, grad_out, {out, x_grad, param grads}) of a random DeepseekV3Attention."""
    import transformers as tf
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3Attention, DeepseekV3RotaryEmbedding

    hf = dict(HF, q_lora_rank=12 if q_lora else None, attention_bias=q_lora)
    cfg = tf.DeepseekV3Config(**hf)
    cfg._attn_implementation = "eager"
    torch.manual_seed(0)
    attn = DeepseekV3Attention(cfg, 0)
    with torch.no_grad():  # norms and biases off their defaults, so a mapping mistake cannot hide
        for name, p in attn.named_parameters():
            if "norm" in name or name.endswith("bias"):
                p.add_(torch.randn_like(p) * 0.2)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(B, S, 32, generator=g, requires_grad=True)
    grad_out = torch.randn(B, S, 32, generator=g)
    positions = document_positions(DOC_IDS) if docs else torch.arange(S).expand(B, S)
    cos, sin = DeepseekV3RotaryEmbedding(cfg)(x, positions)
    visible = torch.ones(S, S, dtype=torch.bool).tril().expand(B, 1, S, S)
    if docs:
        visible = visible & (DOC_IDS[:, None, :, None] == DOC_IDS[:, None, None, :])
    mask = torch.zeros(B, 1, S, S).masked_fill(~visible, torch.finfo(torch.float32).min)
    out, _ = attn(x, position_embeddings=(cos, sin), attention_mask=mask)
    out.backward(grad_out)
    want = {"out": out.detach(), "x": x.grad, **{n: p.grad for n, p in attn.named_parameters()}}
    state = {n: t.detach().clone() for n, t in attn.state_dict().items()}
    return hf, state, x.detach(), grad_out, want


def _tables(hf, positions):
    inv_freq, factor = yarn_inv_freq(hf["qk_rope_head_dim"], hf["rope_parameters"], hf["max_position_embeddings"])
    return rope_tables(inv_freq, positions, factor)


def _build(hf, state, dims, sp=False, **overrides):
    cfg = MLAConfig.from_hf(hf)
    model = LatentAttention(MLAConfig(**{**cfg.__dict__, **overrides}), dims, sequence_parallel=sp)
    assert sorted(n for n, _ in model.named_parameters()) == sorted(state)  # HF's names, one to one
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(shard(state[name], param_spec(p), dims.tp_rank, dims.tp))
    return model


def _assert_close(got, want, what):
    scale = want.abs().max().clamp_min(1e-12)
    torch.testing.assert_close(got / scale, want / scale, rtol=1e-5, atol=1e-5, msg=lambda m: f"{what}: {m}")


@pytest.mark.parametrize("q_lora,docs", [(True, False), (False, False), (True, True)])
def test_latent_attention_equals_transformers(q_lora, docs):
    hf, state, x, grad_out, want = _hf(q_lora, docs)
    dims = tpzoo.parallel.local_dims()
    model = _build(hf, state, dims)
    x = x.clone().requires_grad_()
    positions = document_positions(DOC_IDS) if docs else torch.arange(S)
    cos, sin = _tables(hf, positions)
    out = model(x, cos, sin, docs=Documents(DOC_IDS) if docs else None)
    out.backward(grad_out)
    _assert_close(out.detach(), want["out"], "out")
    _assert_close(x.grad, want["x"], "x grad")
    for name, p in model.named_parameters():
        _assert_close(p.grad, want[name], name)
    # the comparison can fail: the softmax scale without YaRN's mscale^2
    plain = _build(hf, state, dims, softmax_scale=(8 + 4) ** -0.5)
    assert ((plain(x, cos, sin, docs=Documents(DOC_IDS) if docs else None) - want["out"]).abs().max()
            > 1e-2 * want["out"].abs().max())


def test_latent_attention_decodes_with_the_latent_cache():
    hf, state, x, _, want = _hf(True)
    model = _build(hf, state, tpzoo.parallel.local_dims())
    cache = model.new_cache()
    with torch.no_grad():
        outs = [model(x[:, :5], *_tables(hf, torch.arange(5)), cache=cache)]
        for t in range(5, S):
            outs.append(model(x[:, t:t + 1], *_tables(hf, torch.tensor([t])), cache=cache))
    assert cache.length == S and cache.latent.shape == (B, S, 16) and cache.k_rope.shape == (B, S, 4)
    _assert_close(torch.cat(outs, dim=1), want["out"], "decoded")


LAYOUTS = [  # (tp, cp, sequence parallel, cp mode, q_lora_rank set, packed documents)
    (2, 1, False, None, True, False),
    (2, 1, True, None, False, False),
    (1, 2, False, "ring", False, False),  # fused block kernels: V zero-padded to the key width
    (1, 2, False, "ring", True, True),    # documents: the torch math with V as it is
    (1, 2, False, "a2a", True, False),
]


def _layout_worker(layout, hf, state, x, grad_out):
    tp, cp, sp, mode, _, docs = layout
    dims = tpzoo.init_parallel(tp=tp, cp=cp)
    try:
        model = _build(hf, state, dims, sp=sp)
        model.cp_mode = mode or "ring"
        positions = document_positions(DOC_IDS) if docs else torch.arange(S).expand(B, S)
        rows = torch.arange(S)
        if cp > 1:
            rows = local_positions(S // (2 * cp), cp, dims.cp_rank, "cpu")
        elif sp:
            rows = rows.view(tp, -1)[dims.tp_rank]
        table_rows = rows if cp > 1 else torch.arange(S)  # under SP attention sees the whole sequence
        cos, sin = _tables(hf, positions[:, table_rows])
        mine = x[:, rows].clone().requires_grad_()
        out = model(mine, cos, sin, docs=Documents(DOC_IDS) if docs else None)
        out.backward(grad_out[:, rows])
        finish_tp_grads(model, dims)
        grads = {n: gather_tp_param(p, grad=True, dims=dims) for n, p in model.named_parameters()}
        return {"rows": rows, "out": out.detach(), "x": mine.grad, "grads": grads}
    finally:
        tpzoo.destroy_parallel()


def _all_layouts(args):
    return [_layout_worker(layout, *a) for layout, a in zip(LAYOUTS, args)]


def test_latent_attention_layouts_equal_transformers():
    args = [_hf(layout[4], layout[5])[:4] for layout in LAYOUTS]
    per_rank = run_on_ranks(2, _all_layouts, args)
    for i, layout in enumerate(LAYOUTS):
        want = _hf(layout[4], layout[5])[4]
        cp = layout[1]
        for rank in per_rank:
            got = rank[i]
            _assert_close(got["out"], want["out"][:, got["rows"]], f"{layout} out")
            _assert_close(got["x"], want["x"][:, got["rows"]], f"{layout} x grad")
        for name in want:
            if name in ("out", "x"):
                continue
            # cp ranks each hold their rows' share of a weight's gradient (summed over dp x cp by the trainer)
            total = sum(rank[i]["grads"][name] for rank in per_rank) if cp > 1 else per_rank[0][i]["grads"][name]
            _assert_close(total, want[name], f"{layout} {name}")
        assert math.isfinite(float(per_rank[0][i]["out"].abs().sum()))
