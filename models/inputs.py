"""What one forward of a Transformer takes (Inputs, LossOptions, Cache) and what its layers share (Context).

    per_token = model(Inputs(ids, labels=labels, doc_ids=doc_ids), loss=LossOptions(z_loss=1e-4))
    logits = model(ids)                                          # a tensor: Inputs(ids)
    cache = model.new_cache(batch=1, max_length=64)              # generation: each layer's own cache
    logits = model(Inputs(prompt), cache, LossOptions(logits_position=-1))

A Context is built once per forward by the Transformer and handed to every layer: the documents of a packed
batch, the token mask, the rotary tables of the tokens' positions (computed once, shared by the layers that use
them), how many tokens the cache already holds and this forward adds, and the per-layer auxiliary outputs the
layers record. (It holds nothing a layer does not use: under full recomputation it lives until the backward.)
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace

import torch

from tpzoo.parallel.eager import eager

from .documents import Documents


@dataclass
class Inputs:
    """One micro-batch as the model sees it. ids [b, s] on the first stage, else hidden [b, s(/tp under SP), h]
    from the previous stage; labels [b, s] (-100: ignored) on the last stage for the per-token loss; positions
    [b, s] of this rank's tokens (None: 0.. s-1 after the cached ones; packed documents restart at 0; required under
    context parallelism); doc_ids [b, S] each token's document in its row's whole sequence (models/documents.py:
    attention stays within documents); token_mask [b, s] the tokens auxiliary statistics count (0: an SFT sample's
    or context parallelism's padding; None: all); aux: the auxiliary sums of the earlier pipeline stages (the
    executor carries them; {} on the first stage when they are to be carried); mtp_ids, mtp_labels [b, s, depths]
    on the last stage: what multi-token prediction's depth k embeds and predicts at each position, t_{i+k} and
    t_{i+k+1} (0 and -100 past the row or its document: tpzoo.data.mtp.with_mtp_targets)."""
    ids: torch.Tensor | None = None
    hidden: torch.Tensor | None = None
    labels: torch.Tensor | None = None
    positions: torch.Tensor | None = None
    doc_ids: torch.Tensor | None = None
    token_mask: torch.Tensor | None = None
    aux: dict | None = None
    mtp_ids: torch.Tensor | None = None
    mtp_labels: torch.Tensor | None = None

    # the data pipeline's batch keys -> fields
    BATCH_KEYS = {"input_ids": "ids", "labels": "labels", "position_ids": "positions", "doc_ids": "doc_ids",
                  "token_mask": "token_mask", "mtp_ids": "mtp_ids", "mtp_labels": "mtp_labels"}

    @classmethod
    def of(cls, inputs) -> "Inputs":
        return inputs if isinstance(inputs, Inputs) else cls(ids=inputs)

    @classmethod
    def from_batch(cls, batch: dict, device=None, **fields) -> "Inputs":
        """A data loader's micro-batch dict (input_ids, labels, position_ids, doc_ids, token_mask), moved to
        `device`; `fields` set or override fields (hidden=..., labels=None, ...)."""
        kw = {name: batch[key] for key, name in cls.BATCH_KEYS.items() if batch.get(key) is not None}
        if device is not None:
            kw = {k: v.to(device, non_blocking=True) for k, v in kw.items()}
        kw.update(fields)
        return cls(**kw)

    def replace(self, **changes) -> "Inputs":
        return replace(self, **changes)

    @property
    def batch_size(self) -> int:
        return (self.ids if self.ids is not None else self.hidden).shape[0]


@dataclass(frozen=True)
class LossOptions:
    """What the last stage computes. label_smoothing, z_loss: of the cross-entropy (with labels;
    tpzoo.parallel.vocab_parallel_cross_entropy). aux_losses: the per-token loss includes the auxiliary losses of
    the layer kinds that train with them (a mixture of experts' router losses, when its config asks for them);
    False: the language model's loss alone (evaluation), the auxiliary losses still computed into
    Transformer.aux_reports. fused: the head and the loss in token chunks, never all the logits
    (models/lm_head.py). logits_position (without labels): only that position's logits, [b, 1, V'/tp].
    mtp (with labels, on a model with multi-token prediction): None leaves its depths out; a weight S computes
    their mean loss (Transformer.aux_reports["mtp_loss"]) and, S > 0 under autograd, trains them by S times it
    (models/mtp.py). hidden (without labels): return (logits shard, the final norm's output): a draft's input."""
    label_smoothing: float = 0.0
    z_loss: float = 0.0
    aux_losses: bool = True
    fused: bool = True
    logits_position: int | None = None
    mtp: float | None = None
    hidden: bool = False


class Cache:
    """Generation state of one Transformer chunk: each layer's cache, made by its token mixer
    (`new_cache(batch, max_length)`: a KV cache, or a kind's own state, or None when it keeps nothing), and the
    number of tokens decoded so far (`length`: the model tracks it, no layer has to)."""

    def __init__(self, layers: dict, batch: int, max_length: int):
        self.layers, self.batch, self.max_length, self.length = layers, batch, max_length, 0

    def __getitem__(self, layer: int):
        return self.layers[layer]


@dataclass
class Context:
    """What the layers of one forward share (see the module docstring). length: the tokens of this forward per
    row on this rank (the whole sequence, not SP's shard); docs: the packed batch's documents (or None);
    token_mask [tokens of this rank's (SP) shard] or None; past: tokens already in the cache (query i sits at
    position past + i); rotary: RotarySpec -> (cos, sin) of the tables this chunk's layers use; positions [b or 1,
    s]: the tokens' positions (the rotary's: restarting per document, global under cp), when a layer of the chunk
    reads them (`reads_positions`: Mistral 4's query temperature), else None; shared: what a layer
    hands later layers of the same forward ({(key, layer): value}, e.g. a sparse attention layer's top-k that the
    next layers reuse: models/kinds/sparse_mla.py)."""
    length: int
    docs: Documents | None = None
    token_mask: torch.Tensor | None = None
    past: int = 0
    rotary: dict = field(default_factory=dict)
    records: dict = field(default_factory=dict)
    positions: torch.Tensor | None = None
    shared: dict = field(default_factory=dict)

    def shared_tensors(self) -> list:
        """The tensors every layer reads (the rotary tables): what a recomputed block keeps as its inputs."""
        return [t for pair in self.rotary.values() for t in pair]

    @eager  # Python state across layers: a compiled block would guard on how many records there are (recompiles)
    def record(self, layer: int, key: str, value) -> None:
        """A layer's auxiliary output of this forward (e.g. a router's statistics, models/kinds/moe.py), gathered
        per key by the Transformer (models/aux.py). A recomputation (activation checkpointing) records the same
        entry again: it overwrites, never adds."""
        self.records[(key, layer)] = value

    def recorded(self, key: str) -> list:
        """The values recorded under `key`, in layer order."""
        return [v for (k, _), v in sorted(self.records.items(), key=lambda kv: kv[0][1]) if k == key]
