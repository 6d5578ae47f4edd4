"""Named configs: published shapes (with the HF repository each comes from) and tiny ones for tests/demos."""
from __future__ import annotations

from .config import (AttentionConfig, GatedDeltaNetConfig, MLAConfig, MLPConfig, ModelConfig, MoEConfig,
                     SparseMLAConfig)
from .registry import CONFIGS, register_config

GPT2_MLP = dict(activation="gelu_tanh", bias=True)


def _gpt2(name, h, layers, heads, src):
    register_config(name, ModelConfig(
        family="gpt2", vocab_size=50257, hidden_size=h, num_layers=layers,
        attention=AttentionConfig(num_heads=heads, qkv_bias=True, out_bias=True),
        mlp=MLPConfig(4 * h, **GPT2_MLP), max_position_embeddings=1024, norm="layernorm", norm_eps=1e-5,
        position="learned", tie_embeddings=True, bos_token_id=50256, eos_token_id=50256, hf_source=src))


_gpt2("gpt2", 768, 12, 12, "openai-community/gpt2")
_gpt2("gpt2-medium", 1024, 24, 16, "openai-community/gpt2-medium")
_gpt2("gpt2-large", 1280, 36, 20, "openai-community/gpt2-large")
_gpt2("gpt2-xl", 1600, 48, 25, "openai-community/gpt2-xl")

LLAMA31_SCALING = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                   "original_max_position_embeddings": 8192}
LLAMA32_SCALING = {**LLAMA31_SCALING, "factor": 32.0}


def _llama(name, family="llama", *, vocab, h, layers, heads, kv, ffn, pos, theta=10000.0, eps=1e-5, tied=False,
           scaling=None, head_dim=None, qkv_bias=False, window=None, src=""):
    register_config(name, ModelConfig(
        family=family, vocab_size=vocab, hidden_size=h, num_layers=layers,
        attention=AttentionConfig(num_heads=heads, num_kv_heads=kv, head_dim=head_dim, rope_theta=theta,
                                  rope_scaling=scaling, qkv_bias=qkv_bias, sliding_window=window),
        mlp=MLPConfig(ffn), max_position_embeddings=pos, norm="rmsnorm", norm_eps=eps, position="rope",
        tie_embeddings=tied, hf_source=src))


_llama("llama-2-7b", vocab=32000, h=4096, layers=32, heads=32, kv=32, ffn=11008, pos=4096,
       src="meta-llama/Llama-2-7b-hf")
_llama("llama-2-13b", vocab=32000, h=5120, layers=40, heads=40, kv=40, ffn=13824, pos=4096,
       src="meta-llama/Llama-2-13b-hf")
_llama("llama-2-70b", vocab=32000, h=8192, layers=80, heads=64, kv=8, ffn=28672, pos=4096,
       src="meta-llama/Llama-2-70b-hf")
_llama("llama-3-8b", vocab=128256, h=4096, layers=32, heads=32, kv=8, ffn=14336, pos=8192, theta=500000.0,
       src="meta-llama/Meta-Llama-3-8B")
_llama("llama-3-70b", vocab=128256, h=8192, layers=80, heads=64, kv=8, ffn=28672, pos=8192, theta=500000.0,
       src="meta-llama/Meta-Llama-3-70B")
_llama("llama-3.1-8b", vocab=128256, h=4096, layers=32, heads=32, kv=8, ffn=14336, pos=131072, theta=500000.0,
       scaling=LLAMA31_SCALING, src="meta-llama/Llama-3.1-8B")
_llama("llama-3.1-70b", vocab=128256, h=8192, layers=80, heads=64, kv=8, ffn=28672, pos=131072, theta=500000.0,
       scaling=LLAMA31_SCALING, src="meta-llama/Llama-3.1-70B")
_llama("llama-3.1-405b", vocab=128256, h=16384, layers=126, heads=128, kv=8, ffn=53248, pos=131072,
       theta=500000.0, scaling=LLAMA31_SCALING, src="meta-llama/Llama-3.1-405B")
_llama("llama-3.2-1b", vocab=128256, h=2048, layers=16, heads=32, kv=8, ffn=8192, pos=131072, theta=500000.0,
       scaling=LLAMA32_SCALING, tied=True, head_dim=64, src="meta-llama/Llama-3.2-1B")
_llama("llama-3.2-3b", vocab=128256, h=3072, layers=28, heads=24, kv=8, ffn=8192, pos=131072, theta=500000.0,
       scaling=LLAMA32_SCALING, tied=True, head_dim=128, src="meta-llama/Llama-3.2-3B")
_llama("tinyllama-1.1b", vocab=32000, h=2048, layers=22, heads=32, kv=4, ffn=5632, pos=2048,
       src="TinyLlama/TinyLlama-1.1B-intermediate-step-1431k-3T")
_llama("mistral-7b", "mistral", vocab=32000, h=4096, layers=32, heads=32, kv=8, ffn=14336, pos=32768, window=4096,
       src="mistralai/Mistral-7B-v0.1")
for _n, _v, _h, _l, _heads, _kv, _ffn, _tied in (
        ("0.5b", 151936, 896, 24, 14, 2, 4864, True), ("1.5b", 151936, 1536, 28, 12, 2, 8960, True),
        ("3b", 151936, 2048, 36, 16, 2, 11008, True), ("7b", 152064, 3584, 28, 28, 4, 18944, False),
        ("14b", 152064, 5120, 48, 40, 8, 13824, False), ("32b", 152064, 5120, 64, 40, 8, 27648, False),
        ("72b", 152064, 8192, 80, 64, 8, 29568, False)):
    _llama(f"qwen2.5-{_n}", "qwen2", vocab=_v, h=_h, layers=_l, heads=_heads, kv=_kv, ffn=_ffn, pos=32768,
           theta=1000000.0, eps=1e-6, tied=_tied, qkv_bias=True, src=f"Qwen/Qwen2.5-{_n.upper()}")

def _qwen3(size, *, h, layers, heads, ffn, tied):
    register_config(f"qwen3-{size}", ModelConfig(
        family="qwen3", vocab_size=151936, hidden_size=h, num_layers=layers,
        attention=AttentionConfig(num_heads=heads, num_kv_heads=8, head_dim=128, rope_theta=1000000.0,
                                  qk_norm="head"),
        mlp=MLPConfig(ffn), max_position_embeddings=40960, norm_eps=1e-6, tie_embeddings=tied,
        bos_token_id=151643, eos_token_id=151645, hf_source=f"Qwen/Qwen3-{size.upper()}"))


_qwen3("0.6b", h=1024, layers=28, heads=16, ffn=3072, tied=True)
_qwen3("1.7b", h=2048, layers=28, heads=16, ffn=6144, tied=True)
_qwen3("4b", h=2560, layers=36, heads=32, ffn=9728, tied=True)
_qwen3("8b", h=4096, layers=36, heads=32, ffn=12288, tied=False)
_qwen3("14b", h=5120, layers=40, heads=40, ffn=17408, tied=False)
_qwen3("32b", h=5120, layers=64, heads=64, ffn=25600, tied=False)


def _olmo2(name, *, h, layers, heads, kv, ffn, src):
    register_config(name, ModelConfig(
        family="olmo2", vocab_size=100352, hidden_size=h, num_layers=layers,
        attention=AttentionConfig(num_heads=heads, num_kv_heads=kv, rope_theta=500000.0, qk_norm="full"),
        mlp=MLPConfig(ffn), max_position_embeddings=4096, norm_eps=1e-6, pre_norm=False, post_norm=True,
        eos_token_id=100257, pad_token_id=100277, hf_source=src))


_olmo2("olmo-2-1b", h=2048, layers=16, heads=16, kv=16, ffn=8192, src="allenai/OLMo-2-0425-1B")
_olmo2("olmo-2-7b", h=4096, layers=32, heads=32, kv=32, ffn=11008, src="allenai/OLMo-2-1124-7B")
_olmo2("olmo-2-13b", h=5120, layers=40, heads=40, kv=40, ffn=13824, src="allenai/OLMo-2-1124-13B")
_olmo2("olmo-2-32b", h=5120, layers=64, heads=40, kv=8, ffn=27648, src="allenai/OLMo-2-0325-32B")


def _gemma(name, family, *, vocab, h, layers, heads, kv, head_dim, ffn, scalar, window, pos, every, src,
           final_softcap=None, **attention):
    register_config(name, ModelConfig(
        family=family, vocab_size=vocab, hidden_size=h, num_layers=layers,
        attention=AttentionConfig(
            num_heads=heads, num_kv_heads=kv, head_dim=head_dim, sliding_window=window, scale=scalar,
            layer_types=["sliding_attention" if (i + 1) % every else "full_attention" for i in range(layers)],
            **attention),
        mlp=MLPConfig(ffn, activation="geglu_tanh"), max_position_embeddings=pos, norm_eps=1e-6,
        tie_embeddings=True, pre_norm=True, post_norm=True, norm_offset=True, embed_scale=True,
        final_softcap=final_softcap, bos_token_id=2, eos_token_id=1, pad_token_id=0, hf_source=src))


_GEMMA2 = dict(vocab=256000, window=4096, pos=8192, every=2, softcap=50.0, final_softcap=30.0)
_gemma("gemma-2-2b", "gemma2", h=2304, layers=26, heads=8, kv=4, head_dim=256, ffn=9216, scalar=256,
       src="google/gemma-2-2b", **_GEMMA2)
_gemma("gemma-2-9b", "gemma2", h=3584, layers=42, heads=16, kv=8, head_dim=256, ffn=14336, scalar=256,
       src="google/gemma-2-9b", **_GEMMA2)
_gemma("gemma-2-27b", "gemma2", h=4608, layers=46, heads=32, kv=16, head_dim=128, ffn=36864, scalar=144,
       src="google/gemma-2-27b", **_GEMMA2)
_GEMMA3 = dict(every=6, qk_norm="head", rope_theta=1000000.0, rope_local_theta=10000.0)
_LINEAR8 = {"rope_type": "linear", "factor": 8.0}  # the 4B-27B global layers: 128K context
_gemma("gemma-3-1b", "gemma3", vocab=262144, h=1152, layers=26, heads=4, kv=1, head_dim=256, ffn=6912, scalar=256,
       window=512, pos=32768, src="google/gemma-3-1b-pt", **_GEMMA3)
_gemma("gemma-3-4b", "gemma3", vocab=262208, h=2560, layers=34, heads=8, kv=4, head_dim=256, ffn=10240, scalar=256,
       window=1024, pos=131072, rope_scaling=_LINEAR8, src="google/gemma-3-4b-pt", **_GEMMA3)
_gemma("gemma-3-12b", "gemma3", vocab=262208, h=3840, layers=48, heads=16, kv=8, head_dim=256, ffn=15360,
       scalar=256, window=1024, pos=131072, rope_scaling=_LINEAR8, src="google/gemma-3-12b-pt", **_GEMMA3)
_gemma("gemma-3-27b", "gemma3", vocab=262208, h=5376, layers=62, heads=32, kv=16, head_dim=128, ffn=21504,
       scalar=168, window=1024, pos=131072, rope_scaling=_LINEAR8, src="google/gemma-3-27b-pt", **_GEMMA3)


# SmolLM2: Llama-shaped (the llama family); SmolLM3: Llama-shaped with no rope on every 4th layer (its own family).
_llama("smollm2-135m", vocab=49152, h=576, layers=30, heads=9, kv=3, ffn=1536, pos=8192, theta=100000.0, tied=True,
       src="HuggingFaceTB/SmolLM2-135M")
_llama("smollm2-360m", vocab=49152, h=960, layers=32, heads=15, kv=5, ffn=2560, pos=8192, theta=100000.0, tied=True,
       src="HuggingFaceTB/SmolLM2-360M")
_llama("smollm2-1.7b", vocab=49152, h=2048, layers=24, heads=32, kv=32, ffn=8192, pos=8192, theta=130000.0,
       tied=True, src="HuggingFaceTB/SmolLM2-1.7B")
register_config("smollm3-3b", ModelConfig(
    family="smollm3", vocab_size=128256, hidden_size=2048, num_layers=36,
    attention=AttentionConfig(num_heads=16, num_kv_heads=4, rope_theta=5000000.0,
                              rope_layers=[int((i + 1) % 4 != 0) for i in range(36)]),
    mlp=MLPConfig(11008), max_position_embeddings=65536, norm_eps=1e-6, tie_embeddings=True,
    hf_source="HuggingFaceTB/SmolLM3-3B-Base"))

def _phi(name, *, vocab, h, layers, heads, kv, ffn, pos, theta=10000.0, window=None, tied=False, partial=1.0, src):
    register_config(name, ModelConfig(
        family="phi3", vocab_size=vocab, hidden_size=h, num_layers=layers,
        attention=AttentionConfig(num_heads=heads, num_kv_heads=kv, rope_theta=theta, sliding_window=window,
                                  partial_rotary_factor=partial),
        mlp=MLPConfig(ffn), max_position_embeddings=pos, norm_eps=1e-5, tie_embeddings=tied, hf_source=src))


# Phi-3 (4K context checkpoints: their 128K siblings use LongRoPE, which tpzoo refuses) and Phi-4. Phi-4-mini's
# checkpoint uses LongRoPE as well: this config has its shapes at the 4K context it was pretrained at.
_phi("phi-3-mini", vocab=32064, h=3072, layers=32, heads=32, kv=32, ffn=8192, pos=4096, window=2047,
     src="microsoft/Phi-3-mini-4k-instruct")
_phi("phi-3-medium", vocab=32064, h=5120, layers=40, heads=40, kv=10, ffn=17920, pos=4096, window=2047,
     src="microsoft/Phi-3-medium-4k-instruct")
_phi("phi-4-mini", vocab=200064, h=3072, layers=32, heads=24, kv=8, ffn=8192, pos=4096, tied=True, partial=0.75,
     src="microsoft/Phi-4-mini-instruct")
_phi("phi-4", vocab=100352, h=5120, layers=40, heads=40, kv=10, ffn=17920, pos=16384, theta=250000.0,
     src="microsoft/phi-4")

# Tiny configs for tests and demos (no HF source): small enough to train on a laptop CPU.
GPT2_ATTENTION = dict(qkv_bias=True, out_bias=True)
register_config("tiny-gpt", ModelConfig(
    family="gpt2", vocab_size=512, hidden_size=128, num_layers=4, attention=AttentionConfig(4, **GPT2_ATTENTION),
    mlp=MLPConfig(512, **GPT2_MLP), max_position_embeddings=256, norm="layernorm", position="learned",
    tie_embeddings=True))
register_config("tiny-llama", ModelConfig(
    family="llama", vocab_size=512, hidden_size=128, num_layers=4, attention=AttentionConfig(4, num_kv_heads=2),
    mlp=MLPConfig(352), max_position_embeddings=512))
register_config("nano-gpt", ModelConfig(
    family="gpt2", vocab_size=97, hidden_size=32, num_layers=2, attention=AttentionConfig(4, **GPT2_ATTENTION),
    mlp=MLPConfig(128, **GPT2_MLP), max_position_embeddings=64, norm="layernorm", position="learned",
    tie_embeddings=True))
register_config("nano-llama", ModelConfig(
    family="llama", vocab_size=97, hidden_size=32, num_layers=2, attention=AttentionConfig(4, num_kv_heads=2),
    mlp=MLPConfig(64), max_position_embeddings=64))

# Mixtures of experts (models/kinds/moe.py). `tpzoo models` shows total and active (per token) parameters.
def _mixtral(name, *, vocab, h, layers, heads, ffn, pos, src):
    register_config(name, ModelConfig(
        family="mixtral", vocab_size=vocab, hidden_size=h, num_layers=layers,
        attention=AttentionConfig(num_heads=heads, num_kv_heads=8, rope_theta=1000000.0), mlp=MLPConfig(ffn),
        moe=MoEConfig(num_experts=8, num_experts_per_tok=2, router_aux_loss_coef=0.02),
        max_position_embeddings=pos, norm_eps=1e-5, bos_token_id=1, eos_token_id=2, hf_source=src))


_mixtral("mixtral-8x7b", vocab=32000, h=4096, layers=32, heads=32, ffn=14336, pos=32768,
         src="mistralai/Mixtral-8x7B-v0.1")
_mixtral("mixtral-8x22b", vocab=32768, h=6144, layers=56, heads=48, ffn=16384, pos=65536,
         src="mistralai/Mixtral-8x22B-v0.1")


def _qwen3_moe(size, *, h, layers, heads, ffn, moe_ffn):
    register_config(f"qwen3-{size}", ModelConfig(
        family="qwen3_moe", vocab_size=151936, hidden_size=h, num_layers=layers,
        attention=AttentionConfig(num_heads=heads, num_kv_heads=4, head_dim=128, rope_theta=1000000.0,
                                  qk_norm="head"),
        mlp=MLPConfig(ffn), moe=MoEConfig(num_experts=128, num_experts_per_tok=8, ffn_hidden_size=moe_ffn,
                                          norm_topk_prob=True, router_aux_loss_coef=0.001),
        max_position_embeddings=40960, norm_eps=1e-6, bos_token_id=151643, eos_token_id=151645,
        hf_source=f"Qwen/Qwen3-{size.upper()}"))


_qwen3_moe("30b-a3b", h=2048, layers=48, heads=32, ffn=6144, moe_ffn=768)
_qwen3_moe("235b-a22b", h=4096, layers=94, heads=64, ffn=12288, moe_ffn=1536)
# Benchmark config (no checkpoint): Qwen3-30B-A3B's layer shapes with 8 of its 48 layers, so one GPU trains it
# (scripts/bench/moe.py --device cuda).
register_config("qwen3-30b-a3b-8l", CONFIGS["qwen3-30b-a3b"].replace(num_layers=8, hf_source=None))
register_config("olmoe-1b-7b", ModelConfig(
    family="olmoe", vocab_size=50304, hidden_size=2048, num_layers=16, attention=AttentionConfig(16, qk_norm="full"),
    mlp=MLPConfig(1024), moe=MoEConfig(num_experts=64, num_experts_per_tok=8, norm_topk_prob=False,
                                       router_aux_loss_coef=0.01),
    max_position_embeddings=4096, norm_eps=1e-5, eos_token_id=50279, pad_token_id=1,
    hf_source="allenai/OLMoE-1B-7B-0924"))
TINY_MOE = MoEConfig(num_experts=4, num_experts_per_tok=2, router_aux_loss_coef=0.02, output_router_logits=True)
register_config("tiny-mixtral", ModelConfig(
    family="mixtral", vocab_size=512, hidden_size=128, num_layers=4, attention=AttentionConfig(4, num_kv_heads=2),
    mlp=MLPConfig(256), moe=TINY_MOE, max_position_embeddings=512))
register_config("nano-mixtral", ModelConfig(
    family="mixtral", vocab_size=97, hidden_size=32, num_layers=2, attention=AttentionConfig(4, num_kv_heads=2),
    mlp=MLPConfig(32), moe=TINY_MOE, max_position_embeddings=64))



# The frontier mixtures of experts (models/deepseek_v3.py, glm4_moe.py, gpt_oss.py), with their HF configs' numbers.
DEEPSEEK_MLA = dict(kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128)


def _deepseek(name, *, vocab, h, layers, heads, ffn, moe_ffn, experts, shared, top_k, groups, topk_groups, dense,
              scaling, q_lora, pos, theta, yarn=None, eps=1e-6, bos=None, eos=None, mla=DEEPSEEK_MLA, src=""):
    register_config(name, ModelConfig(
        family="deepseek_v3", vocab_size=vocab, hidden_size=h, num_layers=layers,
        attention=AttentionConfig(num_heads=heads, head_dim=mla["qk_rope_head_dim"], rope_theta=theta,
                                  rope_scaling=yarn),
        mla=MLAConfig(**mla, q_lora_rank=q_lora),
        mlp=MLPConfig(ffn), moe=MoEConfig(num_experts=experts, num_experts_per_tok=top_k, ffn_hidden_size=moe_ffn,
                                          router="sigmoid", n_group=groups, topk_group=topk_groups,
                                          routed_scaling_factor=scaling, shared_expert_ffn=shared * moe_ffn),
        token_mixers=["mla"] * layers, channel_mixers=["mlp"] * dense + ["moe"] * (layers - dense),
        max_position_embeddings=pos, norm_eps=eps, bos_token_id=bos, eos_token_id=eos, hf_source=src))


def _yarn(factor, beta_fast, beta_slow=1.0, original=4096):
    return {"rope_type": "yarn", "factor": factor, "original_max_position_embeddings": original,
            "beta_fast": beta_fast, "beta_slow": beta_slow, "mscale": 1.0, "mscale_all_dim": 1.0}


_deepseek("deepseek-v3", vocab=129280, h=7168, layers=61, heads=128, ffn=18432, moe_ffn=2048, experts=256, shared=1,
          top_k=8, groups=8, topk_groups=4, dense=3, scaling=2.5, q_lora=1536, pos=163840, theta=10000.0,
          yarn=_yarn(40.0, 32.0), bos=0, eos=1, src="deepseek-ai/DeepSeek-V3")
_deepseek("kimi-k2", vocab=163840, h=7168, layers=61, heads=64, ffn=18432, moe_ffn=2048, experts=384, shared=1,
          top_k=8, groups=1, topk_groups=1, dense=1, scaling=2.827, q_lora=1536, pos=131072, theta=50000.0,
          yarn=_yarn(32.0, 1.0), bos=163584, eos=163585, src="moonshotai/Kimi-K2-Instruct")
_deepseek("moonlight-16b-a3b", vocab=163840, h=2048, layers=27, heads=16, ffn=11264, moe_ffn=1408, experts=64,
          shared=2, top_k=6, groups=1, topk_groups=1, dense=1, scaling=2.446, q_lora=None, pos=8192, theta=50000.0,
          eps=1e-5, bos=163584, eos=163585, src="moonshotai/Moonlight-16B-A3B")
# Benchmark config (no checkpoint): Moonlight's layer shapes with 4 of its 27 layers (scripts/bench/moe.py on a GPU).
register_config("moonlight-16b-a3b-4l", CONFIGS["moonlight-16b-a3b"].replace(
    num_layers=4, token_mixers=["mla"] * 4, channel_mixers=["mlp"] + ["moe"] * 3, hf_source=None))


def _glm(name, *, h, layers, ffn, moe_ffn, experts, dense, scaling, qk_norm, vocab=151552, heads=96, kv=8,
         head_dim=128, groups=1, topk_groups=1, pos=131072, eos=(151329, 151336, 151338), pad=151329, src=""):
    register_config(name, ModelConfig(
        family="glm4_moe", vocab_size=vocab, hidden_size=h, num_layers=layers,
        attention=AttentionConfig(num_heads=heads, num_kv_heads=kv, head_dim=head_dim, qkv_bias=True,
                                  qk_norm="head" if qk_norm else "none", rope_theta=1000000.0,
                                  partial_rotary_factor=0.5),
        mlp=MLPConfig(ffn), moe=MoEConfig(num_experts=experts, num_experts_per_tok=8 if experts > 8 else 2,
                                          ffn_hidden_size=moe_ffn, router="sigmoid", n_group=groups,
                                          topk_group=topk_groups, routed_scaling_factor=scaling,
                                          shared_expert_ffn=moe_ffn),
        channel_mixers=["mlp"] * dense + ["moe"] * (layers - dense), max_position_embeddings=pos, norm_eps=1e-5,
        eos_token_id=list(eos) if eos else None, pad_token_id=pad, hf_source=src))


_glm("glm-4.5", h=5120, layers=92, ffn=12288, moe_ffn=1536, experts=160, dense=3, scaling=2.5, qk_norm=True,
     src="zai-org/GLM-4.5")
_glm("glm-4.5-air", h=4096, layers=46, ffn=10944, moe_ffn=1408, experts=128, dense=1, scaling=1.0, qk_norm=False,
     src="zai-org/GLM-4.5-Air")

GPT_OSS_YARN = {"rope_type": "yarn", "factor": 32.0, "original_max_position_embeddings": 4096, "beta_fast": 32.0,
                "beta_slow": 1.0, "truncate": False}


def _gpt_oss(name, *, layers, experts, vocab=201088, h=2880, heads=64, kv=8, head_dim=64, window=128, pos=131072,
             yarn=GPT_OSS_YARN, eos=200002, pad=199999, src=""):
    register_config(name, ModelConfig(
        family="gpt_oss", vocab_size=vocab, hidden_size=h, num_layers=layers,
        attention=AttentionConfig(num_heads=heads, num_kv_heads=kv, head_dim=head_dim, qkv_bias=True, out_bias=True,
                                  sinks=True, sliding_window=window, rope_theta=150000.0, rope_scaling=yarn,
                                  layer_types=["sliding_attention" if i % 2 == 0 else "full_attention"
                                               for i in range(layers)]),
        mlp=MLPConfig(h), moe=MoEConfig(num_experts=experts, num_experts_per_tok=4, router="topk_softmax",
                                        router_bias=True, expert_bias=True, swiglu_limit=7.0,
                                        router_aux_loss_coef=0.001),
        max_position_embeddings=pos, norm_eps=1e-5, eos_token_id=eos, pad_token_id=pad, hf_source=src))


_gpt_oss("gpt-oss-20b", layers=24, experts=32, src="openai/gpt-oss-20b")
_gpt_oss("gpt-oss-120b", layers=36, experts=128, src="openai/gpt-oss-120b")

# Small trainable cuts of each family (CPU demos and tests): every feature of the family at tiny shapes (DeepSeek:
# q_lora_rank set, groups, a dense first layer, shared experts, YaRN; GLM: partial rotary, q/k norms, biases;
# gpt-oss: sinks, alternating windows shorter than a demo's sequence, YaRN, biased router and experts).
_deepseek("tiny-deepseek-v3", vocab=512, h=128, layers=4, heads=4, ffn=256, moe_ffn=64, experts=8, shared=2, top_k=2,
          groups=4, topk_groups=2, dense=1, scaling=2.5, q_lora=96, pos=512, theta=10000.0,
          yarn=_yarn(4.0, 32.0, original=128), mla=dict(kv_lora_rank=64, qk_nope_head_dim=32, qk_rope_head_dim=16,
                                                        v_head_dim=24))
_glm("tiny-glm4-moe", vocab=512, h=128, layers=4, heads=4, kv=2, head_dim=32, ffn=256, moe_ffn=64, experts=8,
     groups=2, topk_groups=1, dense=1, scaling=1.5, qk_norm=True, pos=512, eos=None, pad=None)
_gpt_oss("tiny-gpt-oss", layers=4, experts=8, vocab=512, h=128, heads=4, kv=2, head_dim=32, window=16, pos=512,
         yarn={**GPT_OSS_YARN, "factor": 4.0, "original_max_position_embeddings": 128}, eos=None, pad=None)



# DeepSeek Sparse Attention (models/kinds/sparse_mla.py: MLA with a lightning indexer's top-k) and the 2026 MLA
# families: DeepSeek-V3.2 (DeepSeek-V3's shapes, an indexer of 64 heads of 128 on every layer), GLM-5 (the GLM-5
# report's and transformers' GlmMoeDsaConfig's shapes; its rope base is transformers' default), GLM-4.7-Flash (MLA +
# GLM's DeepSeekMoE) and Mistral Small 4 (MLA + softmax-routed experts, Llama 4's query temperature), each from
# transformers' config of the checkpoint.
def _sparse(cfg: ModelConfig, family: str, index_heads: int, interleave: bool, src: str) -> ModelConfig:
    """cfg with DeepSeek Sparse Attention on every layer: an indexer of index_heads heads of 128 choosing 2048 keys."""
    return cfg.replace(name="", family=family, token_mixers=["sparse_mla"] * cfg.num_layers, hf_source=src,
                       sparse_mla=SparseMLAConfig(index_topk=2048, index_n_heads=index_heads, index_head_dim=128,
                                                  rope_interleave=interleave))


def _mla_moe(family, *, vocab, h, layers, heads, ffn, moe_ffn, experts, top_k, dense, scaling, q_lora, kv_lora,
             nope, rope, v, pos, eps, router="sigmoid", theta=10000.0, yarn=None, query_scale=None, interleave=True,
             bos=None, eos=None, pad=None, src=""):
    return ModelConfig(
        family=family, vocab_size=vocab, hidden_size=h, num_layers=layers,
        attention=AttentionConfig(num_heads=heads, head_dim=rope, rope_theta=theta, rope_scaling=yarn),
        mla=MLAConfig(kv_lora_rank=kv_lora, qk_nope_head_dim=nope, qk_rope_head_dim=rope, v_head_dim=v,
                      q_lora_rank=q_lora, rope_interleave=interleave,
                      **(dict(query_scale_beta=query_scale[0], query_scale_length=query_scale[1]) if query_scale
                         else {})),
        mlp=MLPConfig(ffn), moe=MoEConfig(num_experts=experts, num_experts_per_tok=top_k, ffn_hidden_size=moe_ffn,
                                          router=router, routed_scaling_factor=scaling, shared_expert_ffn=moe_ffn),
        token_mixers=["mla"] * layers, channel_mixers=["mlp"] * dense + ["moe"] * (layers - dense),
        max_position_embeddings=pos, norm_eps=eps, bos_token_id=bos, eos_token_id=eos, pad_token_id=pad,
        hf_source=src)


register_config("deepseek-v3.2", _sparse(CONFIGS["deepseek-v3"], "deepseek_v32", 64, False,
                                         "deepseek-ai/DeepSeek-V3.2"))
register_config("glm-5", _sparse(_mla_moe(
    "glm_moe_dsa", vocab=154880, h=6144, layers=78, heads=64, ffn=12288, moe_ffn=2048, experts=256, top_k=8, dense=3,
    scaling=2.5, q_lora=2048, kv_lora=512, nope=192, rope=64, v=256, pos=202752, eps=1e-5), "glm_moe_dsa", 32, True,
    "zai-org/GLM-5"))
register_config("glm-4.7-flash", _mla_moe(
    "glm4_moe_lite", vocab=154880, h=2048, layers=47, heads=20, ffn=10240, moe_ffn=1536, experts=64, top_k=4, dense=1,
    scaling=1.8, q_lora=768, kv_lora=512, nope=192, rope=64, v=256, pos=202752, eps=1e-5,
    src="zai-org/GLM-4.7-Flash"))
register_config("mistral-small-4", _mla_moe(
    "mistral4", vocab=131072, h=4096, layers=36, heads=32, ffn=12288, moe_ffn=2048, experts=128, top_k=4, dense=0,
    scaling=1.0, q_lora=1024, kv_lora=256, nope=64, rope=64, v=128, pos=1048576, eps=1e-6, router="softmax",
    yarn=_yarn(128.0, 32.0, original=8192), query_scale=(0.1, 8192), bos=1, eos=2, pad=11,
    src="mistralai/Mistral-Small-4-119B-2603"))
# A trainable cut (CPU tests, demos, scripts/bench/sparse_mla.py): tiny-deepseek-v3's shapes, an indexer of 4 heads
# of 32 choosing 64 keys.
register_config("tiny-deepseek-v3.2", CONFIGS["tiny-deepseek-v3"].replace(
    name="", family="deepseek_v32", token_mixers=["sparse_mla"] * 4,
    sparse_mla=SparseMLAConfig(index_topk=64, index_n_heads=4, index_head_dim=32)))

# Hybrid linear attention (models/kinds/gated_deltanet.py): Qwen3.5 and Qwen3-Next put three Gated DeltaNet layers
# before each gated attention layer (output gate, partial rotary 0.25, (1 + w) norms); OLMo 3 three sliding-window
# layers before each full one. The text models only (Qwen3.5's checkpoints add a vision tower and an MTP head).
def _every_4th(layers: int, other: str, fourth: str) -> list:
    return [other if (i + 1) % 4 else fourth for i in range(layers)]


def _qwen_hybrid(name, family, *, vocab, h, layers, heads, kv, ffn, gdn, src, moe=None, bos=None, eos=None):
    register_config(name, ModelConfig(
        family=family, vocab_size=vocab, hidden_size=h, num_layers=layers,
        attention=AttentionConfig(num_heads=heads, num_kv_heads=kv, head_dim=256, rope_theta=10000000.0,
                                  partial_rotary_factor=0.25, qk_norm="head", output_gate=True),
        mlp=MLPConfig(ffn), moe=moe or MoEConfig(), gated_deltanet=gdn,
        token_mixers=_every_4th(layers, "gated_deltanet", "attention"), max_position_embeddings=262144,
        norm_eps=1e-6, norm_offset=True, bos_token_id=bos, eos_token_id=eos, hf_source=src))


def _qwen_moe(experts: int, top_k: int) -> MoEConfig:
    return MoEConfig(num_experts=experts, num_experts_per_tok=top_k, ffn_hidden_size=512, router_aux_loss_coef=0.001,
                     shared_expert_ffn=512, shared_expert_gate=True)


_GDN_16_32 = GatedDeltaNetConfig(num_key_heads=16, num_value_heads=32, key_head_dim=128, value_head_dim=128)
_qwen_hybrid("qwen3.5-27b", "qwen3_5", vocab=248320, h=5120, layers=64, heads=24, kv=4, ffn=17408, eos=248044,
             gdn=GatedDeltaNetConfig(num_key_heads=16, num_value_heads=48, key_head_dim=128, value_head_dim=128),
             src="Qwen/Qwen3.5-27B")
_qwen_hybrid("qwen3.5-35b-a3b", "qwen3_5_moe", vocab=248320, h=2048, layers=40, heads=16, kv=2, ffn=512, eos=248044,
             gdn=_GDN_16_32, moe=_qwen_moe(256, 8), src="Qwen/Qwen3.5-35B-A3B")
_qwen_hybrid("qwen3-next-80b-a3b", "qwen3_next", vocab=151936, h=2048, layers=48, heads=16, kv=2, ffn=5120,
             bos=151643, eos=151645, gdn=_GDN_16_32, moe=_qwen_moe(512, 10), src="Qwen/Qwen3-Next-80B-A3B-Instruct")
# OLMo 3 7B: its full-attention layers extend the 8K pretraining context 8x with YaRN (their own rope table)
OLMO3_YARN = {"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 8192, "beta_fast": 32.0,
              "beta_slow": 1.0, "attention_factor": 1.2079441541679836}
register_config("olmo-3-7b", ModelConfig(
    family="olmo3", vocab_size=100278, hidden_size=4096, num_layers=32,
    attention=AttentionConfig(num_heads=32, num_kv_heads=32, rope_theta=500000.0, rope_scaling=OLMO3_YARN,
                              rope_local_theta=500000.0, qk_norm="full", sliding_window=4096,
                              layer_types=_every_4th(32, "sliding_attention", "full_attention")),
    mlp=MLPConfig(11008), max_position_embeddings=65536, norm_eps=1e-6, pre_norm=False, post_norm=True,
    eos_token_id=100257, pad_token_id=100277, hf_source="allenai/Olmo-3-1025-7B"))
# Trainable cuts for CPU tests and demos: the same layer pattern at toy widths (tp 2 splits every head group).
_NANO_GDN = GatedDeltaNetConfig(num_key_heads=2, num_value_heads=4, key_head_dim=8, value_head_dim=8)
_NANO_HYBRID = dict(vocab_size=97, hidden_size=32, num_layers=4, max_position_embeddings=256, norm_eps=1e-6,
                    norm_offset=True, gated_deltanet=_NANO_GDN,
                    attention=AttentionConfig(4, num_kv_heads=2, head_dim=16, partial_rotary_factor=0.25,
                                              qk_norm="head", output_gate=True),
                    token_mixers=_every_4th(4, "gated_deltanet", "attention"))
register_config("nano-qwen3.5", ModelConfig(family="qwen3_5", mlp=MLPConfig(64), **_NANO_HYBRID))
register_config("nano-qwen3-next", ModelConfig(
    family="qwen3_next", mlp=MLPConfig(64), **_NANO_HYBRID,
    moe=MoEConfig(num_experts=4, num_experts_per_tok=2, ffn_hidden_size=16, router_aux_loss_coef=0.001,
                  shared_expert_ffn=24, shared_expert_gate=True)))
register_config("nano-olmo3", ModelConfig(
    family="olmo3", vocab_size=97, hidden_size=32, num_layers=4, max_position_embeddings=256,
    attention=AttentionConfig(4, num_kv_heads=2, qk_norm="full", sliding_window=8, rope_local_theta=1000.0,
                              layer_types=_every_4th(4, "sliding_attention", "full_attention")),
    mlp=MLPConfig(64), pre_norm=False, post_norm=True))
