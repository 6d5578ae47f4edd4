"""LLaMA 2/3/3.1/3.2 and its close relatives Mistral and Qwen2/2.5: RMSNorm, RoPE, SwiGLU, grouped-query
attention; Mistral adds a sliding window, Qwen2 adds q/k/v biases. One mapping serves all three."""
from __future__ import annotations

from tpzoo.errors import ConfigError

from ..config import AttentionConfig, MLPConfig, ModelConfig
from ..registry import Family, register_family
from .hf_common import decoder_tensor_map


def _rope(hf: dict) -> tuple[float, dict | None]:
    """rope theta and scaling from either the transformers-5 `rope_parameters` or the older top-level keys."""
    params = hf.get("rope_parameters")
    if params:
        params = dict(params)
        theta = params.pop("rope_theta", hf.get("rope_theta", 10000.0))
        return float(theta), (params if params.get("rope_type", "default") != "default" else None)
    scaling = hf.get("rope_scaling")
    return float(hf.get("rope_theta", 10000.0)), (dict(scaling) if scaling else None)


def _config_from_hf(family: str, hf: dict) -> ModelConfig:
    act = hf.get("hidden_act", "silu")
    if act != "silu":
        raise ConfigError(f"{family} with hidden_act {act!r} is not supported (tpzoo implements SwiGLU)")
    theta, scaling = _rope(hf)
    window = hf.get("sliding_window") if family == "mistral" or hf.get("use_sliding_window") else None
    attention = AttentionConfig(
        num_heads=hf["num_attention_heads"], num_kv_heads=hf.get("num_key_value_heads") or hf["num_attention_heads"],
        head_dim=hf.get("head_dim"), rope_theta=theta, rope_scaling=scaling, sliding_window=window,
        qkv_bias=True if family == "qwen2" else hf.get("attention_bias", False),
        out_bias=False if family == "qwen2" else hf.get("attention_bias", False))
    return ModelConfig(
        family=family, vocab_size=hf["vocab_size"], hidden_size=hf["hidden_size"],
        num_layers=hf["num_hidden_layers"], attention=attention,
        mlp=MLPConfig(hf["intermediate_size"], activation="swiglu", bias=hf.get("mlp_bias", False)),
        max_position_embeddings=hf.get("max_position_embeddings", 2048), norm="rmsnorm",
        norm_eps=hf.get("rms_norm_eps", 1e-6), position="rope", tie_embeddings=hf.get("tie_word_embeddings", False),
        initializer_range=hf.get("initializer_range", 0.02), bos_token_id=hf.get("bos_token_id"),
        eos_token_id=hf.get("eos_token_id"), pad_token_id=hf.get("pad_token_id"), extra={"hf_config": hf},
    )


_ARCH = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM"}


def _config_to_hf(cfg: ModelConfig) -> dict:
    hf = dict(cfg.extra.get("hf_config", {}))
    a = cfg.attention
    rope = {"rope_type": "default", **(a.rope_scaling or {}), "rope_theta": a.rope_theta}
    hf.update({
        "model_type": cfg.family, "architectures": [_ARCH[cfg.family]], "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.hidden_size, "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": a.num_heads, "num_key_value_heads": a.num_kv_heads, "head_dim": a.head_dim,
        "intermediate_size": cfg.mlp.ffn_hidden_size, "max_position_embeddings": cfg.max_position_embeddings,
        "rms_norm_eps": cfg.norm_eps, "hidden_act": "silu", "tie_word_embeddings": cfg.tie_embeddings,
        "initializer_range": cfg.initializer_range, "bos_token_id": cfg.bos_token_id,
        "eos_token_id": cfg.eos_token_id, "pad_token_id": cfg.pad_token_id,
    })
    if "rope_parameters" in hf or "rope_theta" not in hf:
        hf["rope_parameters"] = rope
    else:  # an older-style config keeps its older keys
        hf["rope_theta"] = a.rope_theta
        hf["rope_scaling"] = a.rope_scaling
    if cfg.family == "llama":
        hf.update(attention_bias=a.qkv_bias, mlp_bias=cfg.mlp.bias)
    if cfg.family == "mistral":
        hf["sliding_window"] = a.sliding_window
    return hf


for _name, _types in (("llama", ("llama",)), ("mistral", ("mistral",)), ("qwen2", ("qwen2",))):
    register_family(Family(
        name=_name, hf_model_types=_types, hf_architecture=_ARCH[_name],
        config_from_hf=lambda hf, _n=_name: _config_from_hf(_n, hf), config_to_hf=_config_to_hf,
        hf_tensor_map=lambda cfg: decoder_tensor_map(cfg)))
