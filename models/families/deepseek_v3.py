"""DeepSeek-V3 (and V3.1, Kimi K2, Moonlight-16B-A3B: all `DeepseekV3ForCausalLM`): multi-head latent attention
on every layer (token mixer "mla"), the first `first_k_dense_replace` layers with a dense MLP of their own size
(`intermediate_size`), the others DeepSeekMoE (channel mixer "moe" with the sigmoid router: group-limited routing,
the selection bias `e_score_correction_bias`, `routed_scaling_factor`; `n_shared_experts` shared experts).

The DeepSeekMoE reading is GLM-4.5's too (models/families/hf_common.py `deepseek_moe`, `deepseek_moe_to_hf`), and
so are its HF names (models/kinds/moe_hf.py's "deepseek" layout: mlp.gate.weight, mlp.gate.e_score_correction_bias
— the bias of every MoE layer, both ways —, mlp.experts.{e}.{gate,up,down}_proj, mlp.shared_experts.*); the latent
attention's are models/kinds/mla_hf.py's.

Multi-token prediction: the hub's checkpoints hold `num_nextn_predict_layers` extra layers (model.layers.61 of
DeepSeek-V3) that transformers drops; tpzoo imports nothing of them and refuses nothing, saying so in one line
(`import_notes`).
"""
from __future__ import annotations

from ..config import AttentionConfig, MLAConfig, ModelConfig
from ..registry import Family, register_family
from .hf_common import (common_fields, common_to_hf, decoder_tensor_map, deepseek_moe, deepseek_moe_to_hf, mtp_notes,
                        read_rope, rope_to_hf)


def config_from_hf(hf: dict) -> ModelConfig:
    theta, scaling = read_rope("deepseek_v3", hf, yarn=True)
    bias = bool(hf.get("attention_bias", False))
    n = hf["num_hidden_layers"]
    return ModelConfig(
        family="deepseek_v3", **common_fields(hf),
        # head_dim: the shared rotary key's width (HF's head_dim); the heads' own widths are MLA's
        attention=AttentionConfig(num_heads=hf["num_attention_heads"], head_dim=hf["qk_rope_head_dim"],
                                  qkv_bias=bias, out_bias=bias, rope_theta=theta, rope_scaling=scaling),
        mla=MLAConfig(kv_lora_rank=hf["kv_lora_rank"], qk_nope_head_dim=hf["qk_nope_head_dim"],
                      qk_rope_head_dim=hf["qk_rope_head_dim"], v_head_dim=hf["v_head_dim"],
                      q_lora_rank=hf.get("q_lora_rank"), rope_interleave=bool(hf.get("rope_interleave", True))),
        token_mixers=["mla"] * n, **deepseek_moe("deepseek_v3", hf))


def config_to_hf(cfg: ModelConfig) -> dict:
    hf = common_to_hf(cfg, "deepseek_v3", "DeepseekV3ForCausalLM")
    m, a = cfg.mla, cfg.attention
    hf.update(deepseek_moe_to_hf(cfg))
    hf.update(kv_lora_rank=m.kv_lora_rank, q_lora_rank=m.q_lora_rank, qk_nope_head_dim=m.qk_nope_head_dim,
              qk_rope_head_dim=m.qk_rope_head_dim, v_head_dim=m.v_head_dim, head_dim=m.qk_rope_head_dim,
              rope_interleave=m.rope_interleave, attention_bias=a.qkv_bias, rope_parameters=rope_to_hf(cfg))
    hf.pop("rope_scaling", None)
    hf.pop("rope_theta", None)
    return hf


register_family(Family(name="deepseek_v3", hf_model_types=("deepseek_v3",), hf_architecture="DeepseekV3ForCausalLM",
                       config_from_hf=config_from_hf, config_to_hf=config_to_hf,
                       hf_tensor_map=lambda cfg: decoder_tensor_map(cfg, styles={"moe": "deepseek"}),
                       import_notes=lambda hf: mtp_notes("deepseek_v3", hf)))
