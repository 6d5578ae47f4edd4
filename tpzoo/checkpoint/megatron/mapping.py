"""tpzoo tensors <-> Megatron-Core's global tensors (torch_dist's keys), one table for both directions.

tpzoo's full tensors and Megatron's global ones (what torch_dist stores; legacy files are brought to the same
picture on opening) hold the same numbers in the same order, except:

- decoder layers: Megatron stacks every layer's tensor on a leading axis (`decoder.layers.X` [num_layers, ...]),
  tpzoo names each (`layers.i.X`): entry.layer picks the slice;
- linear_qkv (weight and bias): Megatron groups the rows by query group, [q heads of group 0 | k0 | v0 | q heads
  of group 1 | k1 | v1 | ...] (GPT-2 style attention: one group per head, [q | k | v] per head), so that each tp
  rank's rows are whole groups; tpzoo's fused qkv is [all q | all k | all v] (its ShardSpec splits each part):
  entry.rows lists the runs (tpzoo row, Megatron row, length) of this permutation;
- vocabulary tensors: Megatron pads the rows to a multiple of make_vocab_size_divisible_by * tp, tpzoo stores the
  real vocabulary (the padding is dropped on import, recorded, and written again on export).

linear_fc1 needs no permutation: torch_dist stores a SwiGLU weight as [all gates | all ups] (each rank's
[its gate | its up] is two chunks), which is tpzoo's fused [gate | up]; the experts' linear_fc1 likewise, per
expert. Norms: Megatron-Core saves them under Transformer Engine's names (`linear_qkv.layer_norm_weight`,
`linear_fc1.layer_norm_weight`) for both layer specs, except a mixture of experts' pre-MLP norm with Transformer
Engine (`pre_mlp_layernorm.weight`); legacy files of the local spec use the module names (`input_layernorm`):
entry.keys lists every name a tensor may have, the one to write first.
"""
from __future__ import annotations

from dataclasses import dataclass

ATTN = "decoder.layers.self_attention."
MLP = "decoder.layers.mlp."
EXPERTS = "decoder.layers.mlp.experts.experts."
NOT_MODEL = ("optimizer.", "rng_state", "rerun_state_machine", "common_state", "content_metadata")


@dataclass(frozen=True)
class Entry:
    name: str                     # tpzoo tensor name
    keys: tuple                   # Megatron keys it may be stored under; keys[0] is written
    layer: int | None = None      # index on the stacked layer axis
    rows: tuple | None = None     # ((tpzoo row, Megatron row, length), ...) along dim 0; None: the same order
    vocab: bool = False           # rows padded to the padded vocabulary in Megatron
    tp_dim: int | None = None     # the dim (of the tpzoo tensor) Megatron splits over tp; None: replicated
    gated: bool = False           # [gate | up]: each half split over tp on its own
    experts: bool = False         # dim 0 is the experts (Megatron: the axis after the layer axis)
    module: str | None = None     # the module whose `_extra_state` Megatron-Core saves with it
    alias: bool = False           # a copy of another entry's tensor (a tied head): read, never written


def is_model_key(key: str) -> bool:
    return not key.startswith(NOT_MODEL)


def qkv_rows(heads: int, groups: int, head_dim: int) -> tuple:
    """Runs (tpzoo row, Megatron row, length) mapping tpzoo's [q | k | v] to Megatron's per-group layout."""
    per = heads // groups
    group_rows = (per + 2) * head_dim
    q, k = heads * head_dim, groups * head_dim
    runs = []
    for g in range(groups):
        base = g * group_rows
        runs += [(g * per * head_dim, base, per * head_dim), (q + g * head_dim, base + per * head_dim, head_dim),
                 (q + k + g * head_dim, base + (per + 1) * head_dim, head_dim)]
    return tuple(runs)


def map_rows(rows: tuple | None, start: int, n: int, inverse: bool = False) -> list[tuple[int, int]]:
    """The ranges (start, length) of the other side that rows [start, start + n) of one side come from, in order
    (tpzoo -> Megatron; with `inverse`, Megatron -> tpzoo)."""
    if rows is None:
        return [(start, n)]
    out, end = [], start + n
    for tz, mg, length in sorted(rows, key=lambda r: r[1] if inverse else r[0]):
        src, dst = (mg, tz) if inverse else (tz, mg)
        lo, hi = max(start, src), min(end, src + length)
        if lo < hi:
            out.append((dst + lo - src, hi - lo))
    return out


def megatron_tensors(cfg, moe_norm_te: bool = True) -> list[Entry]:
    """The table for a model config. moe_norm_te: a mixture of experts' pre-MLP norm under Transformer Engine's
    spec name (`pre_mlp_layernorm.weight`, Megatron-LM's default) rather than the local spec's."""
    a = cfg.attention
    bias = ("weight", "bias") if cfg.norm == "layernorm" else ("weight",)
    out = [Entry("embed.weight", ("embedding.word_embeddings.weight",), vocab=True, tp_dim=0)]
    if cfg.position == "learned":
        out.append(Entry("pos_embed.weight", ("embedding.position_embeddings.weight",)))
    rows = qkv_rows(a.num_heads, a.num_kv_heads, a.head_dim)
    for i in range(cfg.num_layers):
        def e(name, keys, **kw):
            out.append(Entry(f"layers.{i}.{name}", keys, layer=i, **kw))

        moe = cfg.is_moe_layer(i)
        for w in bias:
            e(f"attn_norm.{w}", (f"{ATTN}linear_qkv.layer_norm_{w}", f"decoder.layers.input_layernorm.{w}"))
        e("attn.qkv.weight", (f"{ATTN}linear_qkv.weight",), rows=rows, tp_dim=0, module=f"{ATTN}linear_qkv")
        if a.qkv_bias:
            e("attn.qkv.bias", (f"{ATTN}linear_qkv.bias",), rows=rows, tp_dim=0)
        e("attn.out.weight", (f"{ATTN}linear_proj.weight",), tp_dim=1, module=f"{ATTN}linear_proj")
        if a.out_bias:
            e("attn.out.bias", (f"{ATTN}linear_proj.bias",))
        for w in bias:
            fused, separate = f"{MLP}linear_fc1.layer_norm_{w}", f"decoder.layers.pre_mlp_layernorm.{w}"
            e(f"mlp_norm.{w}", (separate, fused) if moe and moe_norm_te else (fused, separate))
        if moe:
            e("mlp.router.weight", (f"{MLP}router.weight",))
            e("mlp.gate_up", (f"{EXPERTS}linear_fc1.weight",), tp_dim=1, gated=True, experts=True,
              module=f"{EXPERTS}linear_fc1")
            e("mlp.down", (f"{EXPERTS}linear_fc2.weight",), tp_dim=2, experts=True, module=f"{EXPERTS}linear_fc2")
            continue
        e("mlp.fc_in.weight", (f"{MLP}linear_fc1.weight",), tp_dim=0, gated=cfg.gated, module=f"{MLP}linear_fc1")
        if cfg.mlp.bias:
            e("mlp.fc_in.bias", (f"{MLP}linear_fc1.bias",), tp_dim=0, gated=cfg.gated)
        e("mlp.fc_out.weight", (f"{MLP}linear_fc2.weight",), tp_dim=1, module=f"{MLP}linear_fc2")
        if cfg.mlp.bias:
            e("mlp.fc_out.bias", (f"{MLP}linear_fc2.bias",))
    out += [Entry(f"final_norm.{w}", (f"decoder.final_layernorm.{w}",)) for w in bias]
    if cfg.tie_embeddings:
        out.append(Entry("lm_head.weight", ("embedding.word_embeddings.weight",), vocab=True, tp_dim=0, alias=True))
    else:
        out.append(Entry("lm_head.weight", ("output_layer.weight",), vocab=True, tp_dim=0))
    return out


def megatron_shape(entry: Entry, full_shape: tuple, num_layers: int, padded_vocab: int) -> tuple:
    """The global Megatron shape of an entry whose tpzoo full (unpadded) shape is `full_shape`."""
    shape = list(full_shape)
    if entry.vocab:
        shape[0] = padded_vocab
    return tuple(([num_layers] if entry.layer is not None else []) + shape)
