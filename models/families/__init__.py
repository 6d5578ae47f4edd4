"""The model families: each module reads one Hugging Face architecture's config into ModelConfig's layer kinds and
maps its tensor names, and registers itself (models/registry.py). Every built-in family is listed here, once."""
from . import (deepseek_v3, gemma, glm4_moe, gpt2, gpt_oss, llama, minimax_m2, moe_families, olmo2, olmo3,  # noqa: F401
               phi3, qwen3, qwen3_5, smollm3)
