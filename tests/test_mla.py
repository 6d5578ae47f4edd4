"""Multi-head latent attention (the "mla" token mixer, models/kinds/mla.py, built from the deepseek_v3 family's reading
of the HF config) against transformers' DeepseekV3Attention (eager), fp32, with YaRN
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
from tpzoo.models import Context, ModelLayout, Transformer, from_hf_config
from tpzoo.models.documents import Documents, document_positions
from tpzoo.models.kinds.rotary import attention_factor, cos_sin, inv_freq
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


def _config(hf):
    """The deepseek_v3 family's model config of one latent-attention layer with these HF settings."""
    return from_hf_config({**hf, "model_type": "deepseek_v3", "vocab_size": 16, "num_hidden_layers": 1,
                           "intermediate_size": 16, "moe_intermediate_size": 8, "n_routed_experts": 4,
                           "num_experts_per_tok": 2, "n_group": 1, "topk_group": 1, "first_k_dense_replace": 1})


class _Layer:
    """Our layer on HF's tensors: call(x, positions, docs=None, cache=None) builds the forward's Context the way the
    Transformer does (the rotary table of its spec, YaRN's attention factor included)."""

    def __init__(self, hf, state, dims, sp=False, cp_mode="ring"):
        self.attn = Transformer(_config(hf), ModelLayout(dims, sequence_parallel=sp, cp_mode=cp_mode)).layers["0"].attn
        assert sorted(n for n, _ in self.attn.named_parameters()) == sorted(state)  # HF's names, one to one
        with torch.no_grad():
            for name, p in self.attn.named_parameters():
                p.copy_(shard(state[name], param_spec(p), dims.tp_rank, dims.tp))

    def __call__(self, x, positions, docs=None, cache=None, past=0):
        spec = self.attn.rotary
        ctx = Context(positions.shape[-1], docs, past=past)
        ctx.rotary[spec] = cos_sin(inv_freq(spec), positions, attention_factor(spec))
        return self.attn(x, ctx, cache)

    def named_parameters(self):
        return self.attn.named_parameters()


def _assert_close(got, want, what):
    scale = want.abs().max().clamp_min(1e-12)
    torch.testing.assert_close(got / scale, want / scale, rtol=1e-5, atol=1e-5, msg=lambda m: f"{what}: {m}")


@pytest.mark.parametrize("q_lora,docs", [(True, False), (False, False), (True, True)])
def test_latent_attention_equals_transformers(q_lora, docs):
    hf, state, x, grad_out, want = _hf(q_lora, docs)
    dims = tpzoo.parallel.local_dims()
    model = _Layer(hf, state, dims)
    x = x.clone().requires_grad_()
    positions = document_positions(DOC_IDS) if docs else torch.arange(S)
    out = model(x, positions, docs=Documents(DOC_IDS) if docs else None)
    out.backward(grad_out)
    _assert_close(out.detach(), want["out"], "out")
    _assert_close(x.grad, want["x"], "x grad")
    for name, p in model.named_parameters():
        _assert_close(p.grad, want[name], name)
    # the comparison can fail: the softmax scale without YaRN's mscale^2
    model.attn.core.scale = (8 + 4) ** -0.5
    assert ((model(x, positions, docs=Documents(DOC_IDS) if docs else None) - want["out"]).abs().max()
            > 1e-2 * want["out"].abs().max())


def test_latent_attention_decodes_with_the_latent_cache():
    hf, state, x, _, want = _hf(True)
    model = _Layer(hf, state, tpzoo.parallel.local_dims())
    cache = model.attn.new_cache(B, S + 2)
    with torch.no_grad():
        outs = [model(x[:, :5], torch.arange(5), cache=cache)]
        for t in range(5, S):
            outs.append(model(x[:, t:t + 1], torch.tensor([t]), cache=cache, past=t))
    assert cache.length == S and cache.latent.shape == (B, S + 2, 16) and cache.k_rope.shape == (B, S + 2, 4)
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
        model = _Layer(hf, state, dims, sp=sp, cp_mode=mode or "ring")
        positions = document_positions(DOC_IDS) if docs else torch.arange(S).expand(B, S)
        rows = torch.arange(S)
        if cp > 1:
            rows = local_positions(S // (2 * cp), cp, dims.cp_rank, "cpu")
        elif sp:
            rows = rows.view(tp, -1)[dims.tp_rank]
        table_rows = rows if cp > 1 else torch.arange(S)  # under SP attention sees the whole sequence
        mine = x[:, rows].clone().requires_grad_()
        out = model(mine, positions[:, table_rows], docs=Documents(DOC_IDS) if docs else None)
        out.backward(grad_out[:, rows])
        finish_tp_grads(model.attn, dims)
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
