"""Kimi Linear (`KimiLinearForCausalLM`: moonshotai/Kimi-Linear-48B-A3B-Base and -Instruct, 48B parameters, 3B
active): Kimi Delta Attention layers (token mixer "kimi_delta", models/kinds/kimi_delta.py) with a multi-head latent
attention layer after every three (token mixer "mla" without rotary positions: `position` "none", its rope part of
q and of the shared key unrotated, softmax scale qk_head_dim^-0.5), and DeepSeek-V3's mixture of experts (the sigmoid
router with its selection bias, routed_scaling_factor, shared experts) after a dense first layer.

Config: the hub's config.json (`linear_attn_config`: 1-based `kda_layers` / `full_attn_layers`, `num_heads`,
`head_dim`, `short_conv_kernel_size`; `first_k_dense_replace`) or what transformers' save_pretrained writes (its
`layer_types`, `mlp_layer_types`, `linear_num_heads`, `linear_head_dim`, `linear_conv_kernel_dim`), read with
transformers' precedence; both spell the MoE `num_experts`, `num_experts_per_token`, `num_shared_experts`,
`moe_renormalize`, `num_expert_group` and the context `model_max_length`. to-hf writes the source's own spelling
back (a config built here: save_pretrained's).
HF names: model.layers.{i}.self_attn.* (models/kinds/kimi_delta_hf.py, mla_hf.py); a dense layer's
mlp.{gate,up,down}_proj; a MoE layer's block_sparse_moe.* (models/kinds/moe_hf.py's "kimi" layout). The hub's
checkpoints name a dense layer mlp.*; transformers' save_pretrained renames it block_sparse_moe.*, which
`convert from-hf` does not read (rename those tensors, or convert from the hub's files).
Refused by field (one line each): an activation other than silu, a router other than sigmoid
(`moe_router_activation_func`), rotary MLA (`mla_use_nope` false: transformers runs every released checkpoint
NoPE), `moe_layer_freq` other than 1, Kimi K3's bounded gate (`linear_attn_config.gate_lower_bound`), a layer in
neither list of linear_attn_config. Multi-token-prediction layers, if a config lists them, are not imported.
"""
from __future__ import annotations

from tpzoo.errors import ConfigError

from ..config import AttentionConfig, KimiDeltaConfig, MLAConfig, MLPConfig, ModelConfig, MoEConfig
from ..registry import Family, register_config, register_family
from .hf_common import LINEAR_ATTENTION, check, common_fields, common_to_hf, decoder_tensor_map, mtp_notes, refuse

FAMILY = "kimi_linear"
TYPES = ("full_attention", LINEAR_ATTENTION)
# (JSON name, transformers' attribute name) of the fields KimiLinearConfig's attribute_map renames
ALIASES = {"max_position_embeddings": ("model_max_length", "max_position_embeddings"),
           "num_experts": ("num_experts", "num_local_experts"),
           "top_k": ("num_experts_per_token", "num_experts_per_tok"),
           "shared": ("num_shared_experts", "n_shared_experts"),
           "renormalize": ("moe_renormalize", "norm_topk_prob"),
           "groups": ("num_expert_group", "n_group")}
KDA_FIELDS = (("num_heads", "linear_num_heads", 32), ("head_dim", "linear_head_dim", 128),
              ("short_conv_kernel_size", "linear_conv_kernel_dim", 4))


def _get(hf: dict, key: str, default=None):
    names = ALIASES[key]
    return next((hf[n] for n in names if hf.get(n) is not None), default)


def _layer_types(hf: dict, n: int) -> list:
    """transformers' precedence: layer_types; else linear_attn_config's 1-based lists; else its default pattern."""
    linear = hf.get("linear_attn_config") or {}
    types = hf.get("layer_types")
    if types is None and "full_attn_layers" in linear and "kda_layers" in linear:
        types = [None] * n
        for layer in linear["full_attn_layers"]:
            types[layer - 1] = "full_attention"
        for layer in linear["kda_layers"]:
            types[layer - 1] = LINEAR_ATTENTION
    elif types is None:
        types = ["full_attention" if i and i % 4 == 0 else LINEAR_ATTENTION for i in range(n)]
    if len(types) != n:
        raise ConfigError(f"{FAMILY}: HF config field layer_types has {len(types)} entries for {n} layers")
    unknown = [t for t in types if t not in TYPES]
    if unknown:
        raise refuse(FAMILY, "layer_types" if "layer_types" in hf else "linear_attn_config", unknown[0], list(TYPES))
    return list(types)


def _dense_layers(hf: dict, n: int) -> list:
    """Which layers keep a dense MLP: mlp_layer_types, else the first `first_k_dense_replace` (default 1)."""
    types = hf.get("mlp_layer_types")
    if types is None:
        first = hf.get("first_k_dense_replace", 1)
        types = ["dense" if i < first else "sparse" for i in range(n)]
    if len(types) != n or not set(types) <= {"dense", "sparse"}:
        raise refuse(FAMILY, "mlp_layer_types", types, "one of 'dense' / 'sparse' per layer")
    return [t == "dense" for t in types]


def config_from_hf(hf: dict) -> ModelConfig:
    for field, allowed, default in (("hidden_act", ("silu",), "silu"), ("moe_router_activation_func", ("sigmoid",),
                                    "sigmoid"), ("mla_use_nope", (True,), True), ("moe_layer_freq", (1,), 1)):
        check(FAMILY, hf, field, allowed, default)
    linear = hf.get("linear_attn_config") or {}
    if linear.get("gate_lower_bound") is not None:
        raise refuse(FAMILY, "linear_attn_config.gate_lower_bound", linear["gate_lower_bound"], [None])
    n = hf["num_hidden_layers"]
    kda = KimiDeltaConfig(*(linear.get(key, hf.get(attr, default)) for key, attr, default in KDA_FIELDS))
    moe_ffn = hf["moe_intermediate_size"]
    moe = MoEConfig(num_experts=_get(hf, "num_experts"), num_experts_per_tok=_get(hf, "top_k"),
                    ffn_hidden_size=moe_ffn, norm_topk_prob=bool(_get(hf, "renormalize", True)), router="sigmoid",
                    n_group=_get(hf, "groups", 1), topk_group=hf.get("topk_group") or 1,
                    routed_scaling_factor=float(hf.get("routed_scaling_factor", 2.446)),
                    shared_expert_ffn=_get(hf, "shared", 0) * moe_ffn, router_aux_loss_coef=0.0,
                    output_router_logits=bool(hf.get("output_router_logits", False)))
    bias = bool(hf.get("attention_bias", False))
    fields = common_fields(hf)
    fields.update(max_position_embeddings=_get(hf, "max_position_embeddings", 1048576), position="none")
    return ModelConfig(
        family=FAMILY, **fields,
        # head_dim: the shared key's width (transformers' head_dim, as DeepSeek-V3's)
        attention=AttentionConfig(num_heads=hf["num_attention_heads"], head_dim=hf["qk_rope_head_dim"],
                                  qkv_bias=bias, out_bias=bias),
        mla=MLAConfig(kv_lora_rank=hf["kv_lora_rank"], qk_nope_head_dim=hf["qk_nope_head_dim"],
                      qk_rope_head_dim=hf["qk_rope_head_dim"], v_head_dim=hf["v_head_dim"],
                      q_lora_rank=hf.get("q_lora_rank")),
        kimi_delta=kda, mlp=MLPConfig(hf["intermediate_size"], activation="swiglu"), moe=moe,
        token_mixers=["kimi_delta" if t == LINEAR_ATTENTION else "mla" for t in _layer_types(hf, n)],
        channel_mixers=["mlp" if dense else "moe" for dense in _dense_layers(hf, n)])


def _put(hf: dict, key: str, value) -> None:
    """Set an aliased field under the name the source used (a config built here: the JSON name)."""
    names = ALIASES[key]
    hf[next((n for n in names if n in hf), names[0])] = value


def config_to_hf(cfg: ModelConfig) -> dict:
    hf = common_to_hf(cfg, FAMILY, "KimiLinearForCausalLM")
    base, m, moe, kda = cfg.extra.get("hf_config", {}), cfg.mla, cfg.moe, cfg.kimi_delta
    hf.pop("max_position_embeddings")
    _put(hf, "max_position_embeddings", cfg.max_position_embeddings)
    hf["head_dim"] = base.get("head_dim", m.qk_rope_head_dim)  # the hub's says hidden / heads, transformers' rope
    hf.update(hidden_act="silu", kv_lora_rank=m.kv_lora_rank, q_lora_rank=m.q_lora_rank,
              qk_nope_head_dim=m.qk_nope_head_dim, qk_rope_head_dim=m.qk_rope_head_dim, v_head_dim=m.v_head_dim,
              attention_bias=cfg.attention.qkv_bias, moe_intermediate_size=cfg.expert_ffn, topk_group=moe.topk_group,
              routed_scaling_factor=moe.routed_scaling_factor, output_router_logits=moe.output_router_logits)
    for key, value in (("num_experts", moe.num_experts), ("top_k", moe.num_experts_per_tok),
                       ("shared", moe.shared_expert_ffn // cfg.expert_ffn), ("renormalize", moe.norm_topk_prob),
                       ("groups", moe.n_group)):
        _put(hf, key, value)
    types = [LINEAR_ATTENTION if cfg.token_mixer(i) == "kimi_delta" else "full_attention"
             for i in range(cfg.num_layers)]
    dense = [cfg.channel_mixer(i) == "mlp" for i in range(cfg.num_layers)]
    if "linear_attn_config" in base:  # the hub's spelling, 1-based layer lists
        hf["linear_attn_config"] = {
            **base["linear_attn_config"], "num_heads": kda.num_heads, "head_dim": kda.head_dim,
            "short_conv_kernel_size": kda.conv_kernel,
            "kda_layers": [i + 1 for i, t in enumerate(types) if t == LINEAR_ATTENTION],
            "full_attn_layers": [i + 1 for i, t in enumerate(types) if t != LINEAR_ATTENTION]}
    if "linear_attn_config" not in base or "layer_types" in base:  # transformers' spelling
        hf.update(layer_types=types, linear_num_heads=kda.num_heads, linear_head_dim=kda.head_dim,
                  linear_conv_kernel_dim=kda.conv_kernel)
    if "mlp_layer_types" in base or "first_k_dense_replace" not in base or dense != sorted(dense, reverse=True):
        hf["mlp_layer_types"] = ["dense" if d else "sparse" for d in dense]
    else:
        hf["first_k_dense_replace"] = sum(dense)
    return hf


register_family(Family(name=FAMILY, hf_model_types=(FAMILY,), hf_architecture="KimiLinearForCausalLM",
                       config_from_hf=config_from_hf, config_to_hf=config_to_hf,
                       hf_tensor_map=lambda cfg: decoder_tensor_map(cfg, styles={"moe": "kimi"}),
                       import_notes=lambda hf: mtp_notes(FAMILY, hf)))


# Named configs: the hub's config.json numbers (Base and Instruct share them). The nano cut: the same layer pattern
# at toy widths for CPU runs (tp 2 x cp 2 splits its KDA heads).
def _kimi_linear(name: str, *, vocab: int, h: int, layers: int, heads: int, ffn: int, moe_ffn: int, experts: int,
                 top_k: int, kv_lora: int, nope: int, rope: int, v: int, kda: KimiDeltaConfig, full: list,
                 src: str = "", pos: int = 1048576, **tokens) -> None:
    register_config(name, ModelConfig(
        family=FAMILY, vocab_size=vocab, hidden_size=h, num_layers=layers,
        attention=AttentionConfig(num_heads=heads, head_dim=rope),
        mla=MLAConfig(kv_lora_rank=kv_lora, qk_nope_head_dim=nope, qk_rope_head_dim=rope, v_head_dim=v),
        kimi_delta=kda, mlp=MLPConfig(ffn),
        moe=MoEConfig(num_experts=experts, num_experts_per_tok=top_k, ffn_hidden_size=moe_ffn, router="sigmoid",
                      routed_scaling_factor=2.446, shared_expert_ffn=moe_ffn, router_aux_loss_coef=0.0),
        token_mixers=["mla" if i in full else "kimi_delta" for i in range(layers)],
        channel_mixers=["mlp"] + ["moe"] * (layers - 1), max_position_embeddings=pos, norm_eps=1e-5, position="none",
        hf_source=src, **tokens))


_kimi_linear("kimi-linear-48b-a3b", vocab=163840, h=2304, layers=27, heads=32, ffn=9216, moe_ffn=1024, experts=256,
             top_k=8, kv_lora=512, nope=128, rope=64, v=128, kda=KimiDeltaConfig(num_heads=32, head_dim=128),
             full=[3, 7, 11, 15, 19, 23, 26], bos_token_id=163584, eos_token_id=163586, pad_token_id=163839,
             src="moonshotai/Kimi-Linear-48B-A3B-Instruct")
_kimi_linear("nano-kimi-linear", vocab=97, h=32, layers=4, heads=4, ffn=64, moe_ffn=16, experts=4, top_k=2,
             kv_lora=16, nope=8, rope=4, v=8, kda=KimiDeltaConfig(num_heads=4, head_dim=8), full=[3], pos=256)
