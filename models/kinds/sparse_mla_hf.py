"""Hugging Face names of a "sparse_mla" layer (models/kinds/sparse_mla.py): transformers' DeepseekV32Attention /
GlmMoeDsaAttention names, one to one. The attention's are MLA's (mla_hf.py); a layer with its own indexer adds
self_attn.indexer.{wq_b, wk, weights_proj}.weight and the key norm's indexer.k_norm.{weight, bias} (a shared layer
of GLM-5 has none). One layout.
"""
from __future__ import annotations

from ..config import ModelConfig
from ..hf_mapping import same
from . import mla_hf

INDEXER = ("wq_b.weight", "wk.weight", "k_norm.weight", "k_norm.bias", "weights_proj.weight")


def hf_tensor_maps(cfg: ModelConfig, layer: int, ours: str, theirs: str, style: str | None = None) -> list:
    """The TensorMaps of layer `layer`'s sparse latent attention: MLA's, then its indexer's."""
    maps = mla_hf.hf_tensor_maps(cfg, layer, ours, theirs, style)
    if not cfg.sparse_mla.has_indexer(layer):
        return maps
    return maps + [same(f"{ours}.indexer.{n}", f"{theirs}self_attn.indexer.{n}", layer=layer) for n in INDEXER]
