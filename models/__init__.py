"""Model families built from tpzoo parallel layers (installed as tpzoo.models).

    from tpzoo.models import get_config, Transformer
    model = Transformer(get_config("llama-3-8b"), sequence_parallel=True)
"""
if __name__ != "tpzoo.models":
    # Run as the top-level `models` (Python started in the checkout root): become tpzoo.models, or the installed
    # package of that name, instead of a second copy of this one with its own classes and registries
    # (tpzoo/_toplevel.py).
    from tpzoo._toplevel import redirect

    redirect(__name__)
else:
    from .config import ModelConfig
    from .registry import (Family, from_hf_config, get_config, get_family, list_configs, register_config,
                           register_family, to_hf_config)
    from .transformer import KVCache, Transformer, new_kv_caches

__all__ = ["Family", "KVCache", "ModelConfig", "Transformer", "from_hf_config", "get_config", "get_family",
           "list_configs", "new_kv_caches", "register_config", "register_family", "to_hf_config"]
