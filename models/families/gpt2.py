"""GPT-2: learned positions, LayerNorm, biases everywhere, tanh GeLU, tied embeddings, HF Conv1D weights."""
from __future__ import annotations

from tpzoo.errors import ConfigError

from ..config import AttentionConfig, MLPConfig, ModelConfig
from ..registry import Family, register_family
from .hf_common import decoder_tensor_map


def config_from_hf(hf: dict) -> ModelConfig:
    h = hf["n_embd"]
    act = hf.get("activation_function", "gelu_new")
    if act not in ("gelu_new", "gelu_pytorch_tanh", "gelu_fast"):
        raise ConfigError(f"GPT-2 with activation {act!r} is not supported (tpzoo implements the tanh GeLU)")
    return ModelConfig(
        family="gpt2", vocab_size=hf["vocab_size"], hidden_size=h, num_layers=hf["n_layer"],
        attention=AttentionConfig(num_heads=hf["n_head"], qkv_bias=True, out_bias=True),
        mlp=MLPConfig(hf.get("n_inner") or 4 * h, activation="gelu_tanh", bias=True),
        max_position_embeddings=hf.get("n_positions", 1024), norm="layernorm",
        norm_eps=hf.get("layer_norm_epsilon", 1e-5), position="learned",
        tie_embeddings=hf.get("tie_word_embeddings", True),
        initializer_range=hf.get("initializer_range", 0.02), bos_token_id=hf.get("bos_token_id"),
        eos_token_id=hf.get("eos_token_id"), pad_token_id=hf.get("pad_token_id"),
        extra={"hf_config": hf},
    )


def config_to_hf(cfg: ModelConfig) -> dict:
    hf = dict(cfg.extra.get("hf_config", {}))
    hf.update({
        "model_type": "gpt2", "architectures": ["GPT2LMHeadModel"], "vocab_size": cfg.vocab_size,
        "n_embd": cfg.hidden_size, "n_layer": cfg.num_layers, "n_head": cfg.attention.num_heads,
        "n_inner": None if cfg.mlp.ffn_hidden_size == 4 * cfg.hidden_size else cfg.mlp.ffn_hidden_size,
        "n_positions": cfg.max_position_embeddings, "layer_norm_epsilon": cfg.norm_eps,
        "activation_function": hf.get("activation_function", "gelu_new"), "tie_word_embeddings": cfg.tie_embeddings,
        "initializer_range": cfg.initializer_range, "bos_token_id": cfg.bos_token_id,
        "eos_token_id": cfg.eos_token_id,
    })
    if cfg.pad_token_id is not None:
        hf["pad_token_id"] = cfg.pad_token_id
    return hf


def hf_tensor_map(cfg: ModelConfig) -> list:
    """transformer.h.{i}: attention and MLP as Conv1D weights ([in, out]), LayerNorms ln_1 / ln_2 with biases."""
    return decoder_tensor_map(cfg, {"attn_norm": "ln_1", "mlp_norm": "ln_2"}, {"attention": "conv1d", "mlp": "conv1d"},
                              prefix="transformer.", embed="wte", layers="h", final_norm="ln_f", positions="wpe")


register_family(Family(name="gpt2", hf_model_types=("gpt2",), hf_architecture="GPT2LMHeadModel",
                       config_from_hf=config_from_hf, config_to_hf=config_to_hf, hf_tensor_map=hf_tensor_map,
                       hf_conv1d=True))
