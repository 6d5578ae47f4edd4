"""Megatron-LM's arguments <-> tpzoo's ModelConfig.

A Megatron-LM checkpoint saves the run's `args` (argparse.Namespace); `--megatron-args FILE` gives them for one
that does not (JSON or YAML, Megatron's argument names). Missing arguments take Megatron-LM's defaults (DEFAULTS),
and tensor shapes the arguments do not state (hidden size, layers, padded vocabulary) are read off the
tensors; everything is then checked against every tensor's shape (source.py), so a wrong argument fails in one
line instead of converting into a wrong model.

Read: GPT-style (LayerNorm, GeLU, learned absolute positions, biases: Megatron's default GPT) -> family gpt2;
Llama-style (RMSNorm, SwiGLU, RoPE, grouped-query attention, no biases) -> llama (qkv biases only: qwen2; every
linear biased: llama with attention and MLP biases); a mixture of experts on the Llama-style model (softmax router,
top-k) -> mixtral. Anything else is refused in one line naming the argument (tpzoo's checkpoints need a family for
their HF export). Megatron's GeLU is the tanh approximation when its fused bias-GeLU runs (add_bias_linear with
bias_gelu_fusion, both defaults), which is tpzoo's; without it Megatron uses the exact GeLU: refused.
"""
from __future__ import annotations

import json
import math
from pathlib import Path

from ..format import CheckpointError

DEFAULTS = {"normalization": "LayerNorm", "norm_epsilon": 1e-5, "position_embedding_type": "learned_absolute",
            "rotary_base": 10000, "rotary_percent": 1.0, "add_bias_linear": True, "add_qkv_bias": False,
            "swiglu": False, "untie_embeddings_and_output_weights": False, "make_vocab_size_divisible_by": 128,
            "bias_gelu_fusion": True, "moe_router_topk": 2, "moe_router_pre_softmax": False,
            "moe_router_score_function": "softmax", "moe_layer_freq": 1, "moe_aux_loss_coeff": 0.0,
            "init_method_std": 0.02, "max_position_embeddings": None}
LLAMA3_SCALING = {"rope_type": "llama3", "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                  "original_max_position_embeddings": 8192}  # Megatron-Core's fixed llama3 constants
# Arguments whose any value but these changes the model in a way tpzoo's mapping does not express.
_UNSUPPORTED = {"rotary_interleaved": (None, False), "qk_layernorm": (None, False), "squared_relu": (None, False),
                "quick_geglu": (None, False), "apply_residual_connection_post_layernorm": (None, False),
                "multi_latent_attention": (None, False), "window_size": (None,),
                "rotary_seq_len_interpolation_factor": (None, 1), "moe_shared_expert_intermediate_size": (None, 0),
                "moe_router_topk_scaling_factor": (None, 1, 1.0), "moe_router_enable_expert_bias": (None, False),
                "moe_router_num_groups": (None, 1), "heterogeneous_layers_config_path": (None,),
                "hybrid_override_pattern": (None,), "no_rope_freq": (None,), "qk_l2_norm": (None, False)}


def read_args_file(path) -> dict:
    """Megatron argument names -> values from a JSON or YAML file (`--megatron-args`)."""
    p = Path(path)
    if not p.is_file():
        raise FileNotFoundError(f"--megatron-args: no such file: {path}")
    text = p.read_text(encoding="utf-8")
    try:
        if p.suffix in (".yaml", ".yml"):
            import yaml

            data = yaml.safe_load(text)
        else:
            data = json.loads(text)
    except Exception as e:  # noqa: BLE001 - a parse error of either format
        raise CheckpointError(f"{path}: not valid {'YAML' if p.suffix in ('.yaml', '.yml') else 'JSON'}: "
                              f"{' '.join(str(e).split())[:200]}") from None
    if not isinstance(data, dict):
        raise CheckpointError(f"{path}: expected an object of Megatron argument names, got {type(data).__name__}")
    return {str(k).replace("-", "_").lstrip("_"): v for k, v in data.items()}


def resolved(args: dict) -> dict:
    """Defaults filled in and old spellings mapped to today's names."""
    a = {k: v for k, v in args.items() if v is not None}
    renames = {"layernorm_epsilon": "norm_epsilon", "num_moe_experts": "num_experts",
               "apply_layernorm_1p": "layernorm_zero_centered_gamma"}
    for old, new in renames.items():
        if old in a and new not in a:
            a[new] = a[old]
    if "disable_bias_linear" in a and "add_bias_linear" not in a:
        a["add_bias_linear"] = not a["disable_bias_linear"]
    if a.get("use_rotary_position_embeddings") and "position_embedding_type" not in a:
        a["position_embedding_type"] = "rope"
    if a.get("add_position_embedding") is False and a.get("position_embedding_type", "learned_absolute") == \
            "learned_absolute":
        a["position_embedding_type"] = "none"
    if a.get("gated_linear_unit") and not a.get("swiglu"):
        a["swiglu"] = True
    return {**DEFAULTS, **a}


def _refuse(what: str, why: str):
    raise CheckpointError(f"{what}: {why}")


def config_from_args(args: dict, inferred: dict, vocab_size: int | None, what: str):
    """(ModelConfig, family notes) of the model that Megatron-LM arguments describe. `inferred`: hidden_size,
    num_layers, padded_vocab_size, max_position_embeddings as the tensors show them (used where the arguments
    are silent). `vocab_size`: the real vocabulary (a tokenizer's), when the arguments do not say."""
    from tpzoo.models.config import AttentionConfig, MLPConfig, ModelConfig, MoEConfig

    a = resolved({**{k: v for k, v in inferred.items() if v is not None}, **args})
    for name, ok in _UNSUPPORTED.items():
        if a.get(name) not in ok:
            _refuse(what, f"{name}={a[name]!r} is not supported by tpzoo's Megatron import")
    if "num_attention_heads" not in a:
        _refuse(what, "the arguments lack num_attention_heads (the heads cannot be read off the tensors)")
    h, heads, layers = a["hidden_size"], a["num_attention_heads"], a["num_layers"]
    groups = a.get("num_query_groups") if a.get("group_query_attention") else heads
    head_dim = a.get("kv_channels") or h // heads
    norm = {"LayerNorm": "layernorm", "RMSNorm": "rmsnorm"}.get(a["normalization"])
    if norm is None:
        _refuse(what, f"normalization={a['normalization']!r} (tpzoo reads LayerNorm and RMSNorm)")
    if a.get("layernorm_zero_centered_gamma") and norm != "rmsnorm":
        _refuse(what, "a zero-centered LayerNorm (apply_layernorm_1p): tpzoo's (1 + weight) norm is RMSNorm only")
    bias, qkv_bias = bool(a["add_bias_linear"]), bool(a["add_bias_linear"] or a["add_qkv_bias"])
    if a["swiglu"]:
        activation = "swiglu"
    elif bias and a["bias_gelu_fusion"] and a.get("bias_activation_fusion", True):
        activation = "gelu_tanh"  # Megatron's fused bias-GeLU: the tanh approximation
    else:
        _refuse(what, "exact (erf) GeLU: without linear biases or with --no-bias-gelu-fusion Megatron-LM's GeLU is "
                      "F.gelu, and tpzoo implements the tanh approximation its fused bias-GeLU computes")
    position = {"learned_absolute": "learned", "rope": "rope"}.get(a["position_embedding_type"])
    if position is None:
        _refuse(what, f"position_embedding_type={a['position_embedding_type']!r} (tpzoo reads learned_absolute and "
                      f"rope)")
    # Megatron-LM's default: 4 h, or for SwiGLU 2/3 of it rounded down to a multiple of 64
    ffn = a.get("ffn_hidden_size") or (int(4 * h * 2 / 3 / 64) * 64 if a["swiglu"] else 4 * h)
    padded = a.get("padded_vocab_size")
    vocab = a.get("vocab_size") or vocab_size or padded
    if vocab > padded:
        _refuse(what, f"vocab_size {vocab} is larger than the checkpoint's padded vocabulary {padded}")
    rope_scaling = None
    if a.get("use_rope_scaling"):
        rope_scaling = {**LLAMA3_SCALING, "factor": float(a.get("rope_scaling_factor", 8.0))}
    moe = MoEConfig()
    channel_mixers = None
    experts = a.get("num_experts") or 0
    if experts:
        if a["moe_router_score_function"] != "softmax":
            _refuse(what, f"moe_router_score_function={a['moe_router_score_function']!r} (tpzoo reads softmax "
                          f"routers)")
        if bias:
            _refuse(what, "experts with biases (add_bias_linear with num_experts) are not read")
        moe = MoEConfig(num_experts=experts, num_experts_per_tok=a["moe_router_topk"],
                        ffn_hidden_size=a.get("moe_ffn_hidden_size") or ffn,
                        norm_topk_prob=not a["moe_router_pre_softmax"],
                        router_aux_loss_coef=float(_first(a["moe_aux_loss_coeff"]) or 0.0),
                        router_z_loss_coef=float(_first(a.get("moe_z_loss_coeff")) or 0.0))
        channel_mixers = ["moe" if f else "mlp" for f in _moe_pattern(a["moe_layer_freq"], layers, what)]
    cfg = ModelConfig(
        family="llama", vocab_size=vocab, hidden_size=h, num_layers=layers,
        attention=AttentionConfig(num_heads=heads, num_kv_heads=groups, head_dim=head_dim, qkv_bias=qkv_bias,
                                  out_bias=bias, rope_theta=float(a["rotary_base"]), rope_scaling=rope_scaling,
                                  partial_rotary_factor=float(a["rotary_percent"])),
        mlp=MLPConfig(ffn, activation=activation, bias=bias), moe=moe, channel_mixers=channel_mixers,
        max_position_embeddings=a.get("max_position_embeddings") or a.get("seq_length") or 4096, norm=norm,
        norm_eps=float(a["norm_epsilon"]), position=position,
        tie_embeddings=not a["untie_embeddings_and_output_weights"],
        norm_offset=bool(a.get("layernorm_zero_centered_gamma")), initializer_range=float(a["init_method_std"]))
    family = family_for(cfg)
    if family is None:
        _refuse(what, f"no tpzoo family has this shape ({describe(cfg)}); tpzoo reads GPT-style (LayerNorm, tanh "
                      f"GeLU, learned positions, biases), Llama-style (RMSNorm, SwiGLU, RoPE) and Mixtral-style "
                      f"mixtures of experts")
    return cfg.replace(family=family)


def _first(value):
    return value[0] if isinstance(value, (list, tuple)) else value


def _moe_pattern(freq, layers: int, what: str) -> list[int]:
    """Megatron's moe_layer_freq: N (every N-th layer, from layer 0) or a per-layer list of 0/1."""
    if isinstance(freq, int):
        return [int(i % freq == 0) for i in range(layers)]
    if isinstance(freq, str):  # as given on the command line: "([1]*3+[0])*2"
        import re

        if not re.fullmatch(r"[\[\]\(\)\d\s,+*]+", freq):
            _refuse(what, f"moe_layer_freq={freq!r} is not a list expression of 0/1")
        freq = eval(freq, {"__builtins__": {}})  # noqa: S307 - digits, brackets, + and * only (checked above)
    if not isinstance(freq, (list, tuple)) or len(freq) != layers:
        _refuse(what, f"moe_layer_freq={freq!r} does not give one entry per layer ({layers})")
    return [int(bool(f)) for f in freq]


def family_for(cfg) -> str | None:
    """The tpzoo family whose Hugging Face twin has exactly this shape, or None."""
    a, m = cfg.attention, cfg.mlp
    base = (cfg.pre_norm and not cfg.post_norm and a.qk_norm == "none" and a.scale is None and a.softcap is None
            and a.sliding_window is None and a.layer_types is None and a.rope_local_theta is None
            and a.rope_layers is None and not a.sinks and not a.output_gate and not cfg.embed_scale
            and cfg.final_softcap is None and cfg.mla is None and cfg.gated_deltanet is None and not cfg.norm_offset
            and set(cfg.token_mixers or ["attention"]) == {"attention"})
    if not base:
        return None
    llama_like = (cfg.norm == "rmsnorm" and m.activation == "swiglu" and cfg.position == "rope"
                  and a.partial_rotary_factor == 1.0)
    if cfg.moe.num_experts:
        moe = cfg.moe
        simple = (moe.router == "softmax" and moe.norm_topk_prob and not moe.shared_expert_ffn and not moe.expert_bias
                  and moe.swiglu_limit is None)
        return "mixtral" if llama_like and simple and not a.qkv_bias and not m.bias and (
            cfg.channel_mixers is None or set(cfg.channel_mixers) == {"moe"}) else None
    if llama_like:
        return {(False, False, False): "llama", (True, True, True): "llama",
                (True, False, False): "qwen2"}.get((a.qkv_bias, a.out_bias, m.bias))
    gpt2 = (cfg.norm == "layernorm" and m.activation == "gelu_tanh" and cfg.position == "learned" and a.qkv_bias
            and a.out_bias and m.bias and a.num_kv_heads == a.num_heads and a.head_dim * a.num_heads == cfg.hidden_size)
    return "gpt2" if gpt2 else None


def describe(cfg) -> str:
    a = cfg.attention
    bias = "biases" if cfg.mlp.bias else "qkv bias" if a.qkv_bias else "no biases"
    return (f"{cfg.norm}, {cfg.mlp.activation}, {cfg.position} positions, {bias}, {a.num_heads} heads / "
            f"{a.num_kv_heads} kv" + (f", {cfg.moe.num_experts} experts" if cfg.moe.num_experts else ""))


def padded_vocab(vocab: int, divisible_by: int, tp: int) -> int:
    """Megatron-LM's padding: up to a multiple of make_vocab_size_divisible_by * tp."""
    multiple = divisible_by * tp
    return math.ceil(vocab / multiple) * multiple


def args_from_config(cfg, *, tp: int, pp: int, ep: int, padded: int, divisible_by: int, dtype, impl: str,
                     base: dict | None = None) -> dict:
    """Megatron-LM arguments describing `cfg` at (tp, pp, ep); `base` (the arguments of the Megatron run the
    checkpoint came from) is kept for everything the model does not decide (sequence length, tokenizer, ...)."""
    import torch

    what = f"model {cfg.family} {cfg.name}".strip()
    if family_for(cfg) is None:
        _refuse(what, f"Megatron-Core's GPTModel has no equivalent of this model ({describe(cfg)} or a feature "
                      f"beyond them: q/k norms, post-norms, windows, soft-capping, ...)")
    a, m, moe = cfg.attention, cfg.mlp, cfg.moe
    if a.num_kv_heads % tp:
        _refuse(what, f"{a.num_kv_heads} kv heads at tp={tp}: Megatron needs num_query_groups divisible by tp")
    if cfg.num_layers % pp:
        _refuse(what, f"{cfg.num_layers} layers at pp={pp}: Megatron-LM splits layers evenly over the stages")
    if moe.num_experts and moe.num_experts % ep:
        _refuse(what, f"{moe.num_experts} experts at ep={ep}: not divisible")
    if ep > 1 and not moe.num_experts:
        _refuse(what, f"ep={ep} for a model without experts")
    scaling = a.rope_scaling
    if scaling and {k: v for k, v in scaling.items() if k != "factor"} != LLAMA3_SCALING:
        _refuse(what, f"rope scaling {scaling}: Megatron-Core's only RoPE scaling is llama3's with its fixed constants")
    out = dict(base or {})
    out.update(
        num_layers=cfg.num_layers, hidden_size=cfg.hidden_size, ffn_hidden_size=m.ffn_hidden_size,
        num_attention_heads=a.num_heads, group_query_attention=a.num_kv_heads != a.num_heads,
        num_query_groups=a.num_kv_heads, kv_channels=a.head_dim,
        max_position_embeddings=cfg.max_position_embeddings,
        position_embedding_type="rope" if cfg.position == "rope" else "learned_absolute",
        add_position_embedding=cfg.position == "learned", use_rotary_position_embeddings=cfg.position == "rope",
        rotary_base=int(a.rope_theta) if float(a.rope_theta).is_integer() else a.rope_theta,
        rotary_percent=a.partial_rotary_factor, rotary_interleaved=False,
        use_rope_scaling=bool(scaling), rope_scaling_factor=float(scaling["factor"]) if scaling else 8.0,
        normalization="RMSNorm" if cfg.norm == "rmsnorm" else "LayerNorm", norm_epsilon=cfg.norm_eps,
        layernorm_zero_centered_gamma=False, apply_layernorm_1p=False, qk_layernorm=False,
        add_bias_linear=m.bias, add_qkv_bias=a.qkv_bias, swiglu=m.activation == "swiglu", squared_relu=False,
        bias_gelu_fusion=m.activation == "gelu_tanh", untie_embeddings_and_output_weights=not cfg.tie_embeddings,
        apply_residual_connection_post_layernorm=False,
        padded_vocab_size=padded, vocab_size=cfg.vocab_size, make_vocab_size_divisible_by=divisible_by,
        tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp, expert_model_parallel_size=ep,
        expert_tensor_parallel_size=tp if moe.num_experts else None, virtual_pipeline_model_parallel_size=None,
        num_layers_per_virtual_pipeline_stage=None, decoder_first_pipeline_num_layers=None,
        decoder_last_pipeline_num_layers=None,
        params_dtype=dtype, bf16=dtype == torch.bfloat16, fp16=dtype == torch.float16,
        ckpt_format="torch_dist", use_dist_ckpt=True, transformer_impl=impl, init_method_std=cfg.initializer_range,
        num_experts=moe.num_experts or None, mtp_num_layers=None)
    out.setdefault("seq_length", min(cfg.max_position_embeddings, 4096))
    out.setdefault("attention_dropout", 0.0)
    out.setdefault("hidden_dropout", 0.0)
    if moe.num_experts:
        out.update(moe_router_topk=moe.num_experts_per_tok, moe_ffn_hidden_size=cfg.expert_ffn,
                   moe_router_pre_softmax=False, moe_router_score_function="softmax", moe_layer_freq=1,
                   moe_grouped_gemm=False, moe_shared_expert_intermediate_size=None,
                   moe_aux_loss_coeff=moe.router_aux_loss_coef, moe_z_loss_coeff=moe.router_z_loss_coef or None)
    return out


def recorded_args(args: dict) -> dict:
    """The arguments as JSON-safe values (kept in the tpzoo checkpoint's metadata for the way back)."""
    return {k: v for k, v in ((k, plain(v)) for k, v in sorted(args.items())) if v is not None}


def plain(value):
    """A JSON-safe copy of an argument value: numbers, strings, lists, dicts; None for anything else (an enum,
    a Megatron class, a path: kept out rather than written back as something it was not)."""
    if value is None or type(value) in (bool, int, float, str):
        return value
    if type(value) in (list, tuple):
        return [plain(v) for v in value]
    if type(value) is dict:
        return {str(k): plain(v) for k, v in value.items()}
    return None
