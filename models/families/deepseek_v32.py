"""DeepSeek-V3.2 (`DeepseekV32ForCausalLM`, DeepSeek-V3.2-Exp and later): DeepSeek-V3 with DeepSeek Sparse Attention on
every layer (token mixer "sparse_mla": MLA whose queries attend to the index_topk keys a lightning indexer picks,
models/kinds/sparse_mla.py), DeepSeekMoE as DeepSeek-V3 (models/families/hf_common.py `deepseek_moe`: dense layers
from `mlp_layer_types` or `first_k_dense_replace`, then the sigmoid router with its selection bias, groups, shared
experts).

transformers' DeepseekV32Attention always has the query latent (q_lora_rank; a config without one is refused),
rotates MLA's rotary key in DeepSeek's interleaved pairs and the indexer's half-split (no rope_interleave field).
Names: MLA's and the indexer's (models/kinds/sparse_mla_hf.py), DeepSeekMoE's "deepseek" layout. The
multi-token-prediction layer (model.layers.61 of the hub's checkpoint) is not imported (one line says so).
"""
from __future__ import annotations

from tpzoo.errors import ConfigError

from ..config import ModelConfig, SparseMLAConfig
from ..registry import Family, register_family
from .hf_common import (common_fields, common_to_hf, decoder_tensor_map, deepseek_moe, deepseek_moe_to_hf,
                        mla_fields, mla_to_hf, mlp_layer_kinds, mtp_notes, refuse, rope_to_hf)

INDEXED = "indexed_attention"  # HF's layer type of a DSA layer


def dsa_config(family: str, hf: dict, indexer_interleave: bool, indexer_types: list | None = None) -> dict:
    """The ModelConfig keyword arguments DeepSeek-V3.2 and GLM-5 share: MLA with DeepSeek's interleaved rotary,
    the indexer's settings, every layer "sparse_mla", DeepSeekMoE."""
    if hf.get("q_lora_rank") is None:
        raise ConfigError(f"{family}: HF config field q_lora_rank is null; DeepSeek Sparse Attention's indexer reads "
                          f"the query latent (transformers' {family} attention always has one)")
    n = hf["num_hidden_layers"]
    unknown = sorted(set(hf.get("layer_types") or [INDEXED]) - {INDEXED})
    if unknown:
        raise refuse(family, "layer_types", unknown[0], [INDEXED])
    moe = deepseek_moe(family, hf)
    moe["channel_mixers"] = mlp_layer_kinds(family, hf) or moe["channel_mixers"]
    sparse = SparseMLAConfig(index_topk=hf["index_topk"], index_n_heads=hf["index_n_heads"],
                             index_head_dim=hf["index_head_dim"], rope_interleave=indexer_interleave,
                             indexer_types=indexer_types)
    if sparse.index_head_dim < hf["qk_rope_head_dim"]:
        raise ConfigError(f"{family}: index_head_dim={sparse.index_head_dim} is narrower than the rotary key's "
                          f"qk_rope_head_dim={hf['qk_rope_head_dim']}")
    return dict(**mla_fields(family, hf, interleave=True), sparse_mla=sparse, token_mixers=["sparse_mla"] * n, **moe)


def dsa_to_hf(cfg: ModelConfig, model_type: str, architecture: str) -> dict:
    hf = common_to_hf(cfg, model_type, architecture)
    d = cfg.sparse_mla
    hf.update(deepseek_moe_to_hf(cfg))
    hf.update(mla_to_hf(cfg))
    hf.update(head_dim=cfg.mla.qk_rope_head_dim, rope_parameters=rope_to_hf(cfg), index_topk=d.index_topk,
              index_n_heads=d.index_n_heads, index_head_dim=d.index_head_dim,
              layer_types=[INDEXED] * cfg.num_layers)
    if "mlp_layer_types" in hf:
        hf["mlp_layer_types"] = ["sparse" if cfg.channel_mixer(i) == "moe" else "dense"
                                 for i in range(cfg.num_layers)]
    for old in ("rope_scaling", "rope_theta"):
        hf.pop(old, None)
    return hf


def config_from_hf(hf: dict) -> ModelConfig:
    return ModelConfig(family="deepseek_v32", **common_fields(hf), **dsa_config("deepseek_v32", hf, False))


register_family(Family(name="deepseek_v32", hf_model_types=("deepseek_v32",), hf_architecture="DeepseekV32ForCausalLM",
                       config_from_hf=config_from_hf,
                       config_to_hf=lambda cfg: dsa_to_hf(cfg, "deepseek_v32", "DeepseekV32ForCausalLM"),
                       hf_tensor_map=lambda cfg: decoder_tensor_map(cfg, styles={"moe": "deepseek"}),
                       import_notes=lambda hf: mtp_notes("deepseek_v32", hf)))
