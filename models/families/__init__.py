"""The model families: each module reads one Hugging Face architecture's config into ModelConfig's layer kinds and
maps its tensor names, and registers itself (models/registry.py). Every built-in family is listed here, once."""
from . import (deepseek_v3, gemma, glm4_moe, gpt2, gpt_oss, llama, moe_families, olmo2, olmo3, phi3,  # noqa: F401
               qwen3, qwen3_5, smollm3)
