"""Model families built from tpzoo parallel layers (installed as tpzoo.models).

    from tpzoo.models import ModelLayout, Transformer, get_config
    model = Transformer(get_config("llama-3-8b"), ModelLayout(sequence_parallel=True))
"""
if __name__ != "tpzoo.models":
    # Run as the top-level `models` (Python started in the checkout root): become tpzoo.models, or the installed
    # package of that name, instead of a second copy of this one with its own classes and registries
    # (tpzoo/_toplevel.py).
    from tpzoo._toplevel import redirect

    redirect(__name__)
else:
    from .config import AttentionConfig, MLAConfig, MLPConfig, ModelConfig, MoEConfig
    from .inputs import Cache, Context, Inputs, LossOptions
    from .kinds import register_channel_mixer, register_token_mixer
    from .kinds.attention import KVCache
    from .layout import ModelLayout, Stage
    from .recompute import apply_recompute
    from .registry import (Family, from_hf_config, get_config, get_family, list_configs, register_config,
                           register_family, to_hf_config)
    from .transformer import Transformer
    from . import families, zoo  # noqa: F401,E402 (the built-in families and named configs register themselves)

__all__ = ["AttentionConfig", "Cache", "Context", "Family", "Inputs", "KVCache", "LossOptions", "MLAConfig",
           "MLPConfig", "ModelConfig", "ModelLayout", "MoEConfig", "Stage", "Transformer", "apply_recompute", "from_hf_config",
           "get_config", "get_family", "list_configs", "register_channel_mixer", "register_config",
           "register_family", "register_token_mixer", "to_hf_config"]
