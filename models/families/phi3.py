"""Phi-3 / Phi-4 / Phi-4-mini: Llama-shaped, but HF stores q|k|v in one `qkv_proj` and gate|up in one
`gate_up_proj` (tpzoo fuses them the same way, so the tensors map one to one), a sliding window on Phi-3, and
partial rotary (Phi-4-mini: the first 3/4 of each head). LongRoPE (`rope_type` "longrope", the 128K-context
checkpoints and Phi-4-mini) is not implemented: such configs are refused naming the rope type."""
from __future__ import annotations

from ..config import AttentionConfig, MLPConfig, ModelConfig
from ..registry import Family, register_family
from .hf_common import (check, common_attention, common_fields, common_to_hf, decoder_tensor_map, read_rope, refuse,
                        rope_to_hf)


def config_from_hf(hf: dict) -> ModelConfig:
    check("phi3", hf, "hidden_act", ("silu",), "silu")
    params = dict(hf.get("rope_parameters") or hf.get("rope_scaling") or {})
    partial = float(params.pop("partial_rotary_factor", hf.get("partial_rotary_factor", 1.0)))
    params.setdefault("rope_theta", hf.get("rope_theta", 10000.0))
    theta, scaling = read_rope("phi3", hf, params)
    if scaling is not None:  # "linear" / "llama3" are not what Phi-3's HF code implements either
        raise refuse("phi3", "rope_parameters.rope_type", scaling.get("rope_type", scaling.get("type")),
                     ["default"])
    return ModelConfig(family="phi3", **common_fields(hf),
                       attention=AttentionConfig(**common_attention(hf), rope_theta=theta,
                                                 partial_rotary_factor=partial,
                                                 sliding_window=hf.get("sliding_window")),
                       mlp=MLPConfig(hf["intermediate_size"], activation="swiglu"))


def config_to_hf(cfg: ModelConfig) -> dict:
    hf = common_to_hf(cfg, "phi3", "Phi3ForCausalLM")
    a = cfg.attention
    hf.update(hidden_act="silu", sliding_window=a.sliding_window,
              rope_parameters={**rope_to_hf(cfg), "partial_rotary_factor": a.partial_rotary_factor})
    return hf


def hf_tensor_map(cfg: ModelConfig) -> list:
    return decoder_tensor_map(cfg, styles={"attention": "fused", "mlp": "fused"})  # qkv_proj, gate_up_proj


register_family(Family(name="phi3", hf_model_types=("phi3",), hf_architecture="Phi3ForCausalLM",
                       config_from_hf=config_from_hf, config_to_hf=config_to_hf, hf_tensor_map=hf_tensor_map))
