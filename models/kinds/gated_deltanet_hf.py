"""Hugging Face names of a Gated DeltaNet layer (models/kinds/gated_deltanet.py).

tpzoo's tensors (full, unsharded; prefix e.g. "layers.3.mixer"):
    in_proj.weight   [2 key_dim + 2 value_dim + 2 value_heads, hidden]   q | k | v | z | b | a
    conv.weight      [2 key_dim + value_dim, K]                          q | k | v channels
    A_log, dt_bias   [value_heads]
    norm.weight      [value_head_dim]
    out_proj.weight  [hidden, value_dim]
Two HF layouts (prefix e.g. "model.layers.3.linear_attn"; the kind's `hf_tensor_maps` takes the HF layer
"model.layers.3." and a layout, "qwen3_5" by default):
    "qwen3_5"     (Qwen3.5, Qwen3.5-MoE) in_proj_qkv [q | k | v], in_proj_z, in_proj_b, in_proj_a: concatenated.
    "qwen3_next"  (Qwen3-Next) in_proj_qkvz, in_proj_ba grouped per key head: for each key head, its q, k, then
                  its value heads' v, then their z (in_proj_ba: its value heads' b, then their a). Regrouped
                  into the part order above (and back for export): a permutation of rows, bit-exact both ways.
    conv1d.weight [C, 1, K] <-> conv.weight [C, K]; A_log, dt_bias, norm.weight, out_proj.weight the same.
Sharding over TP is applied afterwards from the model's ShardSpecs (in_proj's parts split separately).
"""
from __future__ import annotations

import torch

from ..config import GatedDeltaNetConfig
from ..hf_mapping import TensorMap, concatenated, same

LAYOUTS = ("qwen3_5", "qwen3_next")


def _grouped_in_proj(name: str, hfs: tuple[str, str], cfg: GatedDeltaNetConfig, **kw) -> TensorMap:
    """Qwen3-Next's in_proj_qkvz / in_proj_ba (rows grouped per key head) <-> in_proj's q|k|v|z|b|a."""
    nk, dk, dv = cfg.num_key_heads, cfg.key_head_dim, cfg.value_head_dim
    r = cfg.num_value_heads // nk  # value heads per key head
    qkvz_sizes, ba_sizes = [dk, dk, r * dv, r * dv], [r, r]

    def to_tpzoo(ts: list[torch.Tensor]) -> torch.Tensor:
        qkvz, ba = ts
        q, k, v, z = qkvz.unflatten(0, (nk, -1)).split(qkvz_sizes, dim=1)  # each [nk, rows per group, hidden]
        b, a = ba.unflatten(0, (nk, -1)).split(ba_sizes, dim=1)
        return torch.cat([t.flatten(0, 1) for t in (q, k, v, z, b, a)], dim=0)

    # The export's row order, as indices into in_proj's rows: gathering rows (not torch.cat) also serves the
    # shape checks on meta tensors, where cat's meta kernel would import torch._dynamo (seconds per conversion).
    rows = torch.arange(sum(cfg.in_proj_parts))
    q, k, v, z, b, a = (t.unflatten(0, (nk, -1)) for t in rows.split(list(cfg.in_proj_parts), dim=0))
    order = (torch.cat([q, k, v, z], dim=1).flatten(0, 1), torch.cat([b, a], dim=1).flatten(0, 1))

    def to_hf(x: torch.Tensor) -> list[torch.Tensor]:
        return [x[rows.to(x.device)] for rows in order]

    return TensorMap(name, hfs, to_tpzoo, to_hf, **kw)


def gated_deltanet_tensor_maps(cfg: GatedDeltaNetConfig, ours: str, theirs: str, layout: str,
                               layer: int | None = None) -> list[TensorMap]:
    """The TensorMaps of one layer: tpzoo names under `ours`, HF names under `theirs`, HF `layout` (see above)."""
    if layout not in LAYOUTS:
        raise ValueError(f"unknown Gated DeltaNet HF layout {layout!r}; one of {LAYOUTS}")
    kw = {"layer": layer}
    if layout == "qwen3_5":
        parts = ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a")
        sizes = (sum(cfg.conv_parts), cfg.value_dim, cfg.num_value_heads, cfg.num_value_heads)
        in_proj = concatenated(f"{ours}.in_proj.weight", tuple(f"{theirs}.{p}.weight" for p in parts), sizes, **kw)
    else:
        in_proj = _grouped_in_proj(f"{ours}.in_proj.weight",
                                   (f"{theirs}.in_proj_qkvz.weight", f"{theirs}.in_proj_ba.weight"), cfg, **kw)
    # flatten, not squeeze: the checkpoint engine probes a mapping with stand-ins whose size-1 dims are not 1
    conv = TensorMap(f"{ours}.conv.weight", (f"{theirs}.conv1d.weight",), lambda t: t[0].flatten(1),
                     lambda x: [x.unsqueeze(1).contiguous()], **kw)
    return [in_proj, conv, *(same(f"{ours}.{n}", f"{theirs}.{n}", **kw)
                             for n in ("A_log", "dt_bias", "norm.weight", "out_proj.weight"))]


def hf_tensor_maps(cfg, layer: int, ours: str, theirs: str, style: str | None = None) -> list[TensorMap]:
    """The kind's HF names (models/kinds/__init__.py): layer `layer` under linear_attn of the HF layer `theirs`."""
    return gated_deltanet_tensor_maps(cfg.gated_deltanet, ours, theirs + "linear_attn", style or "qwen3_5", layer)
