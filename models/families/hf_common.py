"""What the families share when reading and writing Hugging Face configs and tensors: checked reads of the fields a
family does not implement every value of (each refusal names the HF field), and the tensor map of a decoder whose
layers' tensors each layer kind names itself (models/kinds/<kind>_hf.py), with the family's own norm names."""
from __future__ import annotations

from tpzoo.errors import ConfigError

from ..config import LAYER_TYPES, AttentionConfig, MLAConfig, MLPConfig, ModelConfig, MoEConfig
from ..hf_mapping import same
from ..kinds.rotary import ROPE_TYPES  # what the rotary tables implement
from ..mtp_hf import mtp_tensor_maps
from ..registry import get_family, layer_kinds


def refuse(family: str, field: str, value, supported) -> ConfigError:
    return ConfigError(f"{family}: HF config field {field}={value!r} is not supported (tpzoo implements "
                       f"{supported})")


def check(family: str, hf: dict, field: str, allowed: tuple, default=None):
    """hf[field] (or default), refused unless it is one of `allowed`."""
    value = hf.get(field, default)
    if value not in allowed:
        raise refuse(family, field, value, list(allowed))
    return value


def read_rope(family: str, hf: dict, params: dict | None = None, field: str = "rope_parameters",
              default_theta: float = 10000.0, yarn: bool = False) -> tuple[float, dict | None]:
    """(theta, scaling) from transformers-5 `rope_parameters` (or the older rope_theta / rope_scaling), refusing
    a rope type tpzoo does not implement (longrope, dynamic...) instead of running it as plain rope. YaRN's
    parameters come out as transformers reads them: `rope_type` spelled so, its factor (when a config leaves it out)
    max_position_embeddings / original_max_position_embeddings."""
    if params is None:
        params = hf.get("rope_parameters")
        if not params:
            params = {**(hf.get("rope_scaling") or {}), "rope_theta": hf.get("rope_theta", default_theta)}
            field = "rope_scaling"
    params = dict(params)
    theta = float(params.pop("rope_theta", hf.get("rope_theta", default_theta)))
    kind = params.get("rope_type", params.get("type", "default"))
    # YaRN only where a family's tests prove it against transformers (DeepSeek-V3, gpt-oss, OLMo 3: `yarn=True`)
    allowed = [t for t in ROPE_TYPES if yarn or t != "yarn"]
    if kind not in allowed:
        raise refuse(family, f"{field}.rope_type", kind, allowed)
    partial = params.pop("partial_rotary_factor", 1.0)  # a family that implements it pops it before
    if partial not in (None, 1, 1.0):
        raise refuse(family, f"{field}.partial_rotary_factor", partial, [1.0])
    if kind == "yarn":
        params = {k: v for k, v in params.items() if k != "type"}
        params["rope_type"] = "yarn"
        old = params.get("original_max_position_embeddings")
        if old is None:
            raise ConfigError(f"{family}: HF config field {field} (yarn) needs original_max_position_embeddings")
        if params.get("factor") is None:
            params["factor"] = hf["max_position_embeddings"] / old
    return theta, (params if kind != "default" else None)


NORMS = {"attn_norm": "input_layernorm", "mlp_norm": "post_attention_layernorm"}  # a Llama-shaped block's
LINEAR_ATTENTION = "linear_attention"  # HF's layer type of a Gated DeltaNet layer (Qwen3.5, Qwen3-Next)


def read_layer_types(family: str, hf: dict, num_layers: int, allowed: tuple = LAYER_TYPES) -> list | None:
    """HF's `layer_types` (None when absent), each entry one of `allowed` (a family with linear-attention layers
    adds LINEAR_ATTENTION), else refused naming the field."""
    types = hf.get("layer_types")
    if types is None:
        return None
    unknown = sorted(set(types) - set(allowed))
    if unknown:
        raise refuse(family, "layer_types", unknown[0], list(allowed))
    if len(types) != num_layers:
        raise ConfigError(f"{family}: HF config field layer_types has {len(types)} entries for {num_layers} layers")
    return list(types)


def token_mixers_of(types: list | None) -> list | None:
    """The token-mixer kind of each layer from HF's layer_types: "gated_deltanet" where it says
    "linear_attention", softmax "attention" elsewhere (None: no layer_types, every layer attention)."""
    if types is None:
        return None
    return ["gated_deltanet" if t == LINEAR_ATTENTION else "attention" for t in types]


def decoder_tensor_map(cfg: ModelConfig, norms: dict[str, str] = NORMS, styles: dict[str, str] | None = None,
                       prefix: str = "model.", embed: str = "embed_tokens", layers: str = "layers",
                       final_norm: str = "norm", positions: str | None = None) -> list:
    """Map of a decoder whose HF layers are {prefix}{layers}.{i}: each layer's token and channel mixer through its
    kind's own HF names (the kind class's `hf_tensor_maps`, in models/kinds/<kind>_hf.py), in the HF layout
    `styles[kind]` names (None: the kind's default), then the block's norms (`norms`: tpzoo norm name -> HF module
    name within the layer; a LayerNorm's bias too). `prefix` is where HF keeps the decoder ("model.", a multimodal
    checkpoint's "model.language_model.", GPT-2's "transformer."), with its embedding, final norm and (learned)
    positions under their HF names."""
    styles = styles or {}
    maps = [same("embed.weight", f"{prefix}{embed}.weight", vocab_dim=0)]
    if positions is not None:
        maps.append(same("pos_embed.weight", f"{prefix}{positions}.weight"))
    for i in range(cfg.num_layers):
        maps += block_tensor_maps(cfg, i, f"layers.{i}.", f"{prefix}{layers}.{i}.", norms, styles)
    maps += head_maps(cfg, prefix, embed, final_norm)
    if cfg.mtp is not None:  # multi-token prediction's depths, in the family's HF layout (models/mtp_hf.py)
        maps += mtp_tensor_maps(cfg, get_family(cfg.family).hf_mtp, prefix, embed,
                                lambda i, ours, theirs: block_tensor_maps(cfg, i, ours, theirs, norms, styles),
                                lambda names, **kw: norm_maps(cfg, names, **kw))
    return maps


def block_tensor_maps(cfg: ModelConfig, i: int, ours: str, theirs: str, norms: dict[str, str] = NORMS,
                      styles: dict[str, str] | None = None) -> list:
    """Layer i's block (tpzoo names under `ours`, e.g. "layers.3.", HF's under `theirs`): its token and channel
    mixer through their kinds' HF names, in the layout `styles[kind]` names, then its norms."""
    maps = []
    for part, kind in zip(("attn", "mlp"), layer_kinds(cfg, i)):
        if not hasattr(kind, "hf_tensor_maps"):
            raise ConfigError(f"{cfg.family}: layer {i}'s kind {kind.kind!r} has no Hugging Face names "
                              f"(hf_tensor_maps)")
        maps += kind.hf_tensor_maps(cfg, i, ours + part, theirs, (styles or {}).get(kind.kind))
    return maps + norm_maps(cfg, {ours + a: theirs + b for a, b in norms.items()}, layer=i)


def norm_maps(cfg: ModelConfig, names: dict[str, str], **kw) -> list:
    """tpzoo norm -> HF norm (full names, without .weight): the weight, and a LayerNorm's bias."""
    params = ("weight", "bias") if cfg.norm == "layernorm" else ("weight",)
    return [same(f"{ours}.{w}", f"{theirs}.{w}", **kw) for ours, theirs in names.items() for w in params]


def common_fields(hf: dict) -> dict:
    """ModelConfig keyword arguments (the model-wide ones) every Llama-shaped HF config spells the same way."""
    return dict(
        vocab_size=hf["vocab_size"], hidden_size=hf["hidden_size"], num_layers=hf["num_hidden_layers"],
        max_position_embeddings=hf.get("max_position_embeddings", 2048), norm="rmsnorm",
        norm_eps=hf.get("rms_norm_eps", 1e-6), position="rope", tie_embeddings=hf.get("tie_word_embeddings", False),
        initializer_range=hf.get("initializer_range", 0.02), bos_token_id=hf.get("bos_token_id"),
        eos_token_id=hf.get("eos_token_id"), pad_token_id=hf.get("pad_token_id"),
        # (a quantization_config describes the source's files, not the model tpzoo holds: tpzoo/checkpoint/hf.py)
        extra={"hf_config": {k: v for k, v in hf.items() if k != "quantization_config"}})


def common_attention(hf: dict) -> dict:
    """AttentionConfig keyword arguments every Llama-shaped HF config spells the same way: the heads."""
    return dict(num_heads=hf["num_attention_heads"],
                num_kv_heads=hf.get("num_key_value_heads") or hf["num_attention_heads"], head_dim=hf.get("head_dim"))


def common_to_hf(cfg: ModelConfig, model_type: str, architecture: str) -> dict:
    """The original HF dict (kept in extra) with every field the config owns overwritten."""
    hf = dict(cfg.extra.get("hf_config", {}))
    a = cfg.attention
    hf.update({
        "model_type": model_type, "architectures": [architecture], "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.hidden_size, "num_hidden_layers": cfg.num_layers, "num_attention_heads": a.num_heads,
        "num_key_value_heads": a.num_kv_heads, "intermediate_size": cfg.mlp.ffn_hidden_size,
        "max_position_embeddings": cfg.max_position_embeddings, "rms_norm_eps": cfg.norm_eps,
        "tie_word_embeddings": cfg.tie_embeddings, "initializer_range": cfg.initializer_range,
        "bos_token_id": cfg.bos_token_id, "eos_token_id": cfg.eos_token_id, "pad_token_id": cfg.pad_token_id,
    })
    if "head_dim" in hf or a.head_dim * a.num_heads != cfg.hidden_size:  # OLMo 2 configs have none
        hf["head_dim"] = a.head_dim
    if a.layer_types is not None:
        hf["layer_types"] = list(a.layer_types)
    return hf


def rope_to_hf(cfg: ModelConfig) -> dict:
    a = cfg.attention
    return {"rope_type": "default", **(a.rope_scaling or {}), "rope_theta": a.rope_theta}


def head_maps(cfg, prefix: str = "model.", embed: str = "embed_tokens", final_norm: str = "norm") -> list:
    """The final norm and the output head (a tied head is the embedding, not exported)."""
    head = (same("lm_head.weight", f"{prefix}{embed}.weight", vocab_dim=0, export=False) if cfg.tie_embeddings
            else same("lm_head.weight", "lm_head.weight", vocab_dim=0))
    return norm_maps(cfg, {"final_norm": prefix + final_norm}) + [head]


# -- DeepSeekMoE: DeepSeek-V3's and GLM-4.5's mixture of experts ------------------------------------------------

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


def mtp_notes(family: str, hf: dict) -> list[str]:
    """The one-line note of a family without a multi-token-prediction layout (Family.hf_mtp: models/mtp_hf.py) whose
    config counts such layers: they are not imported."""
    n = hf.get("num_nextn_predict_layers") or hf.get("num_mtp_layers") or 0
    if not n:
        return []
    first = hf["num_hidden_layers"]
    return [f"{family}: the {n} multi-token-prediction layer(s) (num_nextn_predict_layers; model.layers.{first}"
            f"{'-' + str(first + n - 1) if n > 1 else ''}.*, if present) are not imported (transformers drops them too)"]


# -- Multi-head latent attention's fields (DeepSeek-V3.2, GLM-5, GLM-4.7-Flash, Mistral Small 4) -------------------

def mla_fields(family: str, hf: dict, params: dict | None = None, interleave: bool | None = None) -> dict:
    """ModelConfig keyword arguments `attention` and `mla` of a DeepseekV3Config-shaped MLA config (rope read from
    `params`, default HF's rope_parameters; `interleave`: the rotary layout when the family fixes it, else HF's
    rope_interleave)."""
    theta, scaling = read_rope(family, hf, params, yarn=True)
    bias = bool(hf.get("attention_bias", False))
    return dict(
        # head_dim: the shared rotary key's width; the heads' own widths are MLA's
        attention=AttentionConfig(num_heads=hf["num_attention_heads"], head_dim=hf["qk_rope_head_dim"],
                                  qkv_bias=bias, out_bias=bias, rope_theta=theta, rope_scaling=scaling),
        mla=MLAConfig(kv_lora_rank=hf["kv_lora_rank"], qk_nope_head_dim=hf["qk_nope_head_dim"],
                      qk_rope_head_dim=hf["qk_rope_head_dim"], v_head_dim=hf["v_head_dim"],
                      q_lora_rank=hf.get("q_lora_rank"),
                      rope_interleave=bool(hf.get("rope_interleave", True)) if interleave is None else interleave))


def mla_to_hf(cfg: ModelConfig) -> dict:
    m, a = cfg.mla, cfg.attention
    return dict(kv_lora_rank=m.kv_lora_rank, q_lora_rank=m.q_lora_rank, qk_nope_head_dim=m.qk_nope_head_dim,
                qk_rope_head_dim=m.qk_rope_head_dim, v_head_dim=m.v_head_dim, attention_bias=a.qkv_bias)


def mlp_layer_kinds(family: str, hf: dict) -> list | None:
    """The channel mixers from HF's `mlp_layer_types` ("dense" / "sparse" per layer; None when absent)."""
    types = hf.get("mlp_layer_types")
    if types is None:
        return None
    if not set(types) <= {"dense", "sparse"}:
        raise refuse(family, "mlp_layer_types", sorted(set(types) - {"dense", "sparse"})[0], ["dense", "sparse"])
    if len(types) != hf["num_hidden_layers"]:
        raise ConfigError(f"{family}: HF config field mlp_layer_types has {len(types)} entries for "
                          f"{hf['num_hidden_layers']} layers")
    return ["moe" if t == "sparse" else "mlp" for t in types]
