"""Megatron-Core's torch_dist format, read without Megatron: torch.distributed.checkpoint's files.

`.metadata` lists every global tensor (its shape, dtype and the chunks the saving ranks held: offsets and sizes)
and where each chunk's bytes are (file, offset, length). A tensor chunk is a torch.save archive of one contiguous
tensor; only its directory and data.pkl are read to learn where its elements start (pickles.tensor_layout), then
any box of it is a set of positioned reads (checkpoint.safetensors_io.TensorFile), never the whole chunk.

Non-tensor items (BytesIO) are Megatron's ShardedObjects: Transformer Engine's `_extra_state`, RNG and optimizer
bookkeeping, and, from Megatron-Core 0.19 on, the common state (`common_state/shard_0_1`: torch.save([state])).
Up to 0.18 the common state is `common.pt` beside the .distcp files. Both are read (common.pt first, as
Megatron-Core does).
"""
from __future__ import annotations

import os
from pathlib import Path

from ..format import CheckpointError
from ..safetensors_io import TensorFile
from .pickles import load_weights_only, read_dcp_metadata, tensor_layout
from .store import Chunk, GlobalTensor, MegatronStore

COMMON_PT = "common.pt"
COMMON_STATE_PREFIX = "common_state/"


class _ChunkFiles:
    """One TensorFile per .distcp file; a chunk's layout is parsed the first time it is read."""

    def __init__(self, root: Path):
        self.root, self.files = root, {}

    def file(self, rel: str) -> TensorFile:
        if rel not in self.files:
            self.files[rel] = TensorFile(self.root / rel, {})
        return self.files[rel]

    def entry(self, key: str, info) -> tuple[TensorFile, str]:
        tf, name = self.file(info.relative_path), f"{key}@{info.offset}"
        if name not in tf.tensors:
            if getattr(info, "transform_descriptors", None):
                raise CheckpointError(f"{self.root / info.relative_path}: chunk of {key} is stored with "
                                      f"transforms {info.transform_descriptors} (compressed?), which tpzoo does not read")
            loc = tensor_layout(tf.fd, info.offset, info.length,
                                f"{self.root / info.relative_path} (chunk of {key} at byte {info.offset})")
            tf.tensors[name] = (loc.dtype, loc.shape, loc.start, loc.start + loc.nbytes)
        return tf, name

    def read_bytes(self, info) -> bytes:
        data = os.pread(self.file(info.relative_path).fd, info.length, info.offset)
        if len(data) != info.length:
            raise CheckpointError(f"{self.root / info.relative_path}: short read (truncated?)")
        return data

    def close(self):
        for f in self.files.values():
            f.close()
        self.files.clear()


def _chunk(files: _ChunkFiles, key: str, offsets, sizes, info) -> Chunk:
    def read(box):
        tf, name = files.entry(key, info)
        return tf.read_box(name, box).reshape([n for _, n in box])

    def runs(box):
        tf, name = files.entry(key, info)
        return [(tf.fd, off, n) for off, n in tf.byte_runs(name, box)]

    return Chunk(tuple(offsets), tuple(sizes), read, runs)


def open_dist(d: Path, is_model_key) -> MegatronStore:
    """The torch_dist checkpoint in iteration directory `d`; `is_model_key(key)` says which tensors are model
    weights (the rest, optimizer state and the like, are listed as ignored)."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    meta = read_dcp_metadata(d / ".metadata") if (d / ".metadata").is_file() else None
    if meta is None:
        raise CheckpointError(f"{d}: no .metadata (torch.distributed.checkpoint's index of the .distcp files)")
    where = {(idx.fqn, tuple(idx.offset) if idx.offset is not None else None): info
             for idx, info in meta.storage_data.items()}
    ends: dict[str, int] = {}
    for info in meta.storage_data.values():
        ends[info.relative_path] = max(ends.get(info.relative_path, 0), info.offset + info.length)
    files = []
    for rel, end in sorted(ends.items()):
        path = d / rel
        if not path.is_file():
            raise CheckpointError(f"missing checkpoint file {path} (.metadata lists chunks in it)")
        size = path.stat().st_size
        if size < end:
            raise CheckpointError(f"{path} is {size} bytes, but .metadata places data up to byte {end}: truncated")
        files.append((rel, size))
    chunk_files = _ChunkFiles(d)
    tensors, ignored, common = {}, [], None
    for key, md in meta.state_dict_metadata.items():
        if not isinstance(md, TensorStorageMetadata):
            if key.startswith(COMMON_STATE_PREFIX):
                common = where.get((key, None))
            continue
        if not is_model_key(key):
            ignored.append(key)
            continue
        t = GlobalTensor(key, tuple(md.size), md.properties.dtype)
        for c in md.chunks:
            info = where.get((key, tuple(c.offsets)))
            if info is None:
                raise CheckpointError(f"{d / '.metadata'}: no storage entry for the chunk of {key} at {list(c.offsets)}")
            t.chunks.append(_chunk(chunk_files, key, c.offsets, c.sizes, info))
        tensors[key] = t
    if (d / COMMON_PT).is_file():  # Megatron-Core <= 0.18 (and read first by later versions, as they do)
        state = load_weights_only(str(d / COMMON_PT), f"{d / COMMON_PT}")
    elif common is not None:  # >= 0.19: torch.save([common state dict]) inside a .distcp file
        loaded = load_weights_only(chunk_files.read_bytes(common), f"{d / common.relative_path} (common state)")
        state = loaded[0] if isinstance(loaded, (list, tuple)) and loaded else loaded
    else:
        state = {}
    if not isinstance(state, dict):
        raise CheckpointError(f"{d}: the common state is a {type(state).__name__}, not a dict")
    return MegatronStore(d, "torch_dist", tensors, state, {}, files, chunk_files.close, ignored)
