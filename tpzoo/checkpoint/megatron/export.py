"""`tpzoo convert to-megatron`: a tpzoo (or Hugging Face) checkpoint -> a Megatron-LM torch_dist checkpoint.

DST gets Megatron-LM's layout: `latest_checkpointed_iteration.txt` and `release/` (or `iter_NNNNNNN/` with
--iteration), holding the torch_dist files (dist_writer.py) whose common state carries the Megatron-LM `args`
describing the model at the target (tp, pp, ep) (args.py), `checkpoint_version` 3.0 and the iteration. Weights
only: Megatron-LM starts a release checkpoint's optimizer fresh (and with --finetune any). The vocabulary is padded
as Megatron-LM pads it at that tp (make_vocab_size_divisible_by: the value recorded when the checkpoint came
from Megatron, else Megatron's default 128), with zero rows.
"""
from __future__ import annotations

import argparse
import math
from pathlib import Path

import torch

from ..convert import _out_dtype, _progress, _return_freed_memory, parse_dtype
from ..format import CheckpointError, atomic_dir
from ..sources import CheckpointSource, open_source
from .args import args_from_config, padded_vocab
from .dist_writer import DistWriter
from .locate import TRACKER, iteration_dir_name
from .mapping import map_rows, megatron_shape, megatron_tensors
from .source import full_shapes

IMPLS = ("transformer_engine", "local")


def _version(text: str) -> tuple:
    try:
        return tuple(int(x) for x in str(text).split(".")[:2])
    except ValueError:
        raise CheckpointError(f"--megatron-core {text!r}: expected a version such as 0.19") from None


def _chunks(entry, shape: tuple, tp: int, ep: int, experts: int):
    """(tp rank, ep rank, global offsets, sizes) of the chunks Megatron's ranks hold of an entry whose global
    Megatron shape is `shape` (leading layer / expert axes included)."""
    lead = int(entry.layer is not None)
    per_rank = experts // ep if experts else 1
    heads = [([entry.layer] if lead else [], 0)]
    if entry.experts:  # one chunk per expert, owned by its ep rank
        heads = [([entry.layer, e], e // per_rank) for e in range(experts)]
    body = list(shape[len(heads[0][0]):])
    for offs, e in heads:
        if entry.tp_dim is None:
            yield 0, e, tuple(offs + [0] * len(body)), tuple([1] * len(offs) + body)
            continue
        d = entry.tp_dim - (1 if entry.experts else 0)  # the tpzoo dim, counted after the expert axis
        halves = 2 if entry.gated else 1
        part = body[d] // halves // tp
        for r in range(tp):
            for h in range(halves):
                start = [0] * len(body)
                start[d] = h * body[d] // halves + r * part
                sizes = list(body)
                sizes[d] = part
                yield r, e, tuple(offs + start), tuple([1] * len(offs) + sizes)


def _chunk_data(source, entry, offsets: tuple, sizes: tuple, vocab: int, dtype) -> torch.Tensor:
    """The chunk's numbers from the tpzoo tensor: rows mapped back from Megatron's order, vocabulary padding
    zero."""
    lead = (entry.layer is not None) + entry.experts
    box = [(o, n) for o, n in zip(offsets[lead:], sizes[lead:])]
    if entry.experts:
        box = [(offsets[lead - 1], 1)] + box
    start, n = box[0]
    real = min(n, max(0, vocab - start)) if entry.vocab else n
    parts = [source.read_box(entry.name, [rows] + box[1:])
             for rows in map_rows(entry.rows, start, real, inverse=True) if rows[1]]
    if real < n:
        pad = [b[1] for b in box]
        pad[0] = n - real
        parts.append(torch.zeros(pad, dtype=source.dtype(entry.name), device="cpu"))
    data = parts[0] if len(parts) == 1 else torch.cat(parts, dim=0)
    return data.to(dtype).reshape(sizes)


def convert_to_megatron(src, dst, *, tp: int = 1, pp: int = 1, ep: int = 1, iteration: int | None = None,
                        dtype="auto", transformer_impl: str = "transformer_engine", megatron_core: str = "0.19",
                        make_vocab_size_divisible_by: int | None = None, force: bool = False, verify: bool = True,
                        progress: bool = True) -> dict:
    """Write SRC (a tpzoo checkpoint at any layout, or a Hugging Face directory) as a Megatron-LM torch_dist
    checkpoint for (tp, pp, ep); returns the Megatron arguments written."""
    if Path(dst).exists() and not force:
        raise FileExistsError(f"{dst} already exists (pass --force to replace it)")
    if transformer_impl not in IMPLS:
        raise CheckpointError(f"--transformer-impl {transformer_impl!r}: one of {IMPLS}")
    if min(tp, pp, ep) < 1 or (iteration is not None and iteration < 0):
        raise CheckpointError(f"tp, pp and ep must be >= 1 and the iteration >= 0 (got {tp}, {pp}, {ep}, {iteration})")
    _return_freed_memory()
    source = open_source(src, verify=verify)
    try:
        cfg = source.cfg
        if cfg.quantization:  # (Megatron-LM reads unquantized weights)
            raise CheckpointError(f"{src} is kept quantized ({cfg.quantization['format']}): to-megatron writes "
                                  f"unquantized weights; convert its Hugging Face source without --keep-quantized")
        if cfg.mtp is not None:  # (Megatron-Core's mtp.layers.* are not mapped: refused rather than dropped)
            raise CheckpointError(f"{src} has {cfg.mtp_depths} multi-token-prediction depth(s) (docs/models.md), "
                                  f"which to-megatron does not write yet (convert to-hf keeps them for the families "
                                  f"whose checkpoints hold them)")
        recorded = (source.manifest.get("metadata", {}).get("megatron") or {}) \
            if isinstance(source, CheckpointSource) else {}
        base = dict(recorded.get("args") or {})
        divisible = make_vocab_size_divisible_by or base.get("make_vocab_size_divisible_by") or 128
        entries = [e for e in megatron_tensors(cfg, moe_norm_te=transformer_impl == "transformer_engine")
                   if not e.alias]
        source.check([e.name for e in entries])
        expected = full_shapes(cfg)
        for e in entries:
            source.check_shape(e.name, expected[e.name])
        want = parse_dtype(dtype)
        out_dtype = {e.name: _out_dtype(source.dtype(e.name), want) for e in entries}
        main = max(set(out_dtype.values()), key=list(out_dtype.values()).count)
        padded = padded_vocab(cfg.vocab_size, divisible, tp)
        args = args_from_config(cfg, tp=tp, pp=pp, ep=ep, padded=padded, divisible_by=divisible, dtype=main,
                                impl=transformer_impl, base=base)
        common_in_distcp = _version(megatron_core) >= (0, 19)
        common = {"args": argparse.Namespace(**args), "checkpoint_version": 3.0, "iteration": iteration or 0}
        with atomic_dir(dst, force, clean_stale=True) as tmp:
            d = tmp / iteration_dir_name(iteration)
            d.mkdir()
            writer = DistWriter(d)
            try:
                _write(writer, source, entries, expected, cfg, tp, pp, ep, padded, out_dtype, progress)
                writer.finish(common, common_in_distcp)
            finally:
                writer.abort()
            (tmp / TRACKER).write_text(("release" if iteration is None else str(iteration)) + "\n")
        return args
    finally:
        source.close()


def _write(writer, source, entries, expected, cfg, tp, pp, ep, padded, out_dtype, progress) -> None:
    experts, per_stage = cfg.moe.num_experts, cfg.num_layers // pp
    first_stage = ("embed.weight", "pos_embed.weight")  # every other tensor outside the layers is the last stage's
    shapes = {e.name: megatron_shape(e, expected[e.name], cfg.num_layers, padded) for e in entries}
    total = sum(math.prod(shapes[e.name][int(e.layer is not None):]) * out_dtype[e.name].itemsize for e in entries)
    with _progress(total, f"writing Megatron tp={tp} pp={pp}" + (f" ep={ep}" if ep > 1 else ""), progress) as bar:
        for e in entries:
            key, shape = e.keys[0], shapes[e.name]
            if key not in writer.state_md:
                writer.declare(key, shape, out_dtype[e.name])
            stage = e.layer // per_stage if e.layer is not None else 0 if e.name in first_stage else pp - 1
            for r, er, offsets, sizes in _chunks(e, shape, tp, ep, experts):
                data = _chunk_data(source, e, offsets, sizes, cfg.vocab_size, out_dtype[e.name])
                bar.update(writer.chunk(r + tp * (er + ep * stage), key, offsets, data))
            if e.module:  # Megatron-Core saves each layer's (each expert's) linear _extra_state beside it
                for idx in ([(e.layer, x) for x in range(experts)] if e.experts else [(e.layer,)]):
                    dims = (cfg.num_layers, experts)[:len(idx)]
                    owner = tp * ((idx[1] // (experts // ep) if e.experts else 0) + ep * stage)
                    writer.obj(owner, f"{e.module}._extra_state/shard_{'.'.join(map(str, idx))}_"
                                      f"{'.'.join(map(str, dims))}", None)
