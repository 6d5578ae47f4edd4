"""Tiny random Hugging Face models written by transformers' own save_pretrained (no downloads)."""
from __future__ import annotations

import torch

VOCAB = 101  # divisible by neither 2 nor 4: the vocab padding is always exercised

ROPE31 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 16}


# The hybrid families (tests/test_models_hybrid.py): 3 Gated DeltaNet layers and 1 gated attention layer (4 key /
# 8 value heads: tp 2 x cp 2 splits them), or OLMo 3's 3 sliding layers (window 8) and 1 full one.
HYBRID = dict(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
              head_dim=16, linear_num_key_heads=4, linear_num_value_heads=8, linear_key_head_dim=8,
              linear_value_head_dim=8, max_position_embeddings=256, pad_token_id=None, bos_token_id=None,
              eos_token_id=None, initializer_range=0.1)  # weights large enough that every part changes the loss
HYBRID_MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16, shared_expert_intermediate_size=24)


def use_torch_gated_delta() -> None:
    """transformers routes its torch gated-delta functions to flash-linear-attention when fla is installed, even
    for CPU tensors: the oracle is its own torch code (the undecorated functions), in every hybrid family."""
    import importlib
    import inspect

    for name in ("qwen3_5", "qwen3_5_moe", "qwen3_next", "kimi_linear"):
        module = importlib.import_module(f"transformers.models.{name}.modeling_{name}")
        fns = (("chunk_kimi_delta_attention", "recurrent_kimi_delta_attention") if name == "kimi_linear" else
               ("torch_chunk_gated_delta_rule", "torch_recurrent_gated_delta_rule"))
        for fn in fns:
            setattr(module, fn, inspect.unwrap(getattr(module, fn)))


# Kimi Linear (tests/test_models_hybrid.py, tests/test_kimi_linear.py): 3 Kimi Delta Attention layers (4 heads of 8:
# tp 2 x cp 2 splits them) and a NoPE latent attention layer; a dense first layer, then DeepSeek's MoE (sigmoid
# router with a random selection bias, a shared expert)
KIMI_LINEAR = dict(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=4,
                   kv_lora_rank=16, q_lora_rank=None, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=8,
                   intermediate_size=48, moe_intermediate_size=16, num_local_experts=4, num_experts_per_tok=2,
                   n_shared_experts=1, linear_num_heads=4, linear_head_dim=8, max_position_embeddings=256,
                   layer_types=["linear_attention"] * 3 + ["full_attention"], pad_token_id=None, bos_token_id=None,
                   eos_token_id=None, initializer_range=0.1)


def hub_names(path) -> None:
    """A Kimi Linear directory written by save_pretrained in the hub's names: transformers writes a dense layer's MLP
    under block_sparse_moe. (its load-time renaming reversed), the hub's checkpoints under mlp. (transformers reads
    both)."""
    import json
    import re
    from pathlib import Path

    from safetensors.torch import load_file, save_file

    rename = lambda n: re.sub(r"block_sparse_moe\.(gate|up|down)_proj", r"mlp.\1_proj", n)  # noqa: E731
    for f in Path(path).glob("*.safetensors"):
        save_file({rename(k): v for k, v in load_file(f).items()}, str(f), metadata={"format": "pt"})
    index = Path(path) / "model.safetensors.index.json"
    if index.exists():
        data = json.loads(index.read_text())
        data["weight_map"] = {rename(k): v for k, v in data["weight_map"].items()}
        index.write_text(json.dumps(data))


def _hybrid(kind: str):
    import transformers as tf

    use_torch_gated_delta()
    if kind == "qwen3_5":
        return tf.Qwen3_5TextConfig(**HYBRID, intermediate_size=48), tf.Qwen3_5ForCausalLM
    if kind == "qwen3_5_moe":
        return tf.Qwen3_5MoeTextConfig(**HYBRID, **HYBRID_MOE), tf.Qwen3_5MoeForCausalLM
    if kind == "kimi_linear":
        return tf.KimiLinearConfig(**KIMI_LINEAR), tf.KimiLinearForCausalLM
    if kind == "qwen3_next":  # layer 1 keeps a dense MLP (mlp_only_layers)
        return tf.Qwen3NextConfig(**HYBRID, **HYBRID_MOE, intermediate_size=48, mlp_only_layers=[1]), \
            tf.Qwen3NextForCausalLM
    # OLMo 3: sliding layers with their own rope base, YaRN on the full one (as OLMo-3-7B: factor 8 from 8192; here
    # from 32 of its 256 positions, so the test's 70-token texts reach the interpolated range)
    kw = {k: v for k, v in HYBRID.items() if not k.startswith("linear_") and k != "head_dim"}
    rope = {"full_attention": {"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 32,
                               "beta_fast": 32.0, "beta_slow": 1.0, "attention_factor": 1.2079441541679836,
                               "rope_theta": 1e5},
            "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}}
    return tf.Olmo3Config(**kw, intermediate_size=48, sliding_window=8, rope_parameters=rope), tf.Olmo3ForCausalLM


HYBRID_KINDS = ("qwen3_5", "qwen3_5_moe", "qwen3_next", "olmo3", "kimi_linear")


def make_hf_model(kind: str):
    import transformers as tf

    common = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                  num_attention_heads=8, max_position_embeddings=128)
    if kind == "gpt2":
        cfg = tf.GPT2Config(vocab_size=VOCAB, n_embd=64, n_layer=2, n_head=4, n_positions=128,
                            resid_pdrop=0, embd_pdrop=0, attn_pdrop=0)
        cls = tf.GPT2LMHeadModel
    elif kind == "llama":  # GQA with 2 kv heads: replicated at tp=4
        cfg = tf.LlamaConfig(**common, num_key_value_heads=2, rope_theta=10000.0)
        cls = tf.LlamaForCausalLM
    elif kind == "llama31-tied":  # Llama 3.1 rope scaling + tied head (Llama 3.2 style)
        cfg = tf.LlamaConfig(**common, num_key_value_heads=4, tie_word_embeddings=True,
                             rope_parameters={**ROPE31, "rope_theta": 500000.0})
        cls = tf.LlamaForCausalLM
    elif kind == "mistral":  # sliding window shorter than the test sequence
        cfg = tf.MistralConfig(**common, num_key_value_heads=4, sliding_window=8)
        cls = tf.MistralForCausalLM
    elif kind == "qwen2":  # q/k/v biases; multi-query (1 kv head)
        cfg = tf.Qwen2Config(**common, num_key_value_heads=1)
        cls = tf.Qwen2ForCausalLM
    elif kind == "qwen3":  # per-head q/k norms; head_dim 16 independent of hidden/heads; tied; kv replicated at tp=4
        cfg = tf.Qwen3Config(**common, num_key_value_heads=2, head_dim=16, tie_word_embeddings=True)
        cls = tf.Qwen3ForCausalLM
    elif kind == "olmo2":  # post-norms only; q/k norms over the whole width (2 kv heads: replicated at tp=4)
        cfg = tf.Olmo2Config(**common, num_key_value_heads=2, pad_token_id=None, eos_token_id=None)
        cls = tf.Olmo2ForCausalLM
    elif kind == "gemma2":  # (1 + w) norms, GeGLU, sqrt(h) embedding scale, both soft-caps (small enough to bite),
        # query_pre_attn_scalar != head_dim, layers alternate sliding (window 8) and full attention
        cfg = tf.Gemma2Config(**common, num_key_value_heads=2, head_dim=16, query_pre_attn_scalar=24,
                              sliding_window=8, attn_logit_softcapping=0.02, final_logit_softcapping=0.5,
                              pad_token_id=0, eos_token_id=1, bos_token_id=2)
        cls = tf.Gemma2ForCausalLM
    elif kind == "gemma3":  # + per-head (1 + w) q/k norms, a local rope base, linear rope scaling on global layers
        cfg = tf.Gemma3TextConfig(**common, num_key_value_heads=2, head_dim=16, query_pre_attn_scalar=24,
                                  sliding_window=8, layer_types=["sliding_attention", "full_attention"],
                                  rope_parameters={
                                      "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6},
                                      "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}},
                                  pad_token_id=0, eos_token_id=1, bos_token_id=2)
        cls = tf.Gemma3ForCausalLM
    elif kind == "smollm3":  # layer 1 without rope (NoPE), tied head
        cfg = tf.SmolLM3Config(**common, num_key_value_heads=2, no_rope_layers=[1, 0], pad_token_id=None,
                               bos_token_id=None, eos_token_id=None)
        cls = tf.SmolLM3ForCausalLM
    elif kind == "phi3":  # fused qkv_proj / gate_up_proj, partial rotary (Phi-4-mini's kind), a sliding window of 8
        cfg = tf.Phi3Config(**common, num_key_value_heads=2, sliding_window=8, tie_word_embeddings=True,
                            rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                             "partial_rotary_factor": 0.5},
                            pad_token_id=None, bos_token_id=None, eos_token_id=None)
        cls = tf.Phi3ForCausalLM
    elif kind in HYBRID_KINDS:
        cfg, cls = _hybrid(kind)
    else:
        raise ValueError(kind)
    torch.manual_seed(0)
    model = cls(cfg).eval()
    with torch.no_grad():  # random biases and norm weights, so a mapping mistake cannot hide behind zeros/ones
        for name, p in model.named_parameters():
            if name.endswith("bias") or "norm" in name or "ln_" in name:
                p.add_(torch.randn_like(p) * 0.1)
            if "shared_expert_gate" in name:
                p.mul_(5.0)  # a gate that matters: the shared expert's sigmoid away from 1/2
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(torch.randn(b.shape) * 0.3)  # a selection bias large enough to change the choices
    return model


def save_hf_model(kind: str, path, max_shard_size=None):
    model = make_hf_model(kind)
    kw = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(path, **kw)
    if kind == "kimi_linear":
        hub_names(path)
    return model
