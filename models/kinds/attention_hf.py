"""Hugging Face names of an "attention" layer (models/kinds/attention.py), in the three layouts HF checkpoints use.

tpzoo's tensors (full, unsharded; `ours` e.g. "layers.3.attn"): qkv.weight [q_rows + 2 kv_heads * head_dim, hidden]
(q | k | v; with the output gate each query head's rows are its query then its gate, HF's q_proj), qkv.bias,
out.weight, out.bias, q_norm.weight / k_norm.weight, sinks [heads].
Layouts (`theirs` is the HF layer, e.g. "model.layers.3."):
    "separate"  (the default: Llama and most families) self_attn.{q,k,v}_proj concatenated, self_attn.o_proj,
                self_attn.{q,k}_norm, self_attn.sinks (gpt-oss)
    "fused"     (Phi-3) self_attn.qkv_proj already q|k|v, self_attn.o_proj
    "conv1d"    (GPT-2) attn.c_attn / attn.c_proj, Conv1D weights stored [in, out]
Sharding over TP is applied afterwards from the model's ShardSpecs.
"""
from __future__ import annotations

from ..config import ModelConfig
from ..hf_mapping import concatenated, same, transposed

STYLES = ("separate", "fused", "conv1d")


def hf_tensor_maps(cfg: ModelConfig, layer: int, ours: str, theirs: str, style: str | None = None) -> list:
    """The TensorMaps of layer `layer`'s attention: tpzoo names under `ours`, HF names in the HF layer `theirs`."""
    style = style or "separate"
    a, kw = cfg.attention, {"layer": layer}
    if style == "conv1d":
        q = theirs + "attn."
        return [transposed(f"{ours}.qkv.weight", q + "c_attn.weight", **kw),  # already q|k|v
                same(f"{ours}.qkv.bias", q + "c_attn.bias", **kw),
                transposed(f"{ours}.out.weight", q + "c_proj.weight", **kw),
                same(f"{ours}.out.bias", q + "c_proj.bias", **kw)]
    q = theirs + "self_attn."
    if style == "fused":
        maps = [same(f"{ours}.qkv.weight", q + "qkv_proj.weight", **kw)]  # q|k|v, as tpzoo's
    elif style == "separate":
        hd = a.head_dim
        q_rows = a.num_heads * hd * (2 if a.output_gate else 1)  # a gated q_proj holds each head's query and gate
        sizes = (q_rows, a.num_kv_heads * hd, a.num_kv_heads * hd)
        proj = tuple(f"{q}{n}_proj" for n in "qkv")
        maps = [concatenated(f"{ours}.qkv.weight", tuple(n + ".weight" for n in proj), sizes, **kw)]
        if a.qkv_bias:
            maps.append(concatenated(f"{ours}.qkv.bias", tuple(n + ".bias" for n in proj), sizes, **kw))
    else:
        raise ValueError(f"unknown attention HF layout {style!r}; one of {STYLES}")
    maps.append(same(f"{ours}.out.weight", q + "o_proj.weight", **kw))
    if a.out_bias:
        maps.append(same(f"{ours}.out.bias", q + "o_proj.bias", **kw))
    if a.qk_norm != "none":
        maps += [same(f"{ours}.{n}_norm.weight", f"{q}{n}_norm.weight", **kw) for n in "qk"]
    if a.sinks:
        maps.append(same(f"{ours}.sinks", q + "sinks", **kw))
    return maps
