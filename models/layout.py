"""How a model is laid out on this rank (ModelLayout) and which part of the network a Transformer holds (Stage).

One ModelLayout goes to every module that needs to know how it is split: the parallel dims (tp, cp, ep sizes,
this rank's coordinates and groups), sequence parallelism, the context-parallel attention mode, the parameters'
dtype and the device, and the vocabulary padding. Modules read what they need from it; nothing is threaded as a
separate positional flag.

    layout = ModelLayout(dims, sequence_parallel=True, cp_mode="a2a", dtype=torch.bfloat16)
    model = Transformer(cfg, layout, Stage(layers=range(0, 16), post_process=False))
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace

import torch

from tpzoo.errors import ConfigError
from tpzoo.parallel.dims import ParallelDims
from tpzoo.parallel.state import get_dims

CP_MODES = ("ring", "a2a")


@dataclass(frozen=True)
class ModelLayout:
    """dims: the rank's ParallelDims (None: the default dims); sequence_parallel: activations between the TP
    regions hold this rank's 1/tp of the sequence (Megatron's SP); cp_mode: how attention spans the context-parallel
    ranks when dims.cp > 1, "ring" or "a2a" (all-to-all, Ulysses); dtype: the parameters' (None: torch's default);
    device: where Transformer materializes the model (None: dims.device; "meta": left unallocated, for
    materialize() or a checkpoint loader); vocab_padding_multiple: the vocabulary is padded to a multiple of
    tp * this (None: 1, or a checkpoint's own when one is loaded)."""
    dims: ParallelDims = field(default=None)
    sequence_parallel: bool = False
    cp_mode: str = "ring"
    dtype: torch.dtype | None = None
    device: torch.device | str | None = None
    vocab_padding_multiple: int | None = None

    def __post_init__(self):
        object.__setattr__(self, "dims", get_dims(self.dims))
        if self.cp_mode not in CP_MODES:
            raise ConfigError(f"cp_mode must be 'ring' or 'a2a', got {self.cp_mode!r}")
        if self.device is not None:
            object.__setattr__(self, "device", torch.device(self.device))

    @classmethod
    def of(cls, layout: "ModelLayout | ParallelDims | None") -> "ModelLayout":
        """A ModelLayout as given, or the default one over `layout` when it is a ParallelDims (or None)."""
        return layout if isinstance(layout, ModelLayout) else cls(layout)

    def replace(self, **changes) -> "ModelLayout":
        return replace(self, **changes)

    @property
    def tp(self) -> int:
        return self.dims.tp

    @property
    def split_sequence(self) -> bool:
        """Whether activations outside the TP regions are this rank's sequence shard (SP with tp > 1)."""
        return self.sequence_parallel and self.dims.tp > 1

    @property
    def padding_multiple(self) -> int:
        return self.vocab_padding_multiple or 1

    @property
    def build(self) -> dict:
        """What every parallel layer of the model is built with: on meta (Transformer materializes the whole
        model at once), in the layout's dtype, at its dims."""
        return {"dtype": self.dtype, "device": "meta", "dims": self.dims}

    @property
    def linear(self) -> dict:
        """build plus the sequence-parallel switch: the keywords of Column/RowParallelLinear."""
        return {**self.build, "sequence_parallel": self.sequence_parallel}


@dataclass(frozen=True)
class Stage:
    """The part of the network one Transformer (one pipeline chunk) holds: its layers (a range of layer indices;
    None: every layer), whether it embeds the tokens (pre_process, Megatron's word: the first model stage) and
    whether it holds the final norm and the head (post_process: the last model stage)."""
    layers: range | None = None
    pre_process: bool = True
    post_process: bool = True

    def __post_init__(self):
        if self.layers is not None:
            layers = self.layers
            if not isinstance(layers, range):
                layers = range(*layers)  # a (start, stop) pair, as checkpoint manifests store it
            if layers.step != 1 or layers.start < 0 or layers.stop < layers.start:
                raise ConfigError(f"a stage's layers must be a range start..stop, got {self.layers!r}")
            object.__setattr__(self, "layers", layers)

    def resolved(self, num_layers: int) -> "Stage":
        if self.layers is None:
            return replace(self, layers=range(num_layers))
        if self.layers.stop > num_layers:
            raise ConfigError(f"stage layers {self.layers} exceed the model's {num_layers} layers")
        return self

    @classmethod
    def from_manifest(cls, entry: dict) -> "Stage":
        """A checkpoint manifest's `stages` entry ({"layers": [start, stop], "pre_process", "post_process"})."""
        return cls(range(*entry["layers"]), bool(entry["pre_process"]), bool(entry["post_process"]))
