"""Mistral Small 4 (`Mistral4ForCausalLM`, the text model of Mistral-Small-4-119B): multi-head latent attention
(token mixer "mla", rotary interleaved or not as `rope_interleave` says) whose queries are scaled per position by
Llama 4's long-context temperature 1 + beta * log(1 + floor(position / original_max_position_embeddings))
(`rope_parameters.llama_4_scaling_beta`: MLAConfig.query_scale_beta), YaRN on the rotary key (DeepSeek's softmax
mscale^2 included); a mixture of experts with the softmax router (softmax over every expert, top-k, renormalized
when norm_topk_prob) and shared experts, the first `first_k_dense_replace` layers dense. Its checkpoint stores the
routed experts stacked as tpzoo does (models/kinds/moe_hf.py's "stacked" layout: mlp.experts.gate_up_proj,
mlp.experts.down_proj) and the router as mlp.gate.weight.

Refused (one line each): routed_scaling_factor other than 1 and group-limited routing (n_group > topk_group),
which transformers' Mistral4TopkRouter applies to softmax scores and tpzoo's softmax router does not implement.
The multimodal checkpoint (a vision tower around this text model) is not read.
"""
from __future__ import annotations

import dataclasses

from tpzoo.errors import ConfigError

from ..config import MLPConfig, ModelConfig, MoEConfig
from ..registry import Family, register_family
from .hf_common import (check, common_fields, common_to_hf, decoder_tensor_map, mla_fields, mla_to_hf, refuse,
                        rope_to_hf)

FAMILY = "mistral4"


def config_from_hf(hf: dict) -> ModelConfig:
    n, ffn = hf["num_hidden_layers"], hf["moe_intermediate_size"]
    check(FAMILY, hf, "hidden_act", ("silu",), "silu")
    if float(hf.get("routed_scaling_factor", 1.0)) != 1.0:
        raise refuse(FAMILY, "routed_scaling_factor", hf["routed_scaling_factor"], [1.0])
    groups, topk_groups = hf.get("n_group") or 1, hf.get("topk_group") or 1
    if topk_groups < groups:
        raise refuse(FAMILY, "topk_group", topk_groups, [f"n_group={groups} (every group kept)"])
    params = dict(hf.get("rope_parameters") or {})
    params.pop("max_position_embeddings", None)  # (transformers ignores it)
    partial = params.pop("partial_rotary_factor", None)
    rope, nope = hf["qk_rope_head_dim"], hf["qk_nope_head_dim"]
    if partial is not None and abs(partial * (nope + rope) - rope) > 1e-6:
        raise refuse(FAMILY, "rope_parameters.partial_rotary_factor", partial, [rope / (nope + rope)])
    beta = params.pop("llama_4_scaling_beta", None)
    fields = mla_fields(FAMILY, hf, params or None)
    if beta is not None:
        length = params.get("original_max_position_embeddings")
        if length is None:
            raise ConfigError(f"{FAMILY}: rope_parameters.llama_4_scaling_beta needs original_max_position_embeddings")
        fields["mla"] = dataclasses.replace(fields["mla"], query_scale_beta=float(beta), query_scale_length=length)
    dense = min(hf.get("first_k_dense_replace") or 0, n)
    moe = MoEConfig(num_experts=hf["n_routed_experts"], num_experts_per_tok=hf["num_experts_per_tok"],
                    ffn_hidden_size=ffn, norm_topk_prob=bool(hf.get("norm_topk_prob", True)), router="softmax",
                    shared_expert_ffn=(hf.get("n_shared_experts") or 0) * ffn,
                    output_router_logits=bool(hf.get("output_router_logits", False)))
    return ModelConfig(family=FAMILY, **common_fields(hf), **fields, token_mixers=["mla"] * n,
                       mlp=MLPConfig(hf["intermediate_size"], activation="swiglu"), moe=moe,
                       channel_mixers=["mlp"] * dense + ["moe"] * (n - dense))


def config_to_hf(cfg: ModelConfig) -> dict:
    hf = common_to_hf(cfg, FAMILY, "Mistral4ForCausalLM")
    m, moe = cfg.mla, cfg.moe
    hf.update(mla_to_hf(cfg))
    dense = next((i for i in range(cfg.num_layers) if cfg.channel_mixer(i) == "moe"), cfg.num_layers)
    hf.update(rope_interleave=m.rope_interleave, head_dim=m.qk_head_dim, hidden_act="silu",
              moe_intermediate_size=cfg.expert_ffn, n_routed_experts=moe.num_experts,
              num_experts_per_tok=moe.num_experts_per_tok, norm_topk_prob=moe.norm_topk_prob,
              n_shared_experts=moe.shared_expert_ffn // cfg.expert_ffn, first_k_dense_replace=dense)
    rope = {**rope_to_hf(cfg), "partial_rotary_factor": m.qk_rope_head_dim / m.qk_head_dim}
    if m.query_scale_beta is not None:
        rope["llama_4_scaling_beta"] = m.query_scale_beta
    original = cfg.extra.get("hf_config", {}).get("rope_parameters") or {}
    hf["rope_parameters"] = {**original, **rope}  # (keeps the fields transformers ignores, "type", ...)
    return hf


register_family(Family(name=FAMILY, hf_model_types=(FAMILY,), hf_architecture="Mistral4ForCausalLM",
                       config_from_hf=config_from_hf, config_to_hf=config_to_hf,
                       hf_tensor_map=lambda cfg: decoder_tensor_map(cfg, styles={"moe": "stacked"})))
