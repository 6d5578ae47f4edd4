"""Writing Megatron-Core's torch_dist format: the files torch.distributed.checkpoint would write, chunk by chunk.

Each tensor is written as the chunks Megatron's ranks at the target (tp, pp, ep) would save: one per layer and tp
rank (a SwiGLU linear_fc1's gate and up halves apart, one per expert), each a torch.save archive appended to the
file of the rank that owns it (`__R_0.distcp`, R = Megatron's global rank with dp = ep: tp fastest, then ep,
then pp). So memory holds one chunk at a time, and Megatron-Core, which reads any chunking, reads exactly its
own. Then `.metadata` indexes them (torch.distributed.checkpoint's own dataclasses, pickled as it does), and
`metadata.json` names the torch_dist backend.
"""
from __future__ import annotations

import io
import pickle
import uuid
from pathlib import Path

import torch

from .dist_format import COMMON_PT, COMMON_STATE_PREFIX

DCP_VERSION = "1.0.0"
CHECKPOINTING_CONFIG = {"sharded_backend": "torch_dist", "sharded_backend_version": 1, "common_backend": "torch",
                        "common_backend_version": 1}


def _standalone(t: torch.Tensor) -> torch.Tensor:
    """torch.save writes a view's whole storage: give it a tensor of its own."""
    t = t.contiguous()
    return t if t.untyped_storage().nbytes() == t.numel() * t.element_size() else t.clone()


class DistWriter:
    """Chunks and byte objects appended to per-rank files, then `finish()` writes the index."""

    def __init__(self, out_dir: Path):
        self.dir = Path(out_dir)
        self.files: dict[int, object] = {}
        self.state_md: dict = {}
        self.storage: dict = {}

    def _file(self, rank: int):
        if rank not in self.files:
            self.files[rank] = open(self.dir / f"__{rank}_0.distcp", "wb")
        return self.files[rank]

    def _append(self, rank: int, write) -> tuple[str, int, int]:
        f = self._file(rank)
        start = f.tell()
        write(f)
        return f"__{rank}_0.distcp", start, f.tell() - start

    def declare(self, key: str, shape: tuple, dtype: torch.dtype) -> None:
        from torch.distributed.checkpoint.metadata import TensorProperties, TensorStorageMetadata

        self.state_md[key] = TensorStorageMetadata(TensorProperties(dtype=dtype), torch.Size(shape), [])

    def chunk(self, rank: int, key: str, offsets: tuple, tensor: torch.Tensor) -> int:
        """Append one chunk (its global offsets; its shape is the chunk's, leading layer / expert dims of 1
        included); returns its bytes."""
        from torch.distributed.checkpoint.filesystem import _StorageInfo
        from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex

        tensor = _standalone(tensor)
        path, start, length = self._append(rank, lambda f: torch.save(tensor, f))
        self.state_md[key].chunks.append(ChunkStorageMetadata(torch.Size(offsets), tensor.shape))
        self.storage[MetadataIndex(key, offsets)] = _StorageInfo(path, start, length)
        return tensor.numel() * tensor.element_size()

    def obj(self, rank: int, key: str, value) -> None:
        """A ShardedObject as Megatron-Core writes it: torch.save([value]) under its unique key."""
        from torch.distributed.checkpoint.filesystem import _StorageInfo
        from torch.distributed.checkpoint.metadata import BytesStorageMetadata, MetadataIndex

        buf = io.BytesIO()
        torch.save([value], buf)
        path, start, length = self._append(rank, lambda f: f.write(buf.getbuffer()))
        self.state_md[key] = BytesStorageMetadata()
        self.storage[MetadataIndex(key)] = _StorageInfo(path, start, length)

    def finish(self, common: dict, common_in_distcp: bool) -> None:
        """The common state (inside the .distcp files as Megatron-Core >= 0.19 writes it, else common.pt), then
        `.metadata` and metadata.json."""
        import json

        from torch.distributed.checkpoint.metadata import Metadata, StorageMeta

        if common_in_distcp:
            self.obj(0, f"{COMMON_STATE_PREFIX}shard_0_1", common)
        else:
            torch.save(common, self.dir / COMMON_PT)
        for f in self.files.values():
            f.close()
        self.files.clear()
        meta = Metadata(self.state_md, None, self.storage, StorageMeta(str(self.dir.name), uuid.uuid4().hex),
                        DCP_VERSION)
        with open(self.dir / ".metadata", "wb") as f:
            pickle.dump(meta, f)
        (self.dir / "metadata.json").write_text(json.dumps(CHECKPOINTING_CONFIG))

    def abort(self) -> None:
        for f in self.files.values():
            f.close()
        self.files.clear()
