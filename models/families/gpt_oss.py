"""gpt-oss-20b / 120b (`GptOssForCausalLM`): grouped-query attention with learned per-head sinks, layers alternating a
sliding window (`layer_types`) and full attention, biases on q, k, v and o, YaRN rotary; a mixture of experts on
every layer with the gpt-oss router (a linear with bias, top-k of the logits, softmax over the k: moe.router
"topk_softmax"), experts with biases and the clamped SwiGLU ((up + 1) * gate * sigmoid(1.702 gate), gate and up
clamped at `swiglu_limit`).

HF's expert tensors (models/kinds/moe_hf.py's "gpt_oss" layout) keep x @ W's layout with gate and up interleaved
(models/hf_experts.py): gate_up_proj
[E, h, 2f] (column 2j the gate of unit j, 2j + 1 its up), gate_up_proj_bias [E, 2f], down_proj [E, f, h],
down_proj_bias [E, h]; tpzoo's are nn.Linear's with gate|up in halves. Both directions are permutations and
transposes: bit-exact. The hub's MXFP4 expert weights (quantization_config.quant_method "mxfp4") are dequantized
to bf16 on import by the HF reader (tpzoo/checkpoint/hf.py, one line says so); export writes bf16, never MXFP4.
"""
from __future__ import annotations

from ..config import AttentionConfig, MLPConfig, ModelConfig, MoEConfig
from ..registry import Family, register_family
from .hf_common import (check, common_attention, common_fields, common_to_hf, decoder_tensor_map, read_layer_types,
                        read_rope, rope_to_hf)


def config_from_hf(hf: dict) -> ModelConfig:
    check("gpt_oss", hf, "hidden_act", ("silu",), "silu")
    theta, scaling = read_rope("gpt_oss", hf, default_theta=150000.0, yarn=True)
    n, bias = hf["num_hidden_layers"], bool(hf.get("attention_bias", True))
    types = read_layer_types("gpt_oss", hf, n) or [
        "sliding_attention" if i % 2 == 0 else "full_attention" for i in range(n)]  # HF's default alternation
    return ModelConfig(
        family="gpt_oss", **common_fields(hf),
        attention=AttentionConfig(**common_attention(hf), qkv_bias=bias, out_bias=bias, sinks=True,
                                  sliding_window=hf.get("sliding_window"), layer_types=types, rope_theta=theta,
                                  rope_scaling=scaling),
        mlp=MLPConfig(hf["intermediate_size"], activation="swiglu"),
        moe=MoEConfig(num_experts=hf["num_local_experts"], num_experts_per_tok=hf["num_experts_per_tok"],
                      router="topk_softmax", router_bias=True, expert_bias=True,
                      swiglu_limit=float(hf.get("swiglu_limit", 7.0)),
                      swiglu_alpha=float(hf.get("swiglu_alpha", 1.702)),
                      router_aux_loss_coef=hf.get("router_aux_loss_coef", 0.001),
                      output_router_logits=bool(hf.get("output_router_logits", False))))


def config_to_hf(cfg: ModelConfig) -> dict:
    hf = common_to_hf(cfg, "gpt_oss", "GptOssForCausalLM")
    a, moe = cfg.attention, cfg.moe
    hf.pop("quantization_config", None)  # exported in bf16
    hf.update(hidden_act="silu", attention_bias=a.qkv_bias, sliding_window=a.sliding_window, head_dim=a.head_dim,
              rope_parameters=rope_to_hf(cfg), num_local_experts=moe.num_experts,
              num_experts_per_tok=moe.num_experts_per_tok, swiglu_limit=moe.swiglu_limit,
              swiglu_alpha=moe.swiglu_alpha, router_aux_loss_coef=moe.router_aux_loss_coef,
              output_router_logits=moe.output_router_logits)
    return hf


register_family(Family(name="gpt_oss", hf_model_types=("gpt_oss",), hf_architecture="GptOssForCausalLM",
                       config_from_hf=config_from_hf, config_to_hf=config_to_hf,
                       hf_tensor_map=lambda cfg: decoder_tensor_map(cfg, styles={"moe": "gpt_oss"})))
