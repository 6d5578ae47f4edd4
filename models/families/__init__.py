"""The model families: each module reads one Hugging Face architecture's config into ModelConfig's layer kinds and
maps its tensor names, and registers itself (models/registry.py). Every built-in family is listed here, once."""
from . import (deepseek_v3, deepseek_v32, gemma, glm4_moe, glm4_moe_lite, glm_moe_dsa, gpt2, gpt_oss,  # noqa: F401
               kimi_linear, llama, minimax_m2, mistral4, moe_families, olmo2, olmo3, phi3, qwen3, qwen3_5, smollm3)
