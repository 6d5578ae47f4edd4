"""The 2025 rotary variants (models/rope.py) against transformers: YaRN's inverse frequencies and attention factor
equal `_compute_yarn_parameters`' (gpt-oss's defaults: factor 32, truncate off; a DeepSeek-style config with
mscale / mscale_all_dim, truncated, and one without a factor, read from the context lengths); the cos/sin tables
equal the rotary modules' (attention factor applied); DeepSeek's softmax scale equals DeepseekV3Attention.scaling;
the interleaved rotary equals apply_rotary_pos_emb_interleave bit for bit. The comparisons can fail: the plain
half-split rotary of the same input, and a scale without the mscale, differ."""
import pytest
import torch

from tpzoo import kernels
from tpzoo.models.rope import apply_rotary_interleaved, mla_softmax_scale, rope_tables, yarn_inv_freq

DEEPSEEK_ROPE = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 8,
                 "mscale": 1.0, "mscale_all_dim": 0.8, "beta_fast": 32, "beta_slow": 1}


def _configs():
    import transformers as tf

    gpt_oss = tf.GptOssConfig(hidden_size=64, num_attention_heads=4, head_dim=16, max_position_embeddings=256)
    deepseek = tf.DeepseekV3Config(hidden_size=64, num_attention_heads=4, num_key_value_heads=4, qk_rope_head_dim=8,
                                   qk_nope_head_dim=16, max_position_embeddings=32, rope_parameters=DEEPSEEK_ROPE)
    no_factor = tf.DeepseekV3Config(hidden_size=64, num_attention_heads=4, num_key_value_heads=4,
                                    qk_rope_head_dim=8, max_position_embeddings=32,
                                    rope_parameters={**DEEPSEEK_ROPE, "factor": None})
    return {"gpt_oss": (gpt_oss, 16), "deepseek": (deepseek, 8), "no_factor": (no_factor, 8)}


@pytest.mark.parametrize("name", ["gpt_oss", "deepseek", "no_factor"])
def test_yarn_equals_transformers(name):
    from transformers.modeling_rope_utils import _compute_yarn_parameters

    cfg, dim = _configs()[name]
    want_freq, want_factor = _compute_yarn_parameters(cfg)
    got_freq, got_factor = yarn_inv_freq(dim, dict(cfg.rope_parameters), cfg.max_position_embeddings)
    assert torch.equal(got_freq, want_freq) and got_factor == pytest.approx(want_factor, rel=1e-12)
    assert got_factor != 1.0 or name != "gpt_oss"
    if name == "gpt_oss":
        from transformers.models.gpt_oss.modeling_gpt_oss import GptOssRotaryEmbedding as Rotary
    else:
        from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3RotaryEmbedding as Rotary
    positions = torch.tensor([[0, 3, 7, 30], [1, 2, 5, 9]])
    hf_cos, hf_sin = Rotary(cfg)(torch.zeros(1, dtype=torch.float32), positions)
    cos, sin = rope_tables(got_freq, positions, got_factor)
    torch.testing.assert_close(cos, hf_cos[..., : dim // 2], rtol=0, atol=1e-6)
    torch.testing.assert_close(sin, hf_sin[..., : dim // 2], rtol=0, atol=1e-6)


def test_deepseek_softmax_scale_and_interleaved_rotary():
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import (DeepseekV3Attention,
                                                                      apply_rotary_pos_emb_interleave)

    cfg = _configs()["deepseek"][0]
    attn = DeepseekV3Attention(cfg, 0)
    assert mla_softmax_scale(24, DEEPSEEK_ROPE) == pytest.approx(attn.scaling, rel=1e-12)
    assert abs(24 ** -0.5 - attn.scaling) > 1e-2 * attn.scaling  # the mscale matters here
    assert mla_softmax_scale(24, {"rope_type": "default", "rope_theta": 1e4}) == 24 ** -0.5
    g = torch.Generator().manual_seed(0)
    q, k = torch.randn(2, 3, 5, 8, generator=g), torch.randn(2, 1, 5, 8, generator=g)  # [b, heads, s, rope]
    freqs = torch.randn(2, 5, 4, generator=g)
    cos, sin = freqs.cos(), freqs.sin()
    want_q, want_k = apply_rotary_pos_emb_interleave(q, k, torch.cat([cos, cos], -1), torch.cat([sin, sin], -1))
    got_q, got_k = (apply_rotary_interleaved(t.transpose(1, 2), cos, sin).transpose(1, 2) for t in (q, k))
    assert torch.equal(got_q, want_q) and torch.equal(got_k, want_k)
    assert (kernels.apply_rotary(q.transpose(1, 2), cos, sin).transpose(1, 2) - want_q).abs().max() > 1e-2
