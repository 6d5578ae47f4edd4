"""A Megatron checkpoint as global tensors made of chunks, whatever its format.

torch_dist stores exactly that: every tensor by its global shape (decoder layers stacked on a leading axis, the
experts of a layer on the next one), as chunks that the saving ranks held. A legacy checkpoint's per-rank state
dicts are brought to the same picture when opened (legacy_format.py): each local tensor becomes the chunk of the
global tensor it is a shard of. So one reader (`read_box`) serves both, and reads only the chunks a box crosses,
each only where it overlaps the box.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch

Box = list  # [(start, length)] per dim


@dataclass
class Chunk:
    offsets: tuple            # where it starts in the global tensor, per dim
    sizes: tuple
    read: Callable            # (box inside the chunk) -> tensor
    runs: Callable | None = None  # (box inside the chunk) -> [(fd, offset, length)] of its bytes, or None


@dataclass
class GlobalTensor:
    key: str
    shape: tuple
    dtype: torch.dtype
    chunks: list = field(default_factory=list)


@dataclass
class MegatronStore:
    """`tensors` by Megatron key; `state` the common state (args, iteration, checkpoint_version, ...)."""
    root: Path                # the iteration directory
    format: str               # "torch_dist" | "legacy"
    tensors: dict
    state: dict
    layout: dict              # {"tp", "pp", "ep", "virtual_stages"} the checkpoint was saved at
    files: list               # [(relative path, bytes)]
    close: Callable = lambda: None
    ignored: list = field(default_factory=list)  # keys that are not model weights (optimizer state, ...)

    @property
    def args(self) -> dict:
        args = self.state.get("args")
        return dict(vars(args)) if args is not None and hasattr(args, "__dict__") else dict(args or {})

    def missing(self, key: str, box: Box) -> int:
        """How many elements of `box` no chunk holds (0 for a complete checkpoint; a rank's file lost shows
        here). Chunks of a tensor never overlap: each element is saved once."""
        covered = 0
        for c in self.tensors[key].chunks:
            sizes = [min(s + n, o + k) - max(s, o) for (s, n), o, k in zip(box, c.offsets, c.sizes)]
            covered += math.prod(max(0, x) for x in sizes)
        return math.prod(n for _, n in box) - covered

    def _pieces(self, key: str, box: Box):
        """(chunk, box inside the chunk, box inside `box`) for each chunk that `box` crosses."""
        t = self.tensors[key]
        if len(box) != len(t.shape) or any(s < 0 or s + n > d for (s, n), d in zip(box, t.shape)):
            raise IndexError(f"{key}: box {box} outside {list(t.shape)}")
        out = []
        for c in t.chunks:
            inner, outer = [], []
            for (s, n), o, k in zip(box, c.offsets, c.sizes):
                lo, hi = max(s, o), min(s + n, o + k)
                if lo >= hi:
                    break
                inner.append((lo - o, hi - lo))
                outer.append((lo - s, hi - lo))
            else:
                out.append((c, inner, outer))
        return out

    def read_box(self, key: str, box: Box) -> torch.Tensor:
        pieces = self._pieces(key, box)
        if len(pieces) == 1:
            c, inner, _ = pieces[0]
            return c.read(inner)
        out = torch.empty([n for _, n in box], dtype=self.tensors[key].dtype, device="cpu")
        for c, inner, outer in pieces:
            out[tuple(slice(s, s + n) for s, n in outer)] = c.read(inner)
        return out

    def byte_runs(self, key: str, box: Box):
        """The file byte ranges holding exactly `box` (row-major), when one chunk with known bytes holds it all."""
        pieces = self._pieces(key, box)
        if len(pieces) != 1 or pieces[0][0].runs is None:
            return None
        return pieces[0][0].runs(pieces[0][1])

    def describe(self) -> list[str]:
        """One line per tensor: key, global shape, dtype, chunk count."""
        return [f"  {t.key:64s} {str(list(t.shape)):22s} {str(t.dtype).replace('torch.', ''):9s} "
                f"{len(t.chunks)} chunk(s)" for t in self.tensors.values()]
