"""MiniMax-M2 / M2.1 (`MiniMaxM2ForCausalLM`, 230B parameters, 10B active; the hub ships it in block FP8, read by
tpzoo.quant): grouped-query attention with q/k norms over the projections' whole width (qk_norm "full", OLMo 2's
kind: HF's FlexOlmo attention), partial rotary (`rotary_dim` of `head_dim`, rotate-half on the first part of each
head, as GLM-4.5), and a mixture of experts on every layer with the sigmoid router and its selection bias
(`e_score_correction_bias`; no groups, no scaling, the top-k weights renormalized), no shared experts, no dense
layers. HF's tensor names are Mixtral's (block_sparse_moe.gate, experts.{e}.w1 / w3 / w2) plus the selection bias
(block_sparse_moe.e_score_correction_bias): models/kinds/moe_hf.py's "minimax" layout.

Refused by field (each one line): MiniMax-01's lightning-attention layers (`attn_type_list` entries other than 1), a
router other than sigmoid with the bias, shared experts, router jitter. HF's load-balancing loss
(output_router_logits, Mixtral's softmax loss over these logits) is not modeled: the sigmoid router trains with the
auxiliary-loss-free bias update. The multi-token-prediction modules (`use_mtp`) are not imported (one line says so).
"""
from __future__ import annotations

from ..config import AttentionConfig, MLPConfig, ModelConfig, MoEConfig
from ..registry import Family, register_config, register_family
from .hf_common import check, common_attention, common_fields, common_to_hf, decoder_tensor_map, read_rope, rope_to_hf


def config_from_hf(hf: dict) -> ModelConfig:
    family = "minimax_m2"
    check(family, hf, "hidden_act", ("silu",), "silu")
    check(family, hf, "scoring_func", ("sigmoid",), "sigmoid")
    check(family, hf, "use_routing_bias", (True,), True)
    check(family, hf, "use_qk_norm", (True,), True)
    check(family, hf, "qk_norm_type", ("per_layer",), "per_layer")
    check(family, hf, "shared_intermediate_size", (0, None), 0)
    check(family, hf, "router_jitter_noise", (0, 0.0), 0.0)
    check(family, hf, "output_router_logits", (False,), False)
    kinds = sorted(set(hf.get("attn_type_list") or [1]))
    if kinds != [1]:
        check(family, {"attn_type_list": kinds}, "attn_type_list", ([1],))
    params = dict(hf.get("rope_parameters") or {**(hf.get("rope_scaling") or {}),
                                                "rope_theta": hf.get("rope_theta", 5000000.0)})
    head_dim = hf.get("head_dim") or hf["hidden_size"] // hf["num_attention_heads"]
    partial = params.pop("partial_rotary_factor", None)
    if partial is None:
        partial = hf["rotary_dim"] / head_dim if hf.get("rotary_dim") else 1.0
    theta, scaling = read_rope(family, hf, params, default_theta=5000000.0)
    ffn = hf["intermediate_size"]  # each expert's (there is no dense MLP)
    n = hf["num_hidden_layers"]
    return ModelConfig(
        family=family, **common_fields(hf),
        attention=AttentionConfig(**common_attention(hf), qk_norm="full", rope_theta=theta, rope_scaling=scaling,
                                  partial_rotary_factor=float(partial)),
        mlp=MLPConfig(ffn, activation="swiglu"),
        moe=MoEConfig(num_experts=hf["num_local_experts"], num_experts_per_tok=hf["num_experts_per_tok"],
                      ffn_hidden_size=ffn, norm_topk_prob=True, router="sigmoid", router_aux_loss_coef=0.0),
        channel_mixers=["moe"] * n)


def config_to_hf(cfg: ModelConfig) -> dict:
    hf = common_to_hf(cfg, "minimax_m2", "MiniMaxM2ForCausalLM")
    a, moe = cfg.attention, cfg.moe
    hf.update(hidden_act="silu", head_dim=a.head_dim, intermediate_size=cfg.expert_ffn,
              num_local_experts=moe.num_experts, num_experts_per_tok=moe.num_experts_per_tok,
              rotary_dim=a.rotary_dim, rope_parameters={**rope_to_hf(cfg), "partial_rotary_factor":
                                                        a.partial_rotary_factor})
    return hf


def import_notes(hf: dict) -> list[str]:
    if not hf.get("use_mtp"):
        return []
    return [f"minimax_m2: the {hf.get('num_mtp_modules', 'multi-token-prediction')} multi-token-prediction modules "
            f"(use_mtp) are not imported (transformers drops them too)"]


register_family(Family(name="minimax_m2", hf_model_types=("minimax_m2",), hf_architecture="MiniMaxM2ForCausalLM",
                       config_from_hf=config_from_hf, config_to_hf=config_to_hf,
                       hf_tensor_map=lambda cfg: decoder_tensor_map(cfg, styles={"moe": "minimax"}),
                       import_notes=import_notes))


# Named configs (the hub's config.json numbers; both releases ship block FP8: `convert from-hf` dequantizes it, or
# keeps it with --keep-quantized). Kept FP8 splits along whole 128-blocks up to tp 4 for the experts (1536 / 4 = 384);
# beyond, use expert parallelism.
def _minimax(name: str, src: str) -> None:
    layers = 62
    register_config(name, ModelConfig(
        family="minimax_m2", vocab_size=200064, hidden_size=3072, num_layers=layers,
        attention=AttentionConfig(num_heads=48, num_kv_heads=8, head_dim=128, qk_norm="full", rope_theta=5000000.0,
                                  partial_rotary_factor=0.5),
        mlp=MLPConfig(1536), moe=MoEConfig(num_experts=256, num_experts_per_tok=8, ffn_hidden_size=1536,
                                           router="sigmoid", router_aux_loss_coef=0.0),
        channel_mixers=["moe"] * layers, max_position_embeddings=196608, norm_eps=1e-6, bos_token_id=200034,
        eos_token_id=200020, hf_source=src))


_minimax("minimax-m2", "MiniMaxAI/MiniMax-M2")
_minimax("minimax-m2.1", "MiniMaxAI/MiniMax-M2.1")
