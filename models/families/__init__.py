"""The model families: each module reads one Hugging Face architecture's config into ModelConfig's layer kinds and
maps its tensor names, and registers itself (models/registry.py). Every built-in family is listed here, once."""
from . import (deepseek_v3, gemma, glm4_moe, gpt2, gpt_oss, kimi_linear, llama, minimax_m2, moe_families,  # noqa: F401
               olmo2, olmo3, phi3, qwen3, qwen3_5, smollm3)
