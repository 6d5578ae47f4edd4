"""DeepSeek-V3 (and V3.1, Kimi K2, Moonlight-16B-A3B: all `DeepseekV3ForCausalLM`): multi-head latent attention
on every layer (token mixer "mla"), the first `first_k_dense_replace` layers with a dense MLP of their own size
(`intermediate_size`), the others DeepSeekMoE (channel mixer "moe" with the sigmoid router: group-limited routing,
the selection bias `e_score_correction_bias`, `routed_scaling_factor`; `n_shared_experts` shared experts).

The DeepSeekMoE reading and mapping here is GLM-4.5's too (models/glm4_moe.py): `deepseek_moe(hf)`,
`deepseek_moe_to_hf(cfg)` and `moe_maps` (HF: mlp.gate.weight, mlp.gate.e_score_correction_bias — the bias of
every MoE layer, both ways —, mlp.experts.{e}.{gate,up,down}_proj, mlp.shared_experts.{gate,up,down}_proj).

Multi-token prediction: the hub's checkpoints hold `num_nextn_predict_layers` extra layers (model.layers.61 of
DeepSeek-V3) that transformers drops; tpzoo imports nothing of them and refuses nothing, saying so in one line
(`import_notes`).
"""
from __future__ import annotations

from ..config import AttentionConfig, MLAConfig, MLPConfig, ModelConfig, MoEConfig
from .hf_common import check, common_fields, common_to_hf, head_maps, read_rope, rope_to_hf
from ..hf_mapping import concatenated, same
from .moe_families import stacked, stacked_gate_up
from ..registry import Family, register_family

NORMS = {"attn_norm": "input_layernorm", "mlp_norm": "post_attention_layernorm"}


# -- DeepSeekMoE (shared with GLM-4.5) --------------------------------------------------------------------------

def deepseek_moe(family: str, hf: dict) -> dict:
    """ModelConfig keyword arguments of DeepSeekMoE: the dense MLP of the first layers, the MoE settings, which
    layers are which."""
    check(family, hf, "hidden_act", ("silu",), "silu")
    check(family, hf, "scoring_func", ("sigmoid",), "sigmoid")  # older DeepSeek configs spell the router out
    check(family, hf, "topk_method", ("noaux_tc",), "noaux_tc")
    check(family, hf, "moe_layer_freq", (1,), 1)
    n, dense = hf["num_hidden_layers"], hf.get("first_k_dense_replace") or 0
    ffn = hf["moe_intermediate_size"]
    return dict(
        mlp=MLPConfig(hf["intermediate_size"], activation="swiglu"),
        moe=MoEConfig(num_experts=hf["n_routed_experts"], num_experts_per_tok=hf["num_experts_per_tok"],
                      ffn_hidden_size=ffn, norm_topk_prob=bool(hf.get("norm_topk_prob", True)), router="sigmoid",
                      n_group=hf.get("n_group") or 1, topk_group=hf.get("topk_group") or 1,
                      routed_scaling_factor=float(hf.get("routed_scaling_factor", 1.0)),
                      shared_expert_ffn=(hf.get("n_shared_experts") or 0) * ffn,
                      output_router_logits=bool(hf.get("output_router_logits", False)), router_aux_loss_coef=0.0),
        channel_mixers=["mlp"] * min(dense, n) + ["moe"] * max(0, n - dense))


def deepseek_moe_to_hf(cfg: ModelConfig) -> dict:
    moe = cfg.moe
    dense = next((i for i in range(cfg.num_layers) if cfg.channel_mixer(i) == "moe"), cfg.num_layers)
    return dict(hidden_act="silu", moe_intermediate_size=cfg.expert_ffn, n_routed_experts=moe.num_experts,
                num_experts_per_tok=moe.num_experts_per_tok, norm_topk_prob=moe.norm_topk_prob,
                n_group=moe.n_group, topk_group=moe.topk_group, routed_scaling_factor=moe.routed_scaling_factor,
                n_shared_experts=moe.shared_expert_ffn // cfg.expert_ffn, first_k_dense_replace=dense,
                output_router_logits=moe.output_router_logits)


def moe_maps(cfg: ModelConfig, i: int, p: str, q: str) -> list:
    """One DeepSeekMoE layer: router (and its selection bias), routed experts, shared experts."""
    experts = [f"{q}mlp.experts.{e}." for e in range(cfg.moe.num_experts)]
    gate, up, down = ([x + n + ".weight" for x in experts] for n in ("gate_proj", "up_proj", "down_proj"))
    maps = [same(p + "mlp.router.weight", q + "mlp.gate.weight", layer=i),
            same(p + "mlp.router.e_score_correction_bias", q + "mlp.gate.e_score_correction_bias", layer=i),
            stacked_gate_up(p + "mlp.gate_up", gate, up, cfg.expert_ffn, layer=i),
            stacked(p + "mlp.down", down, layer=i)]
    if cfg.moe.shared_expert_ffn:
        return maps + dense_maps(p + "mlp.shared_experts.", q + "mlp.shared_experts.", cfg.moe.shared_expert_ffn, i)
    return maps


def dense_maps(p: str, q: str, ffn: int, i: int) -> list:
    """A gated MLP: gate_proj|up_proj fused into fc_in, down_proj as fc_out."""
    return [concatenated(p + "fc_in.weight", (q + "gate_proj.weight", q + "up_proj.weight"), (ffn, ffn), layer=i),
            same(p + "fc_out.weight", q + "down_proj.weight", layer=i)]


def mtp_notes(family: str, hf: dict) -> list[str]:
    n = hf.get("num_nextn_predict_layers") or hf.get("num_mtp_layers") or 0
    if not n:
        return []
    first = hf["num_hidden_layers"]
    return [f"{family}: the {n} multi-token-prediction layer(s) (num_nextn_predict_layers; model.layers.{first}"
            f"{'-' + str(first + n - 1) if n > 1 else ''}.*, if present) are not imported (transformers drops them too)"]


# -- the family ---------------------------------------------------------------------------------------------------

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


def mla_maps(cfg: ModelConfig, i: int, p: str, q: str) -> list:
    """One latent attention layer: every projection and norm under HF's own name."""
    names = (["q_proj"] if cfg.mla.q_lora_rank is None else ["q_a_proj", "q_a_layernorm", "q_b_proj"])
    names += ["kv_a_proj_with_mqa", "kv_a_layernorm", "kv_b_proj", "o_proj"]
    maps = [same(f"{p}attn.{n}.weight", f"{q}self_attn.{n}.weight", layer=i) for n in names]
    biased = ([n for n in ("q_a_proj", "kv_a_proj_with_mqa") if n in names] if cfg.attention.qkv_bias else [])
    biased += ["o_proj"] if cfg.attention.out_bias else []
    return maps + [same(f"{p}attn.{n}.bias", f"{q}self_attn.{n}.bias", layer=i) for n in biased]


def hf_tensor_map(cfg: ModelConfig) -> list:
    maps = [same("embed.weight", "model.embed_tokens.weight", vocab_dim=0)]
    for i in range(cfg.num_layers):
        p, q = f"layers.{i}.", f"model.layers.{i}."
        maps += mla_maps(cfg, i, p, q)
        maps += [same(p + ours + ".weight", q + theirs + ".weight", layer=i) for ours, theirs in NORMS.items()]
        if cfg.channel_mixer(i) == "moe":
            maps += moe_maps(cfg, i, p, q)
        else:
            maps += dense_maps(p + "mlp.", q + "mlp.", cfg.mlp.ffn_hidden_size, i)
    return maps + head_maps(cfg)


register_family(Family(name="deepseek_v3", hf_model_types=("deepseek_v3",), hf_architecture="DeepseekV3ForCausalLM",
                       config_from_hf=config_from_hf, config_to_hf=config_to_hf, hf_tensor_map=hf_tensor_map,
                       import_notes=lambda hf: mtp_notes("deepseek_v3", hf)))
