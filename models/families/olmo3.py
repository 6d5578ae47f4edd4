"""OLMo 3: OLMo 2's block (norms after attention and the MLP only, q/k RMSNorm over the whole projection width:
models/families/olmo2.py) with sliding-window layers among full ones (HF `layer_types`, by default three sliding to one
full) and a rope per layer kind (HF `rope_parameters.{full_attention, sliding_attention}`: the full layers' base
and scaling (YaRN on OLMo-3-7B's, with its attention factor), the sliding layers' own base, tpzoo's `rope_local_theta`, with plain rope as transformers computes it).
"""
from __future__ import annotations

from ..config import AttentionConfig, MLPConfig, ModelConfig
from ..registry import Family, register_family
from .hf_common import (check, common_attention, common_fields, common_to_hf, decoder_tensor_map, read_layer_types,
                        read_rope, refuse, rope_to_hf)


NORMS = {"post_attn_norm": "post_attention_layernorm", "post_mlp_norm": "post_feedforward_layernorm"}


def _layer_types(hf: dict) -> list:
    n = hf["num_hidden_layers"]
    types = read_layer_types("olmo3", hf, n)
    if types is None:  # HF's default: every 4th layer is full attention, the others slide
        types = ["sliding_attention" if (i + 1) % 4 else "full_attention" for i in range(n)]
    return types


def _rope(hf: dict) -> tuple[float, dict | None, float]:
    """(full layers' theta, their scaling, sliding layers' theta). transformers-5 configs give one rope per layer
    kind; older ones one rope_theta (both kinds) and rope_scaling (the full layers only)."""
    params = hf.get("rope_parameters") or {}
    if "full_attention" not in params:
        theta, scaling = read_rope("olmo3", hf, default_theta=500000.0, yarn=True)
        return theta, scaling, theta
    theta, scaling = read_rope("olmo3", hf, params["full_attention"], "rope_parameters.full_attention",
                               default_theta=500000.0, yarn=True)  # OLMo-3-7B's full layers: YaRN
    local = params.get("sliding_attention") or {"rope_theta": theta}
    local_theta, local_scaling = read_rope("olmo3", hf, local, "rope_parameters.sliding_attention",
                                           default_theta=theta)
    if local_scaling is not None:  # the sliding layers' table is plain rope with its own base
        raise refuse("olmo3", "rope_parameters.sliding_attention.rope_type", local_scaling.get("rope_type"),
                     ["default"])
    return theta, scaling, local_theta


def config_from_hf(hf: dict) -> ModelConfig:
    check("olmo3", hf, "hidden_act", ("silu",), "silu")
    theta, scaling, local_theta = _rope(hf)
    bias = hf.get("attention_bias", False)
    fields = common_fields(hf)
    fields["norm_eps"] = hf.get("rms_norm_eps", 1e-5)
    attention = AttentionConfig(**common_attention(hf), rope_theta=theta, rope_scaling=scaling,
                                rope_local_theta=local_theta, qkv_bias=bias, out_bias=bias, qk_norm="full",
                                sliding_window=hf.get("sliding_window", 4096), layer_types=_layer_types(hf))
    return ModelConfig(family="olmo3", **fields, attention=attention,
                       mlp=MLPConfig(hf["intermediate_size"], activation="swiglu"), pre_norm=False, post_norm=True)


def config_to_hf(cfg: ModelConfig) -> dict:
    hf = common_to_hf(cfg, "olmo3", "Olmo3ForCausalLM")
    a = cfg.attention
    local = {"rope_type": "default", "rope_theta": a.rope_local_theta or a.rope_theta}
    hf.update(hidden_act="silu", attention_bias=a.qkv_bias, sliding_window=a.sliding_window,
              rope_parameters={"full_attention": rope_to_hf(cfg), "sliding_attention": local})
    return hf


def hf_tensor_map(cfg: ModelConfig) -> list:
    return decoder_tensor_map(cfg, NORMS)  # OLMo 2's: norms after the sublayers only


register_family(Family(name="olmo3", hf_model_types=("olmo3",), hf_architecture="Olmo3ForCausalLM",
                       config_from_hf=config_from_hf, config_to_hf=config_to_hf, hf_tensor_map=hf_tensor_map))
