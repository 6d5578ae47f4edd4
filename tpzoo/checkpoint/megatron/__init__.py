"""Megatron-LM checkpoints in and out (docs/checkpoint-format.md, "Megatron-LM").

    convert_from_megatron(src, dst, tp=2, pp=1)   Megatron-LM (torch_dist or legacy, any layout) -> tpzoo
    convert_to_megatron(src, dst, tp=2, pp=2)     tpzoo or Hugging Face -> Megatron-LM torch_dist
    is_megatron_checkpoint(path), describe(path)  what `tpzoo inspect` shows of one

Modules: locate (where the weights are), pickles (reading Megatron's pickles safely), store (global tensors made
of chunks), dist_format / legacy_format (the two formats, read), mapping (tpzoo <-> Megatron tensors), args
(Megatron's arguments <-> ModelConfig), source (the converter's weight source), importer, dist_writer and export
(the torch_dist writer). Megatron itself is never imported.
"""
from .export import convert_to_megatron
from .importer import convert_from_megatron, describe
from .locate import is_megatron_checkpoint

__all__ = ["convert_from_megatron", "convert_to_megatron", "describe", "is_megatron_checkpoint"]
