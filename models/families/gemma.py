"""Gemma 2 and Gemma 3 (text): GeGLU with the tanh GeLU, RMSNorm scaling by (1 + weight), norms before and
after attention and the MLP, embeddings scaled by sqrt(hidden), scores scaled by query_pre_attn_scalar**-0.5,
head_dim independent of hidden / heads, a tied head over a 256K vocabulary, and sliding-window layers among
global ones (HF `layer_types`). Gemma 2 alternates them and soft-caps attention scores and final logits; Gemma 3
has 5 sliding layers to 1 global, per-head (1 + w) q/k norms and its own rope base on the sliding layers."""
from __future__ import annotations

from tpzoo.errors import ConfigError

from ..config import AttentionConfig, MLPConfig, ModelConfig
from ..registry import Family, register_family
from .hf_common import (check, common_attention, common_fields, common_to_hf, decoder_tensor_map, read_layer_types,
                        read_rope, refuse, rope_to_hf)


NORMS = {"attn_norm": "input_layernorm", "post_attn_norm": "post_attention_layernorm",
         "mlp_norm": "pre_feedforward_layernorm", "post_mlp_norm": "post_feedforward_layernorm"}
ARCH = {"gemma2": "Gemma2ForCausalLM", "gemma3": "Gemma3ForCausalLM"}
MODEL_TYPE = {"gemma2": "gemma2", "gemma3": "gemma3_text"}
PATTERN = {"gemma2": 2, "gemma3": 6}  # HF's default: every PATTERN-th layer is global, the others slide


def _layer_types(family: str, hf: dict) -> list:
    n = hf["num_hidden_layers"]
    types = read_layer_types(family, hf, n)
    if types is None:
        every = hf.get("sliding_window_pattern", hf.get("_sliding_window_pattern", PATTERN[family]))
        types = ["sliding_attention" if (i + 1) % every else "full_attention" for i in range(n)]
    return types


def _rope(family: str, hf: dict) -> tuple[float, dict | None, float | None]:
    """(global theta, global scaling, local theta)."""
    params = hf.get("rope_parameters") or {}
    if family == "gemma2" or "full_attention" not in params:
        theta, scaling = read_rope(family, hf)
        return theta, scaling, (hf.get("rope_local_base_freq") if family == "gemma3" else None)
    theta, scaling = read_rope(family, hf, params["full_attention"], "rope_parameters.full_attention")
    local = params.get("sliding_attention") or {"rope_theta": hf.get("rope_local_base_freq", 10000.0)}
    local_theta, local_scaling = read_rope(family, hf, local, "rope_parameters.sliding_attention")
    if local_scaling is not None:  # tpzoo's local table is plain rope with its own base
        raise refuse(family, "rope_parameters.sliding_attention.rope_type", local_scaling.get("rope_type"),
                     ["default"])
    return theta, scaling, local_theta


def config_from_hf(family: str, hf: dict) -> ModelConfig:
    act = hf.get("hidden_activation") or hf.get("hidden_act") or "gelu_pytorch_tanh"  # older configs: null
    if act != "gelu_pytorch_tanh":
        raise refuse(family, "hidden_activation", act, ["gelu_pytorch_tanh"])
    check(family, hf, "use_bidirectional_attention", (None, False))
    theta, scaling, local_theta = _rope(family, hf)
    bias = hf.get("attention_bias", False)
    fields = common_fields(hf)
    fields["tie_embeddings"] = hf.get("tie_word_embeddings", True)
    heads = common_attention(hf)
    if heads["head_dim"] is None:
        raise ConfigError(f"{family}: HF config field head_dim is missing (Gemma's is not hidden / heads)")
    attention = AttentionConfig(
        **heads, rope_theta=theta, rope_scaling=scaling, rope_local_theta=local_theta, qkv_bias=bias, out_bias=bias,
        sliding_window=hf.get("sliding_window"), layer_types=_layer_types(family, hf),
        qk_norm="head" if family == "gemma3" else "none", scale=hf.get("query_pre_attn_scalar", 256),
        softcap=hf.get("attn_logit_softcapping"))
    return ModelConfig(
        family=family, **fields, attention=attention, mlp=MLPConfig(hf["intermediate_size"], activation="geglu_tanh"),
        pre_norm=True, post_norm=True, norm_offset=True, embed_scale=True,
        final_softcap=hf.get("final_logit_softcapping"))


def config_to_hf(cfg: ModelConfig) -> dict:
    hf = common_to_hf(cfg, MODEL_TYPE[cfg.family], ARCH[cfg.family])
    a = cfg.attention
    hf.update(hidden_activation="gelu_pytorch_tanh", attention_bias=a.qkv_bias,
              query_pre_attn_scalar=a.scale, sliding_window=a.sliding_window,
              attn_logit_softcapping=a.softcap, final_logit_softcapping=cfg.final_softcap)
    rope = rope_to_hf(cfg)
    if cfg.family == "gemma3":
        local = {"rope_type": "default", "rope_theta": a.rope_local_theta or a.rope_theta}
        rope = {"full_attention": rope, "sliding_attention": local}
    hf["rope_parameters"] = rope
    return hf


def hf_tensor_map(cfg: ModelConfig) -> list:
    return decoder_tensor_map(cfg, NORMS)


for _family in ("gemma2", "gemma3"):
    register_family(Family(
        name=_family, hf_model_types=(MODEL_TYPE[_family],), hf_architecture=ARCH[_family],
        config_from_hf=lambda hf, _f=_family: config_from_hf(_f, hf), config_to_hf=config_to_hf,
        hf_tensor_map=hf_tensor_map))
