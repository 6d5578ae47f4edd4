"""The mixture-of-experts families: Mixtral, Qwen3-MoE and OLMoE (models/kinds/moe.py is their channel mixer).

All three are Llama-shaped decoders whose MLP is a router plus E SwiGLU experts. HF checkpoints (what
transformers 5 writes with save_pretrained) store each expert separately:
  Mixtral     model.layers.{i}.block_sparse_moe.gate.weight, ...experts.{e}.w1 (gate) / w3 (up) / w2 (down)
  Qwen3-MoE   model.layers.{i}.mlp.gate.weight, mlp.experts.{e}.gate_proj / up_proj / down_proj (+ q/k norms
              per head; dense layers in mlp_only_layers / decoder_sparse_step keep mlp.{gate,up,down}_proj)
  OLMoE       as Qwen3-MoE, with q/k norms over the whole projection width (OLMo 2's)
tpzoo stacks them (models/kinds/moe_hf.py: the "mixtral" and the default "separate" layouts).
"""
from __future__ import annotations

from ..config import AttentionConfig, MLPConfig, ModelConfig, MoEConfig
from ..registry import Family, register_family
from .hf_common import check, common_attention, common_fields, common_to_hf, decoder_tensor_map, read_rope, rope_to_hf


def _moe_config(family: str, hf: dict, experts_key: str, attention: dict, **moe) -> ModelConfig:
    """A Llama-shaped attention (the family's `attention` settings) and a mixture of experts on every layer the
    MoE config's rule picks (ModelConfig.channel_mixer)."""
    check(family, hf, "hidden_act", ("silu",), "silu")
    theta, scaling = read_rope(family, hf)
    return ModelConfig(
        family=family, **common_fields(hf),
        attention=AttentionConfig(**common_attention(hf), rope_theta=theta, rope_scaling=scaling, **attention),
        mlp=MLPConfig(hf["intermediate_size"], activation="swiglu"),
        moe=MoEConfig(num_experts=hf.get(experts_key) or hf.get("num_local_experts") or hf["num_experts"],
                      num_experts_per_tok=hf["num_experts_per_tok"],
                      router_aux_loss_coef=hf.get("router_aux_loss_coef", 0.001),
                      output_router_logits=bool(hf.get("output_router_logits", False)), **moe))


def _moe_to_hf(cfg: ModelConfig, model_type: str, architecture: str, experts_key: str) -> dict:
    hf = common_to_hf(cfg, model_type, architecture)
    moe = cfg.moe
    hf.update(hidden_act="silu", rope_parameters=rope_to_hf(cfg), num_experts_per_tok=moe.num_experts_per_tok,
              router_aux_loss_coef=moe.router_aux_loss_coef, output_router_logits=moe.output_router_logits)
    hf[experts_key] = moe.num_experts
    return hf


# -- Mixtral ----------------------------------------------------------------------------------------------------

def mixtral_from_hf(hf: dict) -> ModelConfig:
    if hf.get("router_jitter_noise"):
        check("mixtral", hf, "router_jitter_noise", (0, 0.0))
    return _moe_config("mixtral", hf, "num_local_experts", dict(sliding_window=hf.get("sliding_window")),
                       norm_topk_prob=True)


def mixtral_to_hf(cfg: ModelConfig) -> dict:
    hf = _moe_to_hf(cfg, "mixtral", "MixtralForCausalLM", "num_local_experts")
    hf["sliding_window"] = cfg.attention.sliding_window
    return hf


register_family(Family(
    name="mixtral", hf_model_types=("mixtral",), hf_architecture="MixtralForCausalLM",
    config_from_hf=mixtral_from_hf, config_to_hf=mixtral_to_hf,
    hf_tensor_map=lambda cfg: decoder_tensor_map(cfg, styles={"moe": "mixtral"})))


# -- Qwen3-MoE --------------------------------------------------------------------------------------------------

def qwen3_moe_from_hf(hf: dict) -> ModelConfig:
    if hf.get("use_sliding_window"):
        check("qwen3_moe", hf, "use_sliding_window", (False,))
    bias = hf.get("attention_bias", False)
    return _moe_config("qwen3_moe", hf, "num_experts", dict(qk_norm="head", qkv_bias=bias, out_bias=bias),
                       ffn_hidden_size=hf["moe_intermediate_size"], norm_topk_prob=bool(hf.get("norm_topk_prob", False)),
                       mlp_only_layers=list(hf.get("mlp_only_layers") or []) or None,
                       decoder_sparse_step=hf.get("decoder_sparse_step", 1))


def qwen3_moe_to_hf(cfg: ModelConfig) -> dict:
    hf = _moe_to_hf(cfg, "qwen3_moe", "Qwen3MoeForCausalLM", "num_experts")
    moe = cfg.moe
    hf.update(attention_bias=cfg.attention.qkv_bias, moe_intermediate_size=cfg.expert_ffn,
              norm_topk_prob=moe.norm_topk_prob, mlp_only_layers=list(moe.mlp_only_layers or []),
              decoder_sparse_step=moe.decoder_sparse_step)
    return hf


register_family(Family(
    name="qwen3_moe", hf_model_types=("qwen3_moe",), hf_architecture="Qwen3MoeForCausalLM",
    config_from_hf=qwen3_moe_from_hf, config_to_hf=qwen3_moe_to_hf,
    hf_tensor_map=decoder_tensor_map))


# -- OLMoE ------------------------------------------------------------------------------------------------------

def olmoe_from_hf(hf: dict) -> ModelConfig:
    check("olmoe", hf, "clip_qkv", (None,))
    bias = hf.get("attention_bias", False)
    return _moe_config("olmoe", hf, "num_experts", dict(qk_norm="full", qkv_bias=bias, out_bias=bias),
                       norm_topk_prob=bool(hf.get("norm_topk_prob", False)))


def olmoe_to_hf(cfg: ModelConfig) -> dict:
    hf = _moe_to_hf(cfg, "olmoe", "OlmoeForCausalLM", "num_experts")
    hf.update(attention_bias=cfg.attention.qkv_bias, norm_topk_prob=cfg.moe.norm_topk_prob)
    return hf


register_family(Family(
    name="olmoe", hf_model_types=("olmoe",), hf_architecture="OlmoeForCausalLM",
    config_from_hf=olmoe_from_hf, config_to_hf=olmoe_to_hf,
    hf_tensor_map=decoder_tensor_map))
