"""Tiny random DeepSeek-V3, GLM-4.5 and gpt-oss models written by transformers' own save_pretrained (no downloads),
for tests/test_frontier_*.py: every feature the families' configs switch on, at shapes a CPU runs in milliseconds.

    deepseek_v3     q_lora_rank set (with attention biases), YaRN with mscale != mscale_all_dim (the rotary's
                    attention factor and the softmax scale's mscale^2 both bite), interleaved rotary, v_head_dim !=
                    qk_head_dim, n_group 4 / topk_group 2, a dense first layer of its own size, 2 shared experts,
                    routed_scaling_factor, a random non-zero e_score_correction_bias
    deepseek_v3_noq q_lora_rank null (one q_proj), no biases, plain rope
    glm4_moe        GQA, partial rotary (0.5), q/k norms, q/k/v biases, 2 groups, a dense first layer, 1 shared expert
    gpt_oss         (hidden and expert sizes 32: one MXFP4 block per row) sinks, a window of 4 on alternate layers (shorter than the text), q/k/v/o biases, YaRN, the
                    biased router, expert biases and the clamped SwiGLU
Weights are drawn so that no mapping mistake hides: norms and biases off their defaults, routers large (uneven,
confident routing), selection biases and sinks random.
"""
from __future__ import annotations

import torch

VOCAB = 61  # divisible by neither 2 nor 4: the vocab padding is exercised
KINDS = ("deepseek_v3", "deepseek_v3_noq", "glm4_moe", "gpt_oss")
YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 8,
        "mscale": 1.0, "mscale_all_dim": 0.8, "beta_fast": 32, "beta_slow": 1}


def hf_config(kind: str, vocab: int = VOCAB, layers: int = 2):
    import transformers as tf

    common = dict(vocab_size=vocab, hidden_size=32, num_hidden_layers=layers, num_attention_heads=4,
                  max_position_embeddings=32, num_experts_per_tok=2, bos_token_id=None, eos_token_id=None,
                  pad_token_id=None, tie_word_embeddings=False)
    if kind.startswith("deepseek_v3"):
        q = kind == "deepseek_v3"
        return tf.DeepseekV3Config(**common, intermediate_size=40, moe_intermediate_size=16, n_routed_experts=8,
                                   n_group=4, topk_group=2, first_k_dense_replace=1, n_shared_experts=2,
                                   routed_scaling_factor=2.5, kv_lora_rank=16, q_lora_rank=12 if q else None,
                                   qk_rope_head_dim=4, qk_nope_head_dim=8, v_head_dim=6, attention_bias=q,
                                   rope_parameters=YARN if q else {"rope_type": "default", "rope_theta": 10000.0})
    if kind == "glm4_moe":
        return tf.Glm4MoeConfig(**common, num_key_value_heads=2, head_dim=8, intermediate_size=40,
                                moe_intermediate_size=16, n_routed_experts=8, n_group=2, topk_group=1,
                                first_k_dense_replace=1, n_shared_experts=1, routed_scaling_factor=1.5,
                                use_qk_norm=True, attention_bias=True)
    return tf.GptOssConfig(**common, num_key_value_heads=2, head_dim=8, intermediate_size=32, num_local_experts=8,
                           sliding_window=4, rope_parameters={**YARN, "truncate": False, "mscale": None,
                                                              "mscale_all_dim": None})


def make_hf_model(kind: str, vocab: int = VOCAB, seed: int = 0, layers: int = 2):
    import transformers as tf

    cls = {"deepseek_v3": tf.DeepseekV3ForCausalLM, "deepseek_v3_noq": tf.DeepseekV3ForCausalLM,
           "glm4_moe": tf.Glm4MoeForCausalLM, "gpt_oss": tf.GptOssForCausalLM}[kind]
    torch.manual_seed(seed)
    model = cls(hf_config(kind, vocab, layers))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias") or "norm" in name or name.endswith("sinks"):
                p.add_(torch.randn_like(p) * 0.2)
            if name.endswith("mlp.gate.weight") or name.endswith("mlp.router.weight"):
                p.normal_(std=1.0)  # confident, uneven routing
            if "experts" in name and p.dim() == 3:  # transformers leaves the fused expert tensors at zero
                p.normal_(std=0.3)
            if name.endswith("embed_tokens.weight") or name == "lm_head.weight":  # logits of order 1: every
                p.normal_(std=0.5)                                                # layer's output reaches the loss
            if "self_attn" in name and name.endswith("proj.weight"):  # scores of order 1: the softmax's scale,
                p.normal_(std=0.3)                                      # sinks and windows all matter
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(torch.randn(b.shape) * 0.3)  # large enough to change the choices
    return model.eval()
