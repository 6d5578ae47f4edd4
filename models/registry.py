"""The registries: layer kinds (token and channel mixers), model families and named configs.

A leaf: this module imports nothing of what registers into it, so any module may import it (models/config.py
walks the kinds of a config's layers through it) without an import cycle and without a lazy import. The built-in
entries are each listed once, in the folder they describe: the kinds in models/kinds/__init__.py, the families in
models/families/__init__.py, the named configs in models/zoo.py; importing tpzoo.models imports all three, so a
lookup always sees them.

A family is everything model-specific that the generic machinery needs: how to read and write its Hugging Face
config, its HF architectures, its HF tensor-name mapping and the facts about it other code needs (Family's
fields). There is no if/elif over family names anywhere: code looks the family up here.
"""
from __future__ import annotations

import difflib
import json
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

from tpzoo.errors import ConfigError

if TYPE_CHECKING:  # annotations only: config.py imports this module
    from .config import ModelConfig

# -- layer kinds --------------------------------------------------------------------------------------------------
# (the protocol a kind's class follows: models/kinds/__init__.py)

TOKEN_MIXERS: dict[str, type] = {}
CHANNEL_MIXERS: dict[str, type] = {}


def _register(table: dict, what: str, name: str, cls):
    def add(cls):
        if name in table and table[name] is not cls:
            raise ConfigError(f"{what} kind {name!r} is already registered ({table[name].__qualname__})")
        table[name] = cls
        cls.kind = name
        return cls
    return add(cls) if cls is not None else add


def register_token_mixer(name: str, cls=None):
    """Register a token-mixer class under `name` (usable as a decorator)."""
    return _register(TOKEN_MIXERS, "token mixer", name, cls)


def register_channel_mixer(name: str, cls=None):
    """Register a channel-mixer class under `name` (usable as a decorator)."""
    return _register(CHANNEL_MIXERS, "channel mixer", name, cls)


def _lookup(table: dict, what: str, name: str) -> type:
    if name not in table:
        raise ConfigError(f"unknown {what} kind {name!r}; registered: {sorted(table)}")
    return table[name]


def token_mixer_kind(name: str) -> type:
    return _lookup(TOKEN_MIXERS, "token mixer", name)


def channel_mixer_kind(name: str) -> type:
    return _lookup(CHANNEL_MIXERS, "channel mixer", name)


def layer_kinds(cfg: ModelConfig, layer: int) -> tuple[type, type]:
    """(token mixer class, channel mixer class) of one layer: the one walk from a config's per-layer kind names
    (ModelConfig.token_mixer(i) / channel_mixer(i)) to the registered classes, for everything that asks a layer's
    kinds (the block, parameter counts, auxiliary outputs, the plan, the pipeline's split, the HF tensor map)."""
    return token_mixer_kind(cfg.token_mixer(layer)), channel_mixer_kind(cfg.channel_mixer(layer))


def distinct_kinds(cfg: ModelConfig) -> list[tuple[int, type]]:
    """(first layer, class) of each distinct kind among the model's layers, in layer order: what asks each kind
    once (its layout checks: the preflight's and the plan's)."""
    seen = {}
    for i in range(cfg.num_layers):
        for kind in layer_kinds(cfg, i):
            seen.setdefault(kind, i)
    return [(i, kind) for kind, i in seen.items()]


# -- families and named configs -----------------------------------------------------------------------------------

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
    # HF stores the linear weights as Conv1D, [in, out] (GPT-2): a PEFT adapter of it is `fan_in_fan_out`
    hf_conv1d: bool = False


FAMILIES: dict[str, Family] = {}
CONFIGS: dict[str, ModelConfig] = {}


def register_family(family: Family) -> Family:
    FAMILIES[family.name] = family
    return family


def get_family(name: str) -> Family:
    if name not in FAMILIES:
        raise ConfigError(f"unknown model family {name!r}; known: {sorted(FAMILIES)}")
    return FAMILIES[name]


def family_for_hf(hf_config: dict) -> Family:
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
    if name not in CONFIGS:
        close = difflib.get_close_matches(str(name), CONFIGS, n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        raise ConfigError(f"unknown model {name!r}{hint}; `tpzoo models` lists the known names")
    return CONFIGS[name].replace()  # a copy: callers may change it


def list_configs() -> dict[str, ModelConfig]:
    return dict(CONFIGS)


def from_hf_config(config) -> ModelConfig:
    """A ModelConfig from a HF config.json path, a directory holding one, or its dict. Every error about a file
    names it: missing, not JSON, not an object, an unsupported architecture, a missing or bad field."""
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

