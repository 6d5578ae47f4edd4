"""`tpzoo convert from-megatron`: a Megatron-LM checkpoint (torch_dist or legacy, any tp / pp / ep) -> tpzoo.

The same streaming writer as `convert from-hf` (checkpoint/convert.py write_checkpoint) over a MegatronSource:
each output shard is read piece by piece from just the Megatron chunks it needs, into a temporary directory
renamed into place when complete. Every check (files, arguments, tensor shapes, the tokenizer) runs before any
output exists. The manifest's metadata records where the weights came from and what the way back needs
(metadata.megatron: format, iteration, the layout saved at, padded_vocab_size, make_vocab_size_divisible_by, the
arguments as JSON), and `--tokenizer` is saved with the weights (Megatron checkpoints carry none).
"""
from __future__ import annotations

import tempfile
from pathlib import Path

from ..convert import _return_freed_memory, parse_dtype, write_checkpoint
from ..format import CheckpointError, atomic_dir
from .args import read_args_file, recorded_args
from .source import MegatronSource


def _tokenizer(spec):
    """The tokenizer `--tokenizer` names, loaded now so that a bad spec fails before anything is read."""
    if spec is None:
        return None
    from tpzoo.data.tokenizer import load_tokenizer

    return load_tokenizer(spec)


def convert_from_megatron(src, dst, *, tp: int = 1, pp: int = 1, ep: int = 1, megatron_args=None, tokenizer=None,
                          dtype="auto", force: bool = False, vocab_padding_multiple: int = 1,
                          virtual_stages: int = 1, progress: bool = True, checksum: str = "crc32") -> dict:
    """Megatron-LM checkpoint directory (the save directory or one iteration's) -> tpzoo checkpoint at (tp, pp).
    `ep` only checks that the experts split evenly: a tpzoo checkpoint holds every expert and loads at any ep."""
    if Path(dst).exists() and not force:
        raise FileExistsError(f"{dst} already exists (pass --force to replace it)")
    overrides = read_args_file(megatron_args) if megatron_args else {}
    tok = _tokenizer(tokenizer)
    _return_freed_memory()
    source = MegatronSource(src, overrides, vocab_size=tok.vocab_size if tok is not None else None)
    try:
        cfg, store = source.cfg, source.store
        experts = cfg.moe.num_experts
        if ep < 1 or (ep > 1 and (not experts or experts % ep)):
            raise CheckpointError(f"--ep {ep}: the model has {experts or 'no'} experts")
        notes = []
        if cfg.vocab_size < source.padded:
            notes.append(f"megatron: the {source.padded - cfg.vocab_size} padded vocabulary rows are dropped "
                         f"(Megatron's loss also normalizes over them; `convert to-megatron` pads again)")
        elif not source.args.get("vocab_size") and tok is None:
            notes.append(f"megatron: no vocab_size in the arguments and no --tokenizer: the padded vocabulary "
                         f"({source.padded}) is kept whole")
        megatron = {"format": store.format, "iteration": source.iteration, "layout": store.layout,
                    "padded_vocab_size": source.padded,
                    "make_vocab_size_divisible_by": source.args.get("make_vocab_size_divisible_by", 128),
                    "args": recorded_args(source.args)}
        meta = {"source": str(src), "source_format": f"megatron-{store.format}", "megatron": megatron}
        if tokenizer is not None:
            meta["tokenizer"] = str(tokenizer)
        if notes:
            meta["notes"] = notes
        with tempfile.TemporaryDirectory(prefix="tpzoo-megatron-aux-") as aux:
            if tok is not None:
                tok.save(aux)
            source.aux_dir = aux
            with atomic_dir(dst, force, clean_stale=True) as tmp:
                return write_checkpoint(source, tmp, tp=tp, pp=pp, virtual_stages=virtual_stages,
                                        dtype=parse_dtype(dtype), vocab_padding_multiple=vocab_padding_multiple,
                                        metadata=meta, progress=progress, checksum=checksum)
    finally:
        source.close()


def describe(src, tensors: bool = True) -> list[str]:
    """`tpzoo inspect` of a Megatron-LM directory: format, iteration, layout, the arguments that shape the model,
    and (tensors) every global tensor."""
    from .source import open_store

    store, iteration = open_store(src, {})
    try:
        a = store.args
        lines = [f"Megatron-LM checkpoint {store.root} ({store.format}, "
                 f"{'release' if iteration is None else f'iteration {iteration}'}, "
                 f"checkpoint_version {store.state.get('checkpoint_version')})",
                 "layout: " + " ".join(f"{k}={v}" for k, v in store.layout.items()),
                 f"files: {len(store.files)}, {sum(n for _, n in store.files)} bytes"]
        if a:
            lines.append("arguments:")
            shown = ("num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads", "group_query_attention",
                     "num_query_groups", "kv_channels", "normalization", "norm_epsilon", "swiglu",
                     "position_embedding_type", "rotary_base", "rotary_percent", "add_bias_linear", "add_qkv_bias",
                     "untie_embeddings_and_output_weights", "max_position_embeddings", "seq_length",
                     "padded_vocab_size", "vocab_size", "make_vocab_size_divisible_by", "num_experts",
                     "moe_router_topk", "moe_ffn_hidden_size", "params_dtype", "tokenizer_type", "transformer_impl")
            lines += [f"  {k} = {a[k]!r}" for k in shown if a.get(k) is not None]
        else:
            lines.append("arguments: none saved (from-megatron needs --megatron-args)")
        lines.append(f"tensors: {len(store.tensors)} (+ {len(store.ignored)} not model weights)")
        return lines + (store.describe() if tensors else [])
    finally:
        store.close()
