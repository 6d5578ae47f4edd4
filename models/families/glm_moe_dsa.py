"""GLM-5 (`GlmMoeDsaForCausalLM`): DeepSeek-V3.2's layers (models/families/deepseek_v32.py: DeepSeek Sparse Attention
on MLA, DeepSeekMoE) with the indexer's rotary in interleaved pairs, and cross-layer top-k sharing: a layer whose HF
`indexer_types` entry is "shared" runs no indexer (its checkpoint holds no indexer weights) and attends to the keys
the nearest earlier "full" layer selected (models/kinds/sparse_mla.py). Configs without indexer_types give the
pattern transformers derives (index_topk_pattern "FSS..." or index_topk_freq / index_skip_topk_offset; by default
every layer full). A pipeline stage holds a shared layer with its source (the balanced split moves the stage's
start back; --pp-boundaries that part them are refused: ModelConfig.reads_layer). The multi-token-prediction layer
is not imported (one line says so).
"""
from __future__ import annotations

from tpzoo.errors import ConfigError

from ..config import ModelConfig
from ..registry import Family, register_family
from .deepseek_v32 import dsa_config, dsa_to_hf
from .hf_common import common_fields, decoder_tensor_map, mtp_notes


def indexer_types(hf: dict) -> list:
    """HF's per-layer indexer modes, as GlmMoeDsaConfig reads them (indexer_types, else a pattern, else the
    frequency and offset)."""
    n = hf["num_hidden_layers"]
    types = hf.get("indexer_types")
    if types is None:
        pattern = hf.get("index_topk_pattern")
        if pattern is not None:
            types = [{"F": "full", "S": "shared"}[c] for c in pattern] if isinstance(pattern, str) else list(pattern)
        else:
            freq, offset = max(hf.get("index_topk_freq", 1), 1), hf.get("index_skip_topk_offset", 2)
            types = ["full" if max(i - offset + 1, 0) % freq == 0 else "shared" for i in range(n)]
    if len(types) != n:
        raise ConfigError(f"glm_moe_dsa: HF config field indexer_types has {len(types)} entries for {n} layers")
    return list(types)


def config_from_hf(hf: dict) -> ModelConfig:
    return ModelConfig(family="glm_moe_dsa", **common_fields(hf), **dsa_config("glm_moe_dsa", hf, True,
                                                                                indexer_types(hf)))


def config_to_hf(cfg: ModelConfig) -> dict:
    hf = dsa_to_hf(cfg, "glm_moe_dsa", "GlmMoeDsaForCausalLM")
    hf["indexer_types"] = list(cfg.sparse_mla.indexer_types or ["full"] * cfg.num_layers)
    return hf


register_family(Family(name="glm_moe_dsa", hf_model_types=("glm_moe_dsa",), hf_architecture="GlmMoeDsaForCausalLM",
                       config_from_hf=config_from_hf, config_to_hf=config_to_hf,
                       hf_tensor_map=lambda cfg: decoder_tensor_map(cfg, styles={"moe": "deepseek"}),
                       import_notes=lambda hf: mtp_notes("glm_moe_dsa", hf)))
