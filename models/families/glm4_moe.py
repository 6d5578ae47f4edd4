"""GLM-4.5 / GLM-4.5-Air (`Glm4MoeForCausalLM`): DeepSeekMoE (models/families/hf_common.py: the first
`first_k_dense_replace` layers dense, then the sigmoid router with its selection bias, group-limited routing,
routed_scaling_factor and shared experts) under ordinary grouped-query attention with partial rotary
(`partial_rotary_factor`, rotate-half on the first part of each head), optional per-head q/k norms (`use_qk_norm`)
and, with `attention_bias`, biases on q, k and v (not on o_proj). Its multi-token-prediction layers are not
imported (one line says so)."""
from __future__ import annotations

from ..config import AttentionConfig, ModelConfig
from ..registry import Family, register_family
from .hf_common import (common_attention, common_fields, common_to_hf, decoder_tensor_map, deepseek_moe,
                        deepseek_moe_to_hf, mtp_notes, read_rope, rope_to_hf)


def config_from_hf(hf: dict) -> ModelConfig:
    params = dict(hf.get("rope_parameters") or {**(hf.get("rope_scaling") or {}),
                                                "rope_theta": hf.get("rope_theta", 10000.0)})
    partial = float(params.pop("partial_rotary_factor", hf.get("partial_rotary_factor", 0.5)))
    theta, scaling = read_rope("glm4_moe", hf, params)
    return ModelConfig(
        family="glm4_moe", **common_fields(hf),
        attention=AttentionConfig(**common_attention(hf), qkv_bias=bool(hf.get("attention_bias", False)),
                                  qk_norm="head" if hf.get("use_qk_norm") else "none", rope_theta=theta,
                                  rope_scaling=scaling, partial_rotary_factor=partial),
        **deepseek_moe("glm4_moe", hf))


def config_to_hf(cfg: ModelConfig) -> dict:
    hf = common_to_hf(cfg, "glm4_moe", "Glm4MoeForCausalLM")
    a = cfg.attention
    hf.update(deepseek_moe_to_hf(cfg))
    hf.update(attention_bias=a.qkv_bias, use_qk_norm=a.qk_norm == "head", head_dim=a.head_dim,
              rope_parameters={**rope_to_hf(cfg), "partial_rotary_factor": a.partial_rotary_factor})
    return hf


register_family(Family(name="glm4_moe", hf_model_types=("glm4_moe",), hf_architecture="Glm4MoeForCausalLM",
                       config_from_hf=config_from_hf, config_to_hf=config_to_hf,
                       hf_tensor_map=lambda cfg: decoder_tensor_map(cfg, styles={"moe": "deepseek"}),
                       import_notes=lambda hf: mtp_notes("glm4_moe", hf)))
