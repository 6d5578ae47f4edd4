"""A Megatron-LM checkpoint seen as tpzoo's full tensors: a weight source for the converter (write_checkpoint).

Opening it does every check before any output exists: the checkpoint's files (sizes, indexes, headers), its
arguments (saved, or `--megatron-args`), the model config they describe, and every tensor the model needs against
the shape the arguments imply (and no model tensor left over). A box of a tpzoo tensor is read as the boxes of
Megatron's global tensor it maps to (mapping.py), each read from just the chunks it crosses (store.py).
"""
from __future__ import annotations

import re

import torch

from ..format import CheckpointError
from .args import config_from_args
from .dist_format import open_dist
from .legacy_format import open_legacy
from .locate import locate
from .mapping import is_model_key, map_rows, megatron_shape, megatron_tensors

# Which arguments decide each Megatron tensor's shape: named when a shape contradicts them.
_SHAPE_ARGS = {"linear_qkv": "num_attention_heads, num_query_groups, kv_channels, hidden_size",
               "linear_proj": "num_attention_heads, kv_channels, hidden_size",
               "experts.linear_fc1": "moe_ffn_hidden_size, num_experts, swiglu, hidden_size",
               "experts.linear_fc2": "moe_ffn_hidden_size, num_experts, hidden_size",
               "linear_fc1": "ffn_hidden_size, swiglu, hidden_size", "linear_fc2": "ffn_hidden_size, hidden_size",
               "router": "num_experts, hidden_size", "word_embeddings": "padded_vocab_size, hidden_size",
               "output_layer": "padded_vocab_size, hidden_size",
               "position_embeddings": "max_position_embeddings, hidden_size"}
IGNORED_SUFFIXES = ("_extra_state",)


def open_store(src, overrides: dict):
    root, fmt, iteration = locate(src)
    store = open_dist(root, is_model_key) if fmt == "torch_dist" else open_legacy(root, overrides, is_model_key)
    if not store.layout:  # torch_dist: the layout it was saved at is in its arguments only
        a = store.args
        store.layout = {k: a.get(name) or 1 for k, name in (("tp", "tensor_model_parallel_size"),
                                                              ("pp", "pipeline_model_parallel_size"),
                                                              ("ep", "expert_model_parallel_size"))}
    return store, iteration


def _inferred(store) -> dict:
    """What the tensors say about the model's size (used where the arguments are silent)."""
    t = store.tensors
    emb = t.get("embedding.word_embeddings.weight")
    stacked = next((v for k, v in t.items() if k.startswith("decoder.layers.")), None)
    pos = t.get("embedding.position_embeddings.weight")
    return {"hidden_size": emb.shape[1] if emb else None, "padded_vocab_size": emb.shape[0] if emb else None,
            "num_layers": stacked.shape[0] if stacked else None,
            "max_position_embeddings": pos.shape[0] if pos else None}


def full_shapes(cfg) -> dict:
    """tpzoo name -> full (unpadded) shape, for every tensor of the model (a tied head: the embedding's)."""
    from ..layout import layout_plan, partition, stages_from_ranges

    plans = layout_plan(cfg, 1, stages_from_ranges(partition(cfg, 1), 1))
    out = {info.name: tuple(info.full_shape) for plan in plans for info in plan.params}
    out.setdefault("lm_head.weight", out["embed.weight"])
    return out


class MegatronSource:
    kind = "megatron"

    def __init__(self, src, overrides: dict | None = None, vocab_size: int | None = None):
        overrides = dict(overrides or {})
        self.store, self.iteration = open_store(src, overrides)
        try:
            self._setup(overrides, vocab_size)
        except BaseException:
            self.store.close()
            raise
        self.aux_dir = None  # the caller stages tokenizer files here
        self.stages, self.tp, self.pp, self.padding_multiple = None, None, None, 1

    def _setup(self, overrides: dict, vocab_size: int | None) -> None:
        store = self.store
        saved = store.args
        if not saved and not overrides:
            raise CheckpointError(f"{store.root}: the checkpoint has no saved arguments (args); give the model's "
                                  f"Megatron arguments with --megatron-args FILE (JSON or YAML)")
        self.args = {**saved, **overrides}
        what = f"{store.root} ({'--megatron-args' if overrides else 'saved args'})"
        self.cfg = config_from_args(self.args, _inferred(store), vocab_size, what)
        self.padded = self.args.get("padded_vocab_size") or _inferred(store)["padded_vocab_size"]
        self.expected = full_shapes(self.cfg)
        per_layer = sorted(k for k in store.tensors if re.match(r"decoder\.layers\.\d+\.", k))
        if per_layer:  # Megatron-Core's non-homogeneous layers (each its own keys): not the stacked layout
            raise CheckpointError(f"{store.root}: per-layer keys such as {per_layer[0]} are not read; tpzoo reads "
                                  f"Megatron-Core's stacked decoder.layers.* tensors")
        self.maps, self.keys = {}, {}
        used = set()
        for entry in megatron_tensors(self.cfg):
            key = next((k for k in entry.keys if k in store.tensors), None)
            if key is None:
                raise CheckpointError(f"{what}: the arguments describe a model with {entry.name}, but the checkpoint "
                                      f"has no {' / '.join(entry.keys)}")
            want = megatron_shape(entry, self.expected[entry.name], self.cfg.num_layers, self.padded)
            got = store.tensors[key].shape
            if tuple(got) != want:
                hint = next((v for k, v in _SHAPE_ARGS.items() if k in key), "the model arguments")
                raise CheckpointError(f"{what}: {key} has shape {list(got)}, but the arguments imply {list(want)} "
                                      f"(check {hint})")
            box = [(entry.layer, 1)] + [(0, n) for n in want[1:]] if entry.layer is not None else [(0, n) for n in want]
            gap = store.missing(key, box)
            if gap:
                where = f" layer {entry.layer}" if entry.layer is not None else ""
                raise CheckpointError(f"{store.root}: no chunk holds {gap} elements of {key}{where} "
                                      f"(a rank's file missing, or an index that does not match the files)")
            self.maps[entry.name], self.keys[entry.name] = entry, key
            used.add(key)
        if self.cfg.tie_embeddings:
            used.add("output_layer.weight")  # the last stage's copy of a tied embedding
        left = sorted(k for k in store.tensors if k not in used and not k.endswith(IGNORED_SUFFIXES))
        if left:
            raise CheckpointError(f"{what}: checkpoint tensor(s) {left[:4]}{' ...' if len(left) > 4 else ''} have no "
                                  f"place in the model the arguments describe ({len(left)} in all)")

    # --- the weight-source interface of write_checkpoint ---------------------------------------------------------

    def check(self, names) -> None:
        missing = [n for n in names if n not in self.maps]
        if missing:
            raise CheckpointError(f"{self.store.root}: no Megatron tensor for {missing[:4]}")

    def full_shape(self, name: str) -> tuple:
        return self.expected[name]

    def check_shape(self, name: str, full_shape: tuple) -> None:
        if self.full_shape(name) != tuple(full_shape):
            raise CheckpointError(f"{self.store.root}: {self.keys[name]} gives {name} the shape {self.full_shape(name)}, "
                                  f"the model config expects {tuple(full_shape)}")

    def dtype(self, name: str) -> torch.dtype:
        return self.store.tensors[self.keys[name]].dtype

    def _boxes(self, name: str, box) -> list:
        """The boxes of the Megatron tensor that make up `box` of the tpzoo tensor, stacked along dim 0."""
        entry = self.maps[name]
        lead = [(entry.layer, 1)] if entry.layer is not None else []
        if not box:
            return [lead]
        return [lead + [rows] + list(box[1:]) for rows in map_rows(entry.rows, *box[0])]

    def read_box(self, name: str, box) -> torch.Tensor:
        key = self.keys[name]
        parts = [self.store.read_box(key, b) for b in self._boxes(name, box)]
        parts = [p.reshape(p.shape[1:]) if self.maps[name].layer is not None else p for p in parts]
        return parts[0] if len(parts) == 1 else torch.cat(parts, dim=0)

    def byte_runs(self, name: str, box):
        runs = []
        for b in self._boxes(name, box):
            r = self.store.byte_runs(self.keys[name], b)
            if r is None:
                return None
            runs += r
        return runs

    def close(self) -> None:
        self.store.close()
