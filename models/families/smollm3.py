"""SmolLM3: Llama-shaped (GQA, SwiGLU, tied head) with no rotary on every 4th layer ("NoPE" layers: HF
`no_rope_layers`, 1 = the layer applies rope), tpzoo's per-layer `rope_layers` switch."""
from __future__ import annotations

from tpzoo.errors import ConfigError

from ..config import AttentionConfig, MLPConfig, ModelConfig
from ..registry import Family, register_family
from .hf_common import (check, common_attention, common_fields, common_to_hf, decoder_tensor_map, read_layer_types,
                        read_rope, rope_to_hf)


def config_from_hf(hf: dict) -> ModelConfig:
    check("smollm3", hf, "hidden_act", ("silu",), "silu")
    check("smollm3", hf, "mlp_bias", (False,), False)
    theta, scaling = read_rope("smollm3", hf)
    layers = hf["num_hidden_layers"]
    rope_layers = hf.get("no_rope_layers")
    if rope_layers is None:  # HF's default: every `no_rope_layer_interval`-th layer has no rope
        every = hf.get("no_rope_layer_interval", 4)
        rope_layers = [int((i + 1) % every != 0) for i in range(layers)]
    if len(rope_layers) != layers or not set(rope_layers) <= {0, 1}:
        raise ConfigError(f"smollm3: HF config field no_rope_layers={rope_layers!r} needs one 0/1 per layer")
    types = read_layer_types("smollm3", hf, layers)
    window = hf.get("sliding_window") if hf.get("use_sliding_window") else None
    bias = hf.get("attention_bias", False)
    return ModelConfig(family="smollm3", **common_fields(hf),
                       attention=AttentionConfig(**common_attention(hf), rope_theta=theta, rope_scaling=scaling,
                                                 qkv_bias=bias, out_bias=bias, rope_layers=list(rope_layers),
                                                 sliding_window=window, layer_types=types if window else None),
                       mlp=MLPConfig(hf["intermediate_size"], activation="swiglu"))


def config_to_hf(cfg: ModelConfig) -> dict:
    hf = common_to_hf(cfg, "smollm3", "SmolLM3ForCausalLM")
    a = cfg.attention
    hf.update(hidden_act="silu", attention_bias=a.qkv_bias, rope_parameters=rope_to_hf(cfg),
              no_rope_layers=list(a.rope_layers) if a.rope_layers is not None else [1] * cfg.num_layers)
    if a.sliding_window is not None:
        hf.update(use_sliding_window=True, sliding_window=a.sliding_window)
    return hf


def hf_tensor_map(cfg: ModelConfig) -> list:
    return decoder_tensor_map(cfg)


register_family(Family(name="smollm3", hf_model_types=("smollm3",), hf_architecture="SmolLM3ForCausalLM",
                       config_from_hf=config_from_hf, config_to_hf=config_to_hf, hf_tensor_map=hf_tensor_map))
