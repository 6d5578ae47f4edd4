"""The hybrid Qwen families: Qwen3.5 (dense and MoE, the text part) and Qwen3-Next. Each layer's token mixer comes
from HF's `layer_types`: Gated DeltaNet where it says "linear_attention" (models/kinds/gated_deltanet.py), gated
softmax attention where it says "full_attention" (models/kinds/attention.py with `output_gate`: q_proj twice as
wide, each head's query then its gate; per-head q/k RMSNorm; partial rotary, 0.25 of head_dim). Every RMSNorm but
the DeltaNet's gated one scales by (1 + w) (`norm_offset`). The channel mixer is a SwiGLU MLP (Qwen3.5 dense), or
a mixture of experts with a sigmoid-gated shared expert (Qwen3.5-MoE on every layer; Qwen3-Next where
`mlp_only_layers` / `decoder_sparse_step` say).

HF names: model.layers.{i}.linear_attn.* (models/kinds/gated_deltanet_hf.py: Qwen3.5's in_proj_qkv / z / b / a, Qwen3-Next's
grouped in_proj_qkvz / in_proj_ba), model.layers.{i}.self_attn.{q,k,v,o}_proj, q_norm, k_norm, mlp.* .
A Qwen3.5 multimodal checkpoint (model_type "qwen3_5" / "qwen3_5_moe", Qwen3_5(Moe)ForConditionalGeneration) is
read for its text part: `text_config`, the tensors under model.language_model.; its vision tower (model.visual.*)
is not read, trained or written (to-hf writes the same config.json and the text model's tensors under their names:
the vision tensors are to be copied from the original checkpoint to serve it multimodal). The multi-token-prediction
layer (mtp.*: models/mtp_hf.py's "qwen" layout; gated full attention and the family's channel mixer) is built,
trained and written: Qwen3.5 counts it in `mtp_num_hidden_layers`, Qwen3-Next's config has no count (the tensors
say). mrope's sections (`mrope_section`) rotate text positions like plain rope (all three position rows are the
token's position), so they are kept for the round trip and otherwise unused.
"""
from __future__ import annotations

from ..config import AttentionConfig, GatedDeltaNetConfig, MLPConfig, ModelConfig, MoEConfig
from ..mtp_hf import MTPLayout, mtp_from_hf, mtp_to_hf
from ..registry import Family, register_family
from .hf_common import (LINEAR_ATTENTION, check, common_attention, common_fields, common_to_hf, decoder_tensor_map,
                        read_layer_types, read_rope, token_mixers_of)


TYPES = ("full_attention", LINEAR_ATTENTION)
MROPE = ("mrope_section", "mrope_interleaved")  # multimodal rope: no effect on text positions


def _layer_types(family: str, hf: dict) -> list:
    n = hf["num_hidden_layers"]
    types = read_layer_types(family, hf, n, TYPES)
    if types is None:  # HF's default: every `full_attention_interval`-th layer is full attention
        every = hf.get("full_attention_interval", 4)
        types = [LINEAR_ATTENTION if (i + 1) % every else "full_attention" for i in range(n)]
    return types


def _rope(family: str, hf: dict) -> tuple[float, dict | None, float]:
    """(theta, scaling, partial rotary factor); the multimodal sections dropped."""
    params = dict(hf.get("rope_parameters") or {})
    if not params:
        params = {**(hf.get("rope_scaling") or {}), "rope_theta": hf.get("rope_theta", 10000.0)}
    partial = params.pop("partial_rotary_factor", hf.get("partial_rotary_factor", 0.25))
    for key in MROPE:
        params.pop(key, None)
    theta, scaling = read_rope(family, hf, params)
    return theta, scaling, partial


def text_config_from_hf(family: str, hf: dict, **model) -> ModelConfig:
    """The ModelConfig of a Qwen3.5 / Qwen3-Next text config `hf` (`model`: the channel mixers' settings)."""
    check(family, hf, "hidden_act", ("silu",), "silu")
    check(family, hf, "attn_output_gate", (True,), True)  # some hub configs spell it out; always gated in HF
    theta, scaling, partial = _rope(family, hf)
    bias = hf.get("attention_bias", False)
    fields = common_fields(hf)
    gdn = GatedDeltaNetConfig(num_key_heads=hf["linear_num_key_heads"], num_value_heads=hf["linear_num_value_heads"],
                              key_head_dim=hf["linear_key_head_dim"], value_head_dim=hf["linear_value_head_dim"],
                              conv_kernel=hf.get("linear_conv_kernel_dim", 4))
    attention = AttentionConfig(**common_attention(hf), rope_theta=theta, rope_scaling=scaling,
                                partial_rotary_factor=partial, qkv_bias=bias, out_bias=bias, qk_norm="head",
                                output_gate=True)
    if "mlp" not in model:
        model["mlp"] = MLPConfig(hf["intermediate_size"], activation="swiglu")
    return ModelConfig(family=family, **fields, attention=attention, gated_deltanet=gdn,
                       token_mixers=token_mixers_of(_layer_types(family, hf)), norm_offset=True, **model)


def from_hf(family: str, hf: dict, mtp: MTPLayout, channel=None) -> ModelConfig:
    """A text config, or a multimodal one's text part (its dict kept whole for the round trip); `channel(text)`:
    the ModelConfig fields of the family's channel mixers; `mtp`: how it counts its multi-token prediction."""
    multimodal = "text_config" in hf
    text = hf["text_config"] if multimodal else hf
    cfg = text_config_from_hf(family, text, **(channel(text) if channel else {}), mtp=mtp_from_hf(mtp, hf))
    if multimodal and "tie_word_embeddings" in hf:
        cfg.tie_embeddings = bool(hf["tie_word_embeddings"])
    cfg.extra = {"hf_config": hf}
    return cfg


def text_config_to_hf(cfg: ModelConfig, model_type: str, architecture: str, base: dict) -> dict:
    """The HF text config of `cfg`: `base` (the source's) with every field the config owns overwritten."""
    hf = common_to_hf(cfg.replace(extra={"hf_config": base}), model_type, architecture)
    a, g = cfg.attention, cfg.gated_deltanet
    rope = {k: v for k, v in (base.get("rope_parameters") or {}).items() if k in MROPE}
    rope.update({"rope_type": "default", **(a.rope_scaling or {}), "rope_theta": a.rope_theta,
                 "partial_rotary_factor": a.partial_rotary_factor})
    hf.update(hidden_act="silu", attention_bias=a.qkv_bias, head_dim=a.head_dim, rope_parameters=rope,
              linear_num_key_heads=g.num_key_heads, linear_num_value_heads=g.num_value_heads,
              linear_key_head_dim=g.key_head_dim, linear_value_head_dim=g.value_head_dim,
              linear_conv_kernel_dim=g.conv_kernel,
              layer_types=[LINEAR_ATTENTION if cfg.token_mixer(i) == "gated_deltanet" else "full_attention"
                           for i in range(cfg.num_layers)])
    return hf


def to_hf(cfg: ModelConfig, model_type: str, architecture: str, mtp: MTPLayout, channel=None) -> dict:
    """`cfg` as the HF config it came from: a text config (`model_type`), or the multimodal dict with its
    text_config updated; `channel(cfg)`: the channel mixers' HF fields; `mtp`: the count of its depths."""
    orig = cfg.extra.get("hf_config", {})
    multimodal = "text_config" in orig
    text = text_config_to_hf(cfg, model_type, architecture, orig["text_config"] if multimodal else orig)
    if channel is not None:
        text.update(channel(cfg))
    text.update(mtp_to_hf(mtp, cfg))
    if not multimodal:
        return text
    hf = dict(orig)
    hf["text_config"] = text
    hf["tie_word_embeddings"] = cfg.tie_embeddings
    return hf


def prefix_of(cfg: ModelConfig) -> str:
    """Where the checkpoint keeps the decoder: a multimodal one's language model, or the text model's."""
    return "model.language_model." if "text_config" in cfg.extra.get("hf_config", {}) else "model."


def tensor_map(cfg: ModelConfig, gdn_layout: str) -> list:
    """Gated DeltaNet's HF names in `gdn_layout` (models/kinds/gated_deltanet_hf.py); the experts' in the default
    layout (models/kinds/moe_hf.py: routed experts one by one, the gated shared expert)."""
    return decoder_tensor_map(cfg, styles={"gated_deltanet": gdn_layout}, prefix=prefix_of(cfg))


# -- Qwen3.5 (dense) ------------------------------------------------------------------------------------------------

# multi-token prediction (models/mtp_hf.py): gated attention and the family's channel mixer; Qwen publishes no weight
MTP = MTPLayout("qwen", "mtp_num_hidden_layers", "attention", "mlp", text_config=True)
MTP_MOE = MTPLayout("qwen", "mtp_num_hidden_layers", "attention", "moe", text_config=True)
MTP_NEXT = MTPLayout("qwen", None, "attention", "moe")

register_family(Family(
    name="qwen3_5", hf_model_types=("qwen3_5_text", "qwen3_5"), hf_architecture="Qwen3_5ForCausalLM",
    config_from_hf=lambda hf: from_hf("qwen3_5", hf, MTP),
    config_to_hf=lambda cfg: to_hf(cfg, "qwen3_5_text", "Qwen3_5ForCausalLM", MTP),
    hf_tensor_map=lambda cfg: tensor_map(cfg, "qwen3_5"), hf_mtp=MTP))


# -- the mixtures of experts: Qwen3.5-MoE, Qwen3-Next --------------------------------------------------------------

def moe_from_hf(text: dict, every_layer: bool) -> dict:
    """The channel mixers' settings: a softmax top-k router, SwiGLU experts and a sigmoid-gated shared expert
    (Qwen3.5-MoE: on every layer, top-k renormalized; Qwen3-Next: HF's mlp_only_layers / decoder_sparse_step rule,
    dense layers keeping an MLP of intermediate_size)."""
    experts = text.get("num_experts", 0)
    moe = MoEConfig(num_experts=experts, num_experts_per_tok=text.get("num_experts_per_tok", 0),
                    ffn_hidden_size=text.get("moe_intermediate_size"),
                    norm_topk_prob=True if every_layer else bool(text.get("norm_topk_prob", True)),
                    router_aux_loss_coef=text.get("router_aux_loss_coef", 0.001),
                    output_router_logits=bool(text.get("output_router_logits", False)),
                    mlp_only_layers=None if every_layer else (list(text.get("mlp_only_layers") or []) or None),
                    decoder_sparse_step=1 if every_layer else text.get("decoder_sparse_step", 1),
                    shared_expert_ffn=text.get("shared_expert_intermediate_size", 0) if experts else 0,
                    shared_expert_gate=bool(experts))
    # Qwen3.5-MoE has no dense layer (and no intermediate_size): the MLP settings are the experts' activation
    return {"moe": moe, "mlp": MLPConfig(text.get("intermediate_size") or text["moe_intermediate_size"],
                                         activation="swiglu")}


def moe_to_hf(cfg: ModelConfig, every_layer: bool) -> dict:
    moe = cfg.moe
    hf = {"num_experts": moe.num_experts, "num_experts_per_tok": moe.num_experts_per_tok,
          "moe_intermediate_size": cfg.expert_ffn, "shared_expert_intermediate_size": moe.shared_expert_ffn,
          "router_aux_loss_coef": moe.router_aux_loss_coef, "output_router_logits": moe.output_router_logits}
    if not every_layer:
        hf.update(norm_topk_prob=moe.norm_topk_prob, mlp_only_layers=list(moe.mlp_only_layers or []),
                  decoder_sparse_step=moe.decoder_sparse_step)
    return hf


def _moe_to_hf(cfg: ModelConfig, model_type: str, architecture: str, every_layer: bool) -> dict:
    mtp = MTP_MOE if every_layer else MTP_NEXT
    hf = to_hf(cfg, model_type, architecture, mtp, lambda c: moe_to_hf(c, every_layer))
    text = hf.get("text_config", hf)
    base = cfg.extra.get("hf_config", {})
    if every_layer and "intermediate_size" not in base.get("text_config", base):
        text.pop("intermediate_size", None)  # Qwen3.5-MoE has no dense MLP to size
    return hf


register_family(Family(
    name="qwen3_5_moe", hf_model_types=("qwen3_5_moe_text", "qwen3_5_moe"), hf_architecture="Qwen3_5MoeForCausalLM",
    config_from_hf=lambda hf: from_hf("qwen3_5_moe", hf, MTP_MOE, lambda text: moe_from_hf(text, every_layer=True)),
    config_to_hf=lambda cfg: _moe_to_hf(cfg, "qwen3_5_moe_text", "Qwen3_5MoeForCausalLM", every_layer=True),
    hf_tensor_map=lambda cfg: tensor_map(cfg, "qwen3_5"), hf_mtp=MTP_MOE))

register_family(Family(
    name="qwen3_next", hf_model_types=("qwen3_next",), hf_architecture="Qwen3NextForCausalLM",
    config_from_hf=lambda hf: from_hf("qwen3_next", hf, MTP_NEXT, lambda text: moe_from_hf(text, every_layer=False)),
    config_to_hf=lambda cfg: _moe_to_hf(cfg, "qwen3_next", "Qwen3NextForCausalLM", every_layer=False),
    hf_tensor_map=lambda cfg: tensor_map(cfg, "qwen3_next"), hf_mtp=MTP_NEXT))
