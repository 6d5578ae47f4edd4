"""GLM-4.7-Flash (`Glm4MoeLiteForCausalLM`): multi-head latent attention (token mixer "mla", DeepSeek-V3's, with
`rope_interleave` as the config says) under GLM-4.5's DeepSeekMoE (the sigmoid router with its selection bias,
groups, routed_scaling_factor, shared experts), the dense layers where HF's `mlp_layer_types` says "dense" (by
default the first). Names: MLA's (models/kinds/mla_hf.py) and DeepSeekMoE's "deepseek" layout. The
multi-token-prediction layer (model.layers.47 of the hub's checkpoint) is not imported (one line says so).
"""
from __future__ import annotations

from ..config import ModelConfig
from ..registry import Family, register_family
from .hf_common import (common_fields, common_to_hf, decoder_tensor_map, deepseek_moe, deepseek_moe_to_hf,
                        mla_fields, mla_to_hf, mlp_layer_kinds, mtp_notes, rope_to_hf)


def config_from_hf(hf: dict) -> ModelConfig:
    n = hf["num_hidden_layers"]
    moe = deepseek_moe("glm4_moe_lite", hf)
    # transformers' default without mlp_layer_types: the first layer dense, the others MoE
    moe["channel_mixers"] = mlp_layer_kinds("glm4_moe_lite", hf) or ["mlp"] + ["moe"] * (n - 1)
    return ModelConfig(family="glm4_moe_lite", **common_fields(hf), **mla_fields("glm4_moe_lite", hf),
                       token_mixers=["mla"] * n, **moe)


def config_to_hf(cfg: ModelConfig) -> dict:
    hf = common_to_hf(cfg, "glm4_moe_lite", "Glm4MoeLiteForCausalLM")
    hf.update(deepseek_moe_to_hf(cfg))
    hf.update(mla_to_hf(cfg))
    hf.update(rope_interleave=cfg.mla.rope_interleave, rope_parameters=rope_to_hf(cfg),
              mlp_layer_types=["sparse" if cfg.channel_mixer(i) == "moe" else "dense" for i in range(cfg.num_layers)])
    original = cfg.extra.get("hf_config", {})
    for name in ("first_k_dense_replace", "head_dim"):  # not fields of this config (head_dim: an alias)
        if name not in original:
            hf.pop(name, None)
    for old in ("rope_scaling", "rope_theta"):
        hf.pop(old, None)
    return hf


register_family(Family(name="glm4_moe_lite", hf_model_types=("glm4_moe_lite",),
                       hf_architecture="Glm4MoeLiteForCausalLM", config_from_hf=config_from_hf,
                       config_to_hf=config_to_hf,
                       hf_tensor_map=lambda cfg: decoder_tensor_map(cfg, styles={"moe": "deepseek"}),
                       import_notes=lambda hf: mtp_notes("glm4_moe_lite", hf)))
