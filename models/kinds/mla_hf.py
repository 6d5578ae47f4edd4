"""Hugging Face names of an "mla" layer (models/kinds/mla.py): transformers' DeepseekV3Attention names, one to one.

tpzoo's tensors (`ours` e.g. "layers.3.attn") carry HF's own names: q_proj, or q_a_proj / q_a_layernorm / q_b_proj
(q_lora_rank set), kv_a_proj_with_mqa, kv_a_layernorm, kv_b_proj, o_proj; with attention_bias the biases of
q_a_proj and kv_a_proj_with_mqa (qkv_bias) and of o_proj (out_bias). HF keeps them under self_attn of the layer
`theirs` (e.g. "model.layers.3."). One layout.
"""
from __future__ import annotations

from ..config import ModelConfig
from ..hf_mapping import same


def hf_tensor_maps(cfg: ModelConfig, layer: int, ours: str, theirs: str, style: str | None = None) -> list:
    """The TensorMaps of layer `layer`'s latent attention: every projection and norm under HF's own name."""
    if style not in (None, "deepseek"):
        raise ValueError(f"unknown MLA HF layout {style!r}; one of ('deepseek',)")
    q = theirs + "self_attn."
    names = ["q_proj"] if cfg.mla.q_lora_rank is None else ["q_a_proj", "q_a_layernorm", "q_b_proj"]
    names += ["kv_a_proj_with_mqa", "kv_a_layernorm", "kv_b_proj", "o_proj"]
    maps = [same(f"{ours}.{n}.weight", f"{q}{n}.weight", layer=layer) for n in names]
    biased = [n for n in ("q_a_proj", "kv_a_proj_with_mqa") if n in names] if cfg.attention.qkv_bias else []
    biased += ["o_proj"] if cfg.attention.out_bias else []
    return maps + [same(f"{ours}.{n}.bias", f"{q}{n}.bias", layer=layer) for n in biased]
