"""Tiny random DeepSeek-V3.2, GLM-5, GLM-4.7-Flash and Mistral Small 4 models written by transformers' own
save_pretrained (no downloads), for tests/test_dsa_*.py: every feature their configs switch on, at shapes a CPU runs in
milliseconds, with index_topk (5) below the sequence lengths the tests use (12 and more), so the sparse mask acts.

    deepseek_v32   DeepSeek Sparse Attention on every layer (8 indexer heads of 8 dims, the indexer's half-split rotary
                   under MLA's interleaved one), YaRN with mscale != mscale_all_dim, a dense first layer, n_group 4 /
                   topk_group 2, a shared expert, a random selection bias
    glm_moe_dsa    GLM-5: the indexer's interleaved rotary, indexer_types full / shared / full / shared (the shared
                   layers hold no indexer), one group
    glm4_moe_lite  GLM-4.7-Flash: MLA without a query latent (q_proj), the half-split rotary (rope_interleave false),
                   GLM's sigmoid router, mlp_layer_types dense / sparse
    mistral4       Mistral Small 4: MLA with YaRN (original context 4, so the test's positions reach the stretched
                   range) and Llama 4's query temperature (llama_4_scaling_beta), the softmax router with a shared
                   expert, the experts stacked as transformers 5 stores them
Weights are drawn so that no mapping mistake hides: norms and biases off their defaults, routers large, the indexer's
projections large enough that its choices differ from the nearest keys (and ties between its scores improbable: 8
heads, each score a sum of 8 ReLUs).
"""
from __future__ import annotations

import torch

VOCAB = 61  # divisible by neither 2 nor 4: the vocab padding is exercised
KINDS = ("deepseek_v32", "glm_moe_dsa", "glm4_moe_lite", "mistral4")
TOPK = 5
YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 8,
        "mscale": 1.0, "mscale_all_dim": 0.8, "beta_fast": 32, "beta_slow": 1}


def hf_config(kind: str, vocab: int = VOCAB):
    import transformers as tf

    common = dict(vocab_size=vocab, hidden_size=32, num_attention_heads=4, max_position_embeddings=64,
                  num_key_value_heads=4, num_experts_per_tok=2, bos_token_id=None, eos_token_id=None, pad_token_id=None,
                  tie_word_embeddings=False, intermediate_size=40, moe_intermediate_size=16, n_routed_experts=8,
                  n_shared_experts=1, kv_lora_rank=16, qk_rope_head_dim=4, qk_nope_head_dim=8, v_head_dim=6)
    dsa = dict(index_topk=TOPK, index_n_heads=8, index_head_dim=8, q_lora_rank=12, first_k_dense_replace=1)
    if kind == "deepseek_v32":
        return tf.DeepseekV32Config(**common, **dsa, num_hidden_layers=3, n_group=4, topk_group=2,
                                    routed_scaling_factor=2.5, rope_parameters=YARN)
    if kind == "glm_moe_dsa":
        return tf.GlmMoeDsaConfig(**common, **dsa, num_hidden_layers=4, n_group=1, topk_group=1,
                                  routed_scaling_factor=1.5, index_topk_freq=2, index_skip_topk_offset=1)
    if kind == "glm4_moe_lite":
        return tf.Glm4MoeLiteConfig(**common, num_hidden_layers=2, q_lora_rank=None, rope_interleave=False,
                                    n_group=2, topk_group=1, routed_scaling_factor=1.8)
    rope = {**YARN, "factor": 8.0, "original_max_position_embeddings": 4, "llama_4_scaling_beta": 0.3,
            "partial_rotary_factor": 4 / 12}
    return tf.Mistral4Config(**common, num_hidden_layers=2, q_lora_rank=12, first_k_dense_replace=1,
                             rope_parameters=rope)


def make_hf_model(kind: str, vocab: int = VOCAB, seed: int = 0):
    import transformers as tf

    cls = {"deepseek_v32": tf.DeepseekV32ForCausalLM, "glm_moe_dsa": tf.GlmMoeDsaForCausalLM,
           "glm4_moe_lite": tf.Glm4MoeLiteForCausalLM, "mistral4": tf.Mistral4ForCausalLM}[kind]
    torch.manual_seed(seed)
    model = cls(hf_config(kind, vocab))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias") or "norm" in name:
                p.add_(torch.randn_like(p) * 0.2)
            if name.endswith("mlp.gate.weight"):
                p.normal_(std=1.0)  # confident, uneven routing
            if "experts" in name and p.dim() == 3:  # transformers leaves the fused expert tensors at zero
                p.normal_(std=0.3)
            if name.endswith("embed_tokens.weight") or name == "lm_head.weight":  # logits of order 1
                p.normal_(std=0.5)
            if "self_attn" in name and name.endswith("proj.weight"):  # scores of order 1
                p.normal_(std=0.3)
            if ".indexer." in name and name.endswith("weight") and "norm" not in name:
                p.normal_(std=0.5)  # the indexer's choices far from "the nearest keys"
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(torch.randn(b.shape) * 0.3)
    return model.eval()
