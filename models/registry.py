"""Registries: model families (each registers itself) and named configs (published shapes + tiny ones).

A family is everything model-specific that the generic machinery needs: how to read and write its Hugging Face
config, its HF architectures, and its HF tensor-name mapping. There is no if/elif over family names anywhere:
code looks the family up here.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from tpzoo.errors import ConfigError

from .config import ModelConfig


@dataclass
class Family:
    name: str
    hf_model_types: tuple[str, ...]                    # config.json "model_type" values this family reads
    hf_architecture: str                               # what to_hf writes into config.json "architectures"
    config_from_hf: Callable[[dict], ModelConfig]      # HF config.json dict -> ModelConfig
    config_to_hf: Callable[[ModelConfig], dict]        # ModelConfig -> HF config.json dict
    hf_tensor_map: Callable[[ModelConfig], list]       # -> list[TensorMap] (see models/hf_mapping.py)
    # HF config.json dict -> one-line notes on what importing it leaves out or changes (printed by the conversion)
    import_notes: Callable[[dict], list[str]] | None = None


FAMILIES: dict[str, Family] = {}
CONFIGS: dict[str, ModelConfig] = {}


def register_family(family: Family) -> Family:
    FAMILIES[family.name] = family
    return family


def get_family(name: str) -> Family:
    _load_builtin()
    if name not in FAMILIES:
        raise ConfigError(f"unknown model family {name!r}; known: {sorted(FAMILIES)}")
    return FAMILIES[name]


def family_for_hf(hf_config: dict) -> Family:
    _load_builtin()
    model_type = hf_config.get("model_type")
    for fam in FAMILIES.values():
        if model_type in fam.hf_model_types:
            return fam
    archs = hf_config.get("architectures")
    supported = sorted(t for f in FAMILIES.values() for t in f.hf_model_types)
    raise ConfigError(f"unsupported architecture: model_type={model_type!r} architectures={archs}; "
                     f"tpzoo supports model types {supported}")


def register_config(name: str, config: ModelConfig) -> ModelConfig:
    config.name = name
    CONFIGS[name] = config
    return config


def get_config(name: str) -> ModelConfig:
    _load_builtin()
    if name not in CONFIGS:
        import difflib

        close = difflib.get_close_matches(str(name), CONFIGS, n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        raise ConfigError(f"unknown model {name!r}{hint}; `tpzoo models` lists the known names")
    return CONFIGS[name].replace()  # a copy: callers may change it


def list_configs() -> dict[str, ModelConfig]:
    _load_builtin()
    return dict(CONFIGS)


def from_hf_config(config) -> ModelConfig:
    """A ModelConfig from a HF config.json path, a directory holding one, or its dict. Every error about a file
    names it: missing, not JSON, not an object, an unsupported architecture, a missing or bad field."""
    import json
    import os

    if not isinstance(config, (str, os.PathLike)):
        return family_for_hf(config).config_from_hf(config)
    path = os.path.join(config, "config.json") if os.path.isdir(config) else os.fspath(config)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"no config.json in {config} (a Hugging Face model directory needs one)"
                                if os.path.isdir(config) else f"{config}: no such file or directory")
    try:
        with open(path, encoding="utf-8") as f:
            hf = json.load(f)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        where = f"{path}:{e.lineno}:{e.colno}" if isinstance(e, json.JSONDecodeError) else path
        raise ConfigError(f"{where}: invalid JSON in a Hugging Face config: {getattr(e, 'msg', e)}") from None
    if not isinstance(hf, dict):
        raise ConfigError(f"{path}: expected a JSON object, got {type(hf).__name__}")
    try:
        return family_for_hf(hf).config_from_hf(hf)
    except KeyError as e:
        raise ConfigError(f"{path}: missing field {e.args[0]!r}") from None
    except (ConfigError, TypeError, ValueError) as e:  # a bad value (ModelConfig names the field)
        raise ConfigError(f"{path}: {e}") from None


def to_hf_config(config: ModelConfig) -> dict:
    return get_family(config.family).config_to_hf(config)


_LOADED = False


def _load_builtin() -> None:
    """Import the built-in families and the named-config table (they register themselves)."""
    global _LOADED
    if _LOADED:
        return
    _LOADED = True
    from . import (deepseek_v3, gemma, glm4_moe, gpt2, gpt_oss, llama, minimax_m2, moe_families, olmo2,  # noqa: F401
                   olmo3, phi3, qwen3, qwen3_5, smollm3, zoo)
