"""Qwen3 (dense): Llama-shaped with per-head RMSNorm on q and k before the rotary, head_dim independent of
hidden / heads, no q/k/v bias, a tied head on the small models. Sliding-window layers (`use_sliding_window`,
off in every published config) are read from `layer_types`."""
from __future__ import annotations

from ..config import AttentionConfig, MLPConfig, ModelConfig
from ..registry import Family, register_family
from .hf_common import (check, common_attention, common_fields, common_to_hf, decoder_tensor_map, read_layer_types,
                        read_rope, rope_to_hf)


def config_from_hf(hf: dict) -> ModelConfig:
    check("qwen3", hf, "hidden_act", ("silu",), "silu")
    theta, scaling = read_rope("qwen3", hf)
    layers = hf["num_hidden_layers"]
    types = read_layer_types("qwen3", hf, layers)
    window = hf.get("sliding_window") if hf.get("use_sliding_window") else None
    if window is not None and types is None:  # HF's default: layers from max_window_layers on slide
        types = ["sliding_attention" if i >= hf.get("max_window_layers", 28) else "full_attention"
                 for i in range(layers)]
    bias = hf.get("attention_bias", False)
    return ModelConfig(family="qwen3", **common_fields(hf),
                       attention=AttentionConfig(**common_attention(hf), rope_theta=theta, rope_scaling=scaling,
                                                 qkv_bias=bias, out_bias=bias, qk_norm="head", sliding_window=window,
                                                 layer_types=types if window else None),
                       mlp=MLPConfig(hf["intermediate_size"], activation="swiglu"))


def config_to_hf(cfg: ModelConfig) -> dict:
    hf = common_to_hf(cfg, "qwen3", "Qwen3ForCausalLM")
    hf.update(hidden_act="silu", attention_bias=cfg.attention.qkv_bias, rope_parameters=rope_to_hf(cfg))
    if cfg.attention.sliding_window is not None:
        hf.update(use_sliding_window=True, sliding_window=cfg.attention.sliding_window)
    return hf


def hf_tensor_map(cfg: ModelConfig) -> list:
    return decoder_tensor_map(cfg)


register_family(Family(name="qwen3", hf_model_types=("qwen3",), hf_architecture="Qwen3ForCausalLM",
                       config_from_hf=config_from_hf, config_to_hf=config_to_hf, hf_tensor_map=hf_tensor_map))
