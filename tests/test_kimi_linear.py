"""Kimi Linear's family file (models/families/kimi_linear.py) beside its parity runs (tests/test_models_hybrid.py:
conversion, eval at every layout, generation, training, packing; tests/test_kimi_delta.py: the KDA layer):
- the hub's config.json spelling (linear_attn_config's 1-based layer lists, model_max_length, num_experts_per_token,
  ...) and transformers' (layer_types, linear_num_heads, ...) read into the same kinds, and each is written back
  as it was read;
- what the family cannot run is refused in one line naming the field;
- the named configs count what they build, and kimi-linear-48b-a3b's count is the published 48B / 3B."""
import copy

import pytest

from tpzoo.errors import ConfigError
from tpzoo.models import ModelLayout, Transformer, get_config
from tpzoo.models.families import kimi_linear as family

# the hub's config.json of moonshotai/Kimi-Linear-48B-A3B-Instruct, cut to 6 layers (its field names and values)
HUB = {"architectures": ["KimiLinearForCausalLM"], "model_type": "kimi_linear", "vocab_size": 163840,
       "hidden_size": 2304, "intermediate_size": 9216, "num_hidden_layers": 6, "num_attention_heads": 32,
       "num_key_value_heads": 32, "head_dim": 72, "kv_lora_rank": 512, "q_lora_rank": None, "qk_nope_head_dim": 128,
       "qk_rope_head_dim": 64, "v_head_dim": 128, "mla_use_nope": True, "hidden_act": "silu", "rms_norm_eps": 1e-5,
       "rope_theta": 10000.0, "tie_word_embeddings": False, "model_max_length": 1048576, "num_experts": 256,
       "num_experts_per_token": 8, "num_shared_experts": 1, "moe_intermediate_size": 1024, "moe_renormalize": True,
       "moe_router_activation_func": "sigmoid", "moe_layer_freq": 1, "num_expert_group": 1, "topk_group": 1,
       "routed_scaling_factor": 2.446, "first_k_dense_replace": 1, "use_cache": True, "bos_token_id": 163584,
       "eos_token_id": 163586, "pad_token_id": 163839, "initializer_range": 0.02, "torch_dtype": "bfloat16",
       "linear_attn_config": {"full_attn_layers": [4], "kda_layers": [1, 2, 3, 5, 6], "num_heads": 32,
                              "head_dim": 128, "short_conv_kernel_size": 4}}


def test_the_hub_and_transformers_spellings_read_the_same_and_write_back():
    import transformers

    ours = family.config_from_hf(HUB)
    assert ours.token_mixers == ["kimi_delta"] * 3 + ["mla"] + ["kimi_delta"] * 2
    assert ours.channel_mixers == ["mlp"] + ["moe"] * 5
    g = ours.kimi_delta
    assert (g.num_heads, g.head_dim, g.conv_kernel) == (32, 128, 4)
    assert (ours.moe.num_experts, ours.moe.num_experts_per_tok, ours.moe.shared_expert_ffn) == (256, 8, 1024)
    assert ours.max_position_embeddings == 1048576 and ours.position == "none"
    # transformers reads the hub's file into its own attribute names; save_pretrained writes those
    theirs = transformers.KimiLinearConfig(**copy.deepcopy(HUB)).to_dict()
    read = family.config_from_hf(theirs)
    for field in ("token_mixers", "channel_mixers", "kimi_delta", "mla", "moe", "mlp", "attention",
                  "max_position_embeddings", "hidden_size", "num_layers", "vocab_size"):
        assert getattr(read, field) == getattr(ours, field), field
    for hf in (HUB, theirs):  # each spelling written back as it came
        cfg = family.config_from_hf(hf).replace(extra={"hf_config": hf})
        back = family.config_to_hf(cfg)
        assert {k: back[k] for k in back if k in hf} == {k: hf[k] for k in back if k in hf}
        assert "linear_attn_config" in back if hf is HUB else "layer_types" in back


@pytest.mark.parametrize("change,says", [
    ({"moe_router_activation_func": "softmax"}, "moe_router_activation_func"),
    ({"mla_use_nope": False}, "mla_use_nope"),
    ({"hidden_act": "gelu"}, "hidden_act"),
    ({"linear_attn_config": {**HUB["linear_attn_config"], "gate_lower_bound": -5.0}}, "gate_lower_bound"),
    ({"linear_attn_config": {**HUB["linear_attn_config"], "kda_layers": [1, 2, 3, 5]}}, "linear_attn_config"),
])
def test_what_the_family_cannot_run_is_one_line(change, says):
    with pytest.raises(ConfigError, match=says) as e:
        family.config_from_hf({**HUB, **change})
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("name", ["kimi-linear-48b-a3b", "nano-kimi-linear"])
def test_named_configs_count_what_they_build(name):
    """ModelConfig.num_parameters (each kind's own count) equals the built model's (a 5-layer cut with both token
    mixers and both channel mixers, on meta); kimi-linear-48b-a3b: the model card's 48B total and 3B activated (the
    hub's name counts without the two 163840 x 2304 embedding tables: 48.37B of 49.12B; activated 3.48B with them)."""
    cfg = get_config(name)
    n = min(cfg.num_layers, 5)
    cut = cfg.replace(num_layers=n, token_mixers=["kimi_delta", "kimi_delta", "kimi_delta", "mla", "kimi_delta"][:n],
                      channel_mixers=["mlp"] + ["moe"] * (n - 1))
    built = Transformer(cut, ModelLayout(device="meta"))
    assert sum(p.numel() for p in built.parameters()) == cut.num_parameters()
    if name == "kimi-linear-48b-a3b":
        embeddings = 2 * cfg.vocab_size * cfg.hidden_size
        assert round((cfg.num_parameters() - embeddings) / 1e9) == 48
        assert round(cfg.num_parameters(active=True) / 1e9) == 3
