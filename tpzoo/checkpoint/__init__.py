"""The sharded checkpoint format, its streaming readers/writers, resharding and HF import/export.

    convert_from_hf(src, dst, tp=2, pp=2)        HF dir -> tpzoo checkpoint (docs/checkpoint-format.md)
    reshard(src, dst, tp=4, pp=1)                 tpzoo -> tpzoo at another layout
    convert_to_hf(src, dst)                       tpzoo -> a directory transformers loads
    load_model(ckpt)                              this rank's part, at the current layout (tpzoo or HF ckpt)
    load_weights_into(model, ckpt)                fill existing chunks
    save_model_shards(model, dir)                 collective save (with atomic_dir for an all-or-nothing write)
    check_structure(dir, read_manifest(dir))      the cheap header checks every reader runs on opening
"""
from .convert import convert_from_hf, convert_to_hf, parse_dtype, reshard, write_checkpoint
from .format import (MANIFEST_NAME, CheckpointError, atomic_dir, is_checkpoint, read_manifest, shard_file_name,
                     verify_file)
from .model_io import load_model, load_weights_into, save_model_shards
from .sources import CheckpointSource, open_source
from .structure import check_structure

__all__ = ["MANIFEST_NAME", "CheckpointError", "CheckpointSource", "atomic_dir", "check_structure",
           "convert_from_hf", "convert_to_hf", "is_checkpoint", "load_model", "load_weights_into", "open_source",
           "parse_dtype", "read_manifest", "reshard", "save_model_shards", "shard_file_name", "verify_file",
           "write_checkpoint"]
