"""Weight sources, and building any rank's shard from one by reading only the bytes it needs.

A source answers, for a tpzoo tensor name: its full (unpadded) shape, its dtype, and `read_box(name, box)`: a box
(per-dim (start, length)) of the full tensor. Two sources exist: a tpzoo checkpoint (any layout: the box is read
from the shard files that hold its ranges) and a Hugging Face checkpoint (hf.HFSource). `shard_pieces` then
produces a target rank's shard, in row pieces of bounded size, from either: conversion, resharding and
load-time resharding are this one loop.
"""
from __future__ import annotations

import math
from pathlib import Path

import torch

from .format import CheckpointError, file_entry, is_checkpoint, read_manifest, refuse_temp_dir, verify_file
from .layout import ParamInfo, local_segments, spec_from_json, state_tensors
from .safetensors_io import COPY_MIN_RUN, DTYPES, SafetensorsReader
from .st_writer import FileRuns
from .structure import check_structure

PIECE_BYTES = 16 << 20  # memory per piece while streaming: bounded whatever the tensor size


def tied_aliases(cfg) -> dict[str, str]:
    """tpzoo names that are copies of another tensor (a tied head) -> the tensor they copy."""
    from tpzoo.models.registry import get_family

    maps = get_family(cfg.family).hf_tensor_map(cfg)
    owner = {m.hf: m.name for m in maps if m.export}
    return {m.name: owner[m.hf] for m in maps if not m.export and m.hf in owner}


class CheckpointSource:
    """A tpzoo checkpoint directory. Opening it runs the structural check (structure.py: the manifest against
    itself, the model config and every shard file's size and header), with or without verify; a shard file's
    checksum (verify=True) is checked the first time it is read. So a damaged checkpoint is reported, naming the
    file or tensor, before any of it is used."""

    kind = "tpzoo"

    def __init__(self, path, verify: bool = True):
        from tpzoo.models.config import ModelConfig

        self.root = Path(path)
        self.manifest = m = read_manifest(self.root)
        self.cfg = ModelConfig.from_dict(m["model_config"])
        check_structure(self.root, m)
        self.tp, self.pp, self.stages = m["tp"], m["pp"], m["stages"]
        self.vocab_padded = m["vocab"]["padded"]
        self.padding_multiple = m["vocab"].get("padding_multiple", 1)
        self.tensors = m["tensors"]
        self.verify = verify
        self.aliases = tied_aliases(self.cfg)
        self.aux_dir = self.root
        self._readers: dict[tuple[int, int], SafetensorsReader] = {}
        self._index: dict[str, list] = {}

    def resolve(self, name: str) -> str:
        if name in self.tensors:
            return name
        if self.aliases.get(name) in self.tensors:
            return self.aliases[name]
        raise CheckpointError(f"checkpoint {self.root} has no tensor {name!r}")

    def check(self, names) -> None:
        missing = [n for n in names if n not in self.tensors and self.aliases.get(n) not in self.tensors]
        if missing:
            raise CheckpointError(f"checkpoint {self.root} is missing tensor(s) {missing[:8]} ({len(missing)} in all)")

    def full_shape(self, name: str) -> tuple:
        return tuple(self.tensors[self.resolve(name)]["shape"])

    def dtype(self, name: str) -> torch.dtype:
        return DTYPES[self.tensors[self.resolve(name)]["dtype"]]

    def check_shape(self, name: str, full_shape: tuple) -> None:
        if self.full_shape(name) != tuple(full_shape):
            raise CheckpointError(f"shape mismatch for {name}: the checkpoint has {self.full_shape(name)}, the model "
                             f"(config) expects {tuple(full_shape)}")

    def _reader(self, tp_rank: int, pp_rank: int) -> SafetensorsReader:
        key = (tp_rank, pp_rank)
        if key not in self._readers:
            path = verify_file(self.root, file_entry(self.manifest, tp_rank, pp_rank), checksum=self.verify)
            self._readers[key] = SafetensorsReader(path)
        return self._readers[key]

    def _segments(self, name: str) -> list[tuple[int, int, int, int]]:
        """(full start, length, tp rank, local start) of every range of the split dim held by some shard."""
        if name not in self._index:
            t = self.tensors[name]
            spec = spec_from_json(t["split"])
            d = spec.dim % len(t["shape"])
            full_len = self.vocab_padded if t.get("vocab_dim") == d else t["shape"][d]
            index = []
            for q in range(self.tp):
                local = 0
                for start, n in local_segments(spec, full_len, q, self.tp):
                    index.append((start, n, q, local))
                    local += n
            self._index[name] = index
        return self._index[name]

    def _locate(self, name: str, box):
        """(split dim, [(reader, box in that shard)]) covering `box` of the full tensor, in order."""
        t = self.tensors[name]
        spec = spec_from_json(t["split"])
        if spec.dim is None:
            return 0, [(self._reader(0, t["pp_rank"]), box)]
        d = spec.dim % len(t["shape"])
        pos, end = box[d][0], box[d][0] + box[d][1]
        pieces = []
        while pos < end:  # cover [pos, end) of the split dim with ranges of the shards that hold them
            for start, n, q, local in self._segments(name):
                if start <= pos < start + n:
                    take = min(end, start + n) - pos
                    sub = list(box)
                    sub[d] = (local + pos - start, take)
                    pieces.append((self._reader(q, t["pp_rank"]), sub))
                    pos += take
                    break
            else:
                raise CheckpointError(f"{self.root}: no shard holds {name}[{pos}] along dim {d}")
        return d, pieces or [(self._reader(0, t["pp_rank"]), box)]

    def read_box(self, name: str, box) -> torch.Tensor:
        name = self.resolve(name)
        d, pieces = self._locate(name, box)
        tensors = [reader.read_box(name, sub) for reader, sub in pieces]
        return tensors[0] if len(tensors) == 1 else torch.cat(tensors, dim=d)

    def byte_runs(self, name: str, box):
        """[(fd, offset, length)] holding exactly the bytes of `box`, or None when they interleave."""
        name = self.resolve(name)
        d, pieces = self._locate(name, box)
        if d != 0 and len(pieces) > 1:
            return None
        return [(reader.fd, off, n) for reader, sub in pieces for off, n in reader.byte_runs(name, sub)]

    def close(self) -> None:
        for r in self._readers.values():
            r.close()
        self._readers.clear()


def open_source(path, verify: bool = True, dtype: torch.dtype | None = None):
    """A tpzoo checkpoint (a directory with manifest.json) or a Hugging Face checkpoint (anything else; quantized
    weights dequantized to `dtype`, default its own). Never the temporary directory of an unfinished write,
    whatever it holds."""
    from .hf import HFSource

    refuse_temp_dir(path)
    return CheckpointSource(path, verify) if is_checkpoint(path) else HFSource(path, dtype=dtype)


def check_source(source, infos: list[ParamInfo]) -> None:
    """Every needed tensor is present with the full shape the model expects (one clear error otherwise)."""
    source.check([i.name for i in infos])
    for i in infos:
        source.check_shape(i.name, tuple(i.full_shape))


def shard_pieces(source, info: ParamInfo, rank: int, tp: int, max_bytes: int | None = None, as_runs: bool = False):
    """Rank `rank`'s shard of `info.name` at tensor-parallel size tp, as consecutive row-major pieces (each at
    most about max_bytes, default PIECE_BYTES). Vocab padding rows are zeros; the rest is read from `source`.
    as_runs: a piece that is a byte range of a source file comes as FileRuns (for a kernel-side copy)."""
    max_bytes = max_bytes or PIECE_BYTES
    full, spec = list(info.full_shape), info.spec
    if not full:
        yield source.read_box(info.name, [])
        return
    d = 0 if spec.dim is None else spec.dim % len(full)
    if spec.dim is None:  # replicated over tp: whole, but only its experts on an expert-parallel rank
        first, end = info.rows or (0, full[0])
        segments = [(first, end - first)]
    else:
        segments = local_segments(spec, info.padded if info.vocab_dim == d else full[d], rank, tp)
    dtype = source.dtype(info.name)
    esize = dtype.itemsize
    real = full[d]  # rows at or past it are vocab padding

    def read(box, runs_ok: bool) -> list:
        start, n = box[d]
        have = min(n, max(0, real - start))
        parts = []
        if have:
            real_box = box[:d] + [(start, have)] + box[d + 1:]
            runs = source.byte_runs(info.name, real_box) if runs_ok and hasattr(source, "byte_runs") else None
            if runs and sum(r[2] for r in runs) < COPY_MIN_RUN * len(runs):
                runs = None  # a system call per tiny run: reading the span and writing from memory is faster
            parts.append(FileRuns(runs, dtype) if runs else source.read_box(info.name, real_box))
        if n - have:
            shape = [b[1] for b in box]
            shape[d] = n - have
            parts.append(torch.zeros(shape, dtype=dtype, device="cpu"))
        return parts

    whole = [(0, n) for n in full]
    if d == 0:  # pieces are runs of rows inside each range
        step = max(1, max_bytes // max(1, math.prod(full[1:]) * esize))
        for start, n in segments:
            for s in range(start, start + n, step):
                yield from read([(s, min(step, start + n - s))] + whole[1:], as_runs)
    else:  # dim 0 is whole: pieces are runs of rows, each the concatenation of the ranges along d
        # Sized by the full row: a piece's rows, all columns, fit in max_bytes, so one read of that span can
        # serve every tp rank's piece (SafetensorsReader keeps the last span; the converter goes round-robin).
        step = max(1, max_bytes // max(1, math.prod(full[1:]) * esize))
        first, end = info.rows or (0, full[0])  # an expert-parallel rank reads only its experts
        for r in range(first, end, step):
            rows = (r, min(step, end - r))
            parts = [p for seg in segments
                     for p in read([rows] + whole[1:d] + [seg] + whole[d + 1:], as_runs and len(segments) == 1)]
            yield parts[0] if len(parts) == 1 else torch.cat(parts, dim=d)


def fill_params(model, source, infos: list[ParamInfo], rank: int, tp: int) -> None:
    """Copy this rank's shard of every tensor `infos` names (parameters and persistent buffers) of `model` from
    `source` (cast to the tensor's dtype)."""
    params = dict(state_tensors(model))
    for info in infos:
        p = params[info.name]
        flat = p.data.view(-1)
        offset = 0
        for piece in shard_pieces(source, info, rank, tp):
            n = piece.numel()
            flat[offset: offset + n].copy_(piece.reshape(-1))
            offset += n
        if offset != p.numel():
            raise CheckpointError(f"{info.name}: filled {offset} of {p.numel()} elements")
