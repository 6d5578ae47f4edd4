"""What the 2024-25 families share when reading and writing Hugging Face configs and tensors: checked reads of
the fields a family does not implement every value of (each refusal names the HF field), and the tensor map of
a Llama-shaped decoder (separate q/k/v and gate/up/down projections) with the family's own norm names."""
from __future__ import annotations

from tpzoo.errors import ConfigError

from ..config import LAYER_TYPES, ModelConfig
from ..hf_mapping import concatenated, same
from ..kinds.rotary import ROPE_TYPES  # what the rotary tables implement


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


def decoder_tensor_map(cfg: ModelConfig, norms: dict[str, str], moe_maps=None, token_maps=None,
                       prefix: str = "model.") -> list:
    """Map of a decoder whose HF layers are model.layers.{i}.self_attn.{q,k,v,o}_proj (+ q_norm, k_norm) and
    mlp.{gate,up,down}_proj; `norms`: tpzoo norm name -> HF module name within the layer. `moe_maps(cfg, i, p, q)`
    maps the channel mixer of a mixture-of-experts layer (models/moe_families.py), `token_maps(cfg, i, p, q)` the
    token mixer of a layer whose kind is not softmax attention (a Gated DeltaNet's); `prefix` is where HF keeps the
    decoder ("model.", or a multimodal checkpoint's "model.language_model.")."""
    a = cfg.attention
    hd = a.head_dim
    q_rows = a.num_heads * hd * (2 if a.output_gate else 1)  # a gated q_proj holds each head's query and gate
    qkv_sizes = (q_rows, a.num_kv_heads * hd, a.num_kv_heads * hd)
    ffn = cfg.mlp.ffn_hidden_size
    maps = [same("embed.weight", prefix + "embed_tokens.weight", vocab_dim=0)]
    for i in range(cfg.num_layers):
        p, q = f"layers.{i}.", f"{prefix}layers.{i}."
        attention = cfg.token_mixer(i) == "attention"
        proj = tuple(q + f"self_attn.{n}_proj" for n in "qkv")
        if attention:
            maps += [
                concatenated(p + "attn.qkv.weight", tuple(n + ".weight" for n in proj), qkv_sizes, layer=i),
                same(p + "attn.out.weight", q + "self_attn.o_proj.weight", layer=i),
            ]
        else:
            maps += token_maps(cfg, i, p, q)
        if cfg.channel_mixer(i) == "moe":
            maps += moe_maps(cfg, i, p, q)
        else:
            maps += [concatenated(p + "mlp.fc_in.weight", (q + "mlp.gate_proj.weight", q + "mlp.up_proj.weight"),
                                  (ffn, ffn), layer=i),
                     same(p + "mlp.fc_out.weight", q + "mlp.down_proj.weight", layer=i)]
        maps += [same(p + ours + ".weight", q + theirs + ".weight", layer=i) for ours, theirs in norms.items()]
        if attention and a.qk_norm != "none":
            maps += [same(p + f"attn.{n}_norm.weight", q + f"self_attn.{n}_norm.weight", layer=i) for n in "qk"]
        if attention and a.qkv_bias:
            maps.append(concatenated(p + "attn.qkv.bias", tuple(n + ".bias" for n in proj), qkv_sizes, layer=i))
        if attention and a.out_bias:
            maps.append(same(p + "attn.out.bias", q + "self_attn.o_proj.bias", layer=i))
        if attention and a.sinks:
            maps.append(same(p + "attn.sinks", q + "self_attn.sinks", layer=i))
    return maps + head_maps(cfg, prefix)


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


def head_maps(cfg, prefix: str = "model.") -> list:
    """The final norm and the output head of a Llama-shaped HF model (a tied head is the embedding, not exported)."""
    head = (same("lm_head.weight", prefix + "embed_tokens.weight", vocab_dim=0, export=False) if cfg.tie_embeddings
            else same("lm_head.weight", "lm_head.weight", vocab_dim=0))
    return [same("final_norm.weight", prefix + "norm.weight"), head]
