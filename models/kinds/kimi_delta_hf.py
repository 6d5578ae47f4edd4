"""Hugging Face names of a Kimi Delta Attention layer (models/kinds/kimi_delta.py): the hub checkpoints' names
(moonshotai/Kimi-Linear-48B-A3B-*, which transformers' `save_pretrained` writes too), under self_attn of the HF layer.

tpzoo's tensors (full, unsharded; `ours` e.g. "layers.3.attn"; D = heads x head_dim, d = head_dim):
    in_proj.weight   [3D + heads, hidden]   q_proj | k_proj | v_proj | b_proj, concatenated
    conv.weight      [3D, K]                q_conv1d | k_conv1d | v_conv1d, each [D, 1, K]
    f_a_proj.weight [d, hidden], f_b_proj.weight [D, d], g_a_proj.weight [d, hidden], g_b_proj.weight [D, d],
    dt_bias [D], o_norm.weight [d], o_proj.weight [hidden, D]: the same names
    A_log            [heads]                A_log [1, 1, heads, 1]
Bit-exact both ways. Sharding over TP is applied afterwards from the model's ShardSpecs (in_proj's and the conv's
parts split separately).
"""
from __future__ import annotations

import torch

from ..config import KimiDeltaConfig
from ..hf_mapping import TensorMap, concatenated, same

SAME = ("f_a_proj.weight", "f_b_proj.weight", "g_a_proj.weight", "g_b_proj.weight", "dt_bias", "o_norm.weight",
        "o_proj.weight")


def kimi_delta_tensor_maps(cfg: KimiDeltaConfig, ours: str, theirs: str, layer: int | None = None) -> list:
    """The TensorMaps of one layer: tpzoo names under `ours`, HF names under `theirs` (e.g. "model.layers.3.self_attn")."""
    kw = {"layer": layer}
    parts = ("q_proj", "k_proj", "v_proj", "b_proj")
    in_proj = concatenated(f"{ours}.in_proj.weight", tuple(f"{theirs}.{p}.weight" for p in parts), cfg.in_proj_parts,
                           **kw)
    convs = tuple(f"{theirs}.{p}_conv1d.weight" for p in "qkv")
    # flatten, not squeeze: the checkpoint engine probes a mapping with stand-ins whose size-1 dims are not 1
    conv = TensorMap(f"{ours}.conv.weight", convs, lambda ts: torch.cat([t.flatten(1) for t in ts]),
                     lambda x: [p.unsqueeze(1).contiguous() for p in x.split(cfg.dim)], **kw)
    a_log = TensorMap(f"{ours}.A_log", (f"{theirs}.A_log",), lambda ts: ts[0].flatten(),
                      lambda x: [x.reshape(1, 1, -1, 1).contiguous()], **kw)
    return [in_proj, conv, a_log, *(same(f"{ours}.{n}", f"{theirs}.{n}", **kw) for n in SAME)]


def hf_tensor_maps(cfg, layer: int, ours: str, theirs: str, style: str | None = None) -> list:
    """The kind's HF names (models/kinds/__init__.py): layer `layer` under self_attn of the HF layer `theirs`."""
    if style not in (None, "kimi"):
        raise ValueError(f"unknown Kimi Delta Attention HF layout {style!r}; one of ('kimi',)")
    return kimi_delta_tensor_maps(cfg.kimi_delta, ours, theirs + "self_attn", layer)
