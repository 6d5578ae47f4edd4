"""OLMo 2: Llama-shaped, but the norms come after attention and the MLP (the sublayer's output is normalized
before the residual add; no pre-norm), and q and k are RMS-normalized over the whole projection width (all heads
at once): under tensor parallelism that width spans the ranks, so the norm's sum of squares is all-reduced over
the TP group (models/kinds/attention_extras.py: one all-reduce of 2 fp32 per token per layer, forward and backward)."""
from __future__ import annotations

from ..config import AttentionConfig, MLPConfig, ModelConfig
from ..registry import Family, register_family
from .hf_common import check, common_attention, common_fields, common_to_hf, decoder_tensor_map, read_rope, rope_to_hf


NORMS = {"post_attn_norm": "post_attention_layernorm", "post_mlp_norm": "post_feedforward_layernorm"}


def config_from_hf(hf: dict) -> ModelConfig:
    check("olmo2", hf, "hidden_act", ("silu",), "silu")
    theta, scaling = read_rope("olmo2", hf)
    bias = hf.get("attention_bias", False)
    fields = common_fields(hf)
    fields["norm_eps"] = hf.get("rms_norm_eps", 1e-5)
    return ModelConfig(family="olmo2", **fields,
                       attention=AttentionConfig(**common_attention(hf), rope_theta=theta, rope_scaling=scaling,
                                                 qkv_bias=bias, out_bias=bias, qk_norm="full"),
                       mlp=MLPConfig(hf["intermediate_size"], activation="swiglu"), pre_norm=False, post_norm=True)


def config_to_hf(cfg: ModelConfig) -> dict:
    hf = common_to_hf(cfg, "olmo2", "Olmo2ForCausalLM")
    hf.update(hidden_act="silu", attention_bias=cfg.attention.qkv_bias, rope_parameters=rope_to_hf(cfg))
    return hf


def hf_tensor_map(cfg: ModelConfig) -> list:
    return decoder_tensor_map(cfg, NORMS)


register_family(Family(name="olmo2", hf_model_types=("olmo2",), hf_architecture="Olmo2ForCausalLM",
                       config_from_hf=config_from_hf, config_to_hf=config_to_hf, hf_tensor_map=hf_tensor_map))
