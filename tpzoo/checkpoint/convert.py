"""Streaming conversion: HF -> tpzoo at any (tp, pp), tpzoo -> tpzoo at another layout, tpzoo -> HF.

Headers are computed from shapes first; then every output file is filled piece by piece (sources.shard_pieces):
byte ranges that a shard takes unchanged are copied by the kernel (st_writer.FileRuns), the rest is read as
exact slices. Fused (q|k|v, gate|up) and transposed (GPT-2) tensors are read slice by slice from their HF parts
(hf.concat_structure); only a mapping of another kind is assembled whole, one tensor at a time. So memory stays
near a few pieces (`sources.PIECE_BYTES`). Output goes to a temporary directory renamed into place when complete
(atomic.atomic_dir); what an earlier, killed conversion into the same destination left is removed first.
Sources run the structural check on opening (structure.py), so a damaged input fails before any output.
"""
from __future__ import annotations

import itertools
import json
import math
import re
from pathlib import Path

import torch

from tpzoo.errors import ConfigError
from tpzoo.parallel.sharding import ShardSpec
from tpzoo.quant import stored_names

from . import sources
from .format import atomic_dir, aux_files_in, copy_aux_files, make_manifest, shard_file_name, write_manifest
from .hf import HFSource, concat_structure, hf_config_for
from .layout import ParamInfo, empty_meta, layout_plan, partition, spec_to_json, stages_from_ranges
from .lora_io import lora_config_of
from .safetensors_io import COPY_MIN_RUN, dtype_name, nbytes
from .sources import CheckpointSource, check_source, shard_pieces
from .st_writer import FileRuns, SafetensorsWriter

DTYPE_ARGS = {"auto": None, "fp32": torch.float32, "float32": torch.float32, "bf16": torch.bfloat16,
              "bfloat16": torch.bfloat16, "fp16": torch.float16, "float16": torch.float16}
SAFETENSORS_META = {"format": "pt"}  # transformers refuses safetensors files without it


def parse_dtype(value) -> torch.dtype | None:
    if value is None or isinstance(value, torch.dtype):
        return value
    if value not in DTYPE_ARGS:
        raise ConfigError(f"dtype must be one of {sorted(DTYPE_ARGS)}, got {value!r}")
    return DTYPE_ARGS[value]


def _out_dtype(src_dtype: torch.dtype, dtype: torch.dtype | None) -> torch.dtype:
    return dtype if dtype is not None and src_dtype.is_floating_point else src_dtype


def _progress(total: int, desc: str, enabled: bool):
    from tpzoo.progress import progress_bar

    return progress_bar(enabled, total=total, desc=desc, unit="B", unit_scale=True, unit_divisor=1024,
                        dynamic_ncols=True)


def write_checkpoint(source, out_dir, *, tp: int, pp: int, virtual_stages: int = 1, stages: list | None = None,
                     dtype: torch.dtype | None = None, vocab_padding_multiple: int = 1,
                     aux_names: list[str] | None = None, metadata: dict | None = None, progress: bool = True,
                     checksum: str = "crc32") -> dict:
    """Write `source` (HFSource or CheckpointSource) as a tpzoo checkpoint into the existing directory
    `out_dir`; return the manifest. All tp files of a stage are written together, so each full tensor that
    must be assembled is assembled once."""
    cfg = source.cfg
    stages = stages or stages_from_ranges(partition(cfg, pp, virtual_stages), pp)
    lora = (metadata or {}).get("lora")  # a LoRA checkpoint (reshard): its adapters are all there is
    if lora is not None:
        lora = lora_config_of(lora)
    plans = layout_plan(cfg, tp, stages, vocab_padding_multiple, lora)  # a tp that does not fit the heads fails here
    order = [(info, plan.pp_rank) for plan in plans for info in plan.params]
    check_source(source, [info for info, _ in order])
    kept = stored_names(cfg)  # a kept-quantized model's values and scales stay as stored
    out_dtype = {info.name: source.dtype(info.name) if info.name in kept else _out_dtype(source.dtype(info.name), dtype)
                 for info, _ in order}
    out_dir = Path(out_dir)
    entries = {(r, p): [] for r in range(tp) for p in range(pp)}
    for info, p in order:
        for r in range(tp):
            entries[(r, p)].append((info.name, out_dtype[info.name], info.local_shape))
    writers = {key: SafetensorsWriter(out_dir / shard_file_name(*key), ents, SAFETENSORS_META, checksum)
               for key, ents in entries.items()}
    total = sum(nbytes(dt, shape) for ents in entries.values() for _, dt, shape in ents)
    try:
        with _progress(total, f"writing tp={tp} pp={pp}", progress) as bar:
            for info, p in order:
                dt = out_dtype[info.name]
                # Unconverted byte ranges are copied by the kernel (FileRuns). The tp ranks take turns piece by
                # piece: their pieces cover the same rows, so a span read for one serves the others.
                pieces = [shard_pieces(source, info, r, tp, as_runs=dt == source.dtype(info.name))
                          for r in range(tp)]
                for turn in itertools.zip_longest(*pieces):
                    for r, piece in enumerate(turn):
                        if piece is not None:
                            piece = piece if isinstance(piece, FileRuns) else piece.to(dt)
                            writers[(r, p)].write(info.name, piece)
                            bar.update(_piece_bytes(piece))
        files = []
        for (r, p), w in writers.items():
            size, digest = w.close()
            files.append({"path": shard_file_name(r, p), "tp_rank": r, "pp_rank": p, "bytes": size,
                          "checksum": digest, "tensors": {n: {"shape": list(s), "dtype": dtype_name(dt)}
                                                        for n, dt, s in entries[(r, p)]}})
    finally:
        for w in writers.values():
            w.abort()
    tensors = {info.name: {"shape": list(info.full_shape), "dtype": dtype_name(out_dtype[info.name]),
                           "split": spec_to_json(info.spec), "vocab_dim": info.vocab_dim, "pp_rank": p}
               for info, p in order}
    padded = next((i.padded for i, _ in order if i.padded), cfg.vocab_size)
    aux = copy_aux_files(source.aux_dir, out_dir, aux_names)
    manifest = make_manifest(cfg, tp=tp, pp=pp, stages=stages, tensors=tensors, files=files, vocab_padded=padded,
                             padding_multiple=vocab_padding_multiple, aux_files=aux, metadata=metadata)
    write_manifest(out_dir, manifest)
    return manifest


def _return_freed_memory() -> None:
    """glibc: serve allocations of 1 MiB and more with mmap, so each freed piece goes back to the OS at once. By
    default the threshold grows with the largest block freed (up to 32 MiB); past it, freed pieces stay in the
    heap and the resident set creeps up with fragmentation. Process-wide; a no-op without glibc."""
    try:
        import ctypes

        ctypes.CDLL(None).mallopt(-3, 1 << 20)  # M_MMAP_THRESHOLD
    except (OSError, AttributeError, TypeError):
        pass


def _piece_bytes(piece) -> int:
    return piece.nbytes if isinstance(piece, FileRuns) else piece.numel() * piece.element_size()


def convert_from_hf(src, dst, *, tp: int = 1, pp: int = 1, dtype="auto", force: bool = False,
                    vocab_padding_multiple: int = 1, virtual_stages: int = 1, progress: bool = True,
                    checksum: str = "crc32", keep_quantized: bool = False) -> dict:
    """HF checkpoint (directory, weights file, or hub id when not a path) -> tpzoo checkpoint at (tp, pp).
    A quantized source (block FP8, int4) is dequantized to `dtype`, or with keep_quantized stored as it is."""
    if Path(dst).exists() and not force:  # before reading anything: fail fast, touch nothing
        raise FileExistsError(f"{dst} already exists (pass --force to replace it)")
    _return_freed_memory()
    source = HFSource(src, keep_quantized=keep_quantized, dtype=parse_dtype(dtype))
    try:
        with atomic_dir(dst, force, clean_stale=True) as tmp:
            meta = {"source": str(src), "source_format": "huggingface"}
            if source.notes:  # what the import left out or changed (one line each; `tpzoo convert` prints them)
                meta["notes"] = list(source.notes)
            return write_checkpoint(source, tmp, tp=tp, pp=pp, virtual_stages=virtual_stages,
                                    dtype=parse_dtype(dtype), vocab_padding_multiple=vocab_padding_multiple,
                                    metadata=meta, progress=progress, checksum=checksum)
    finally:
        source.close()


def reshard(src, dst, *, tp: int, pp: int, dtype="auto", force: bool = False, virtual_stages: int = 1,
            vocab_padding_multiple: int | None = None, verify: bool = True, progress: bool = True,
            checksum: str = "crc32") -> dict:
    """A tpzoo checkpoint -> the same model at another (tp, pp); reads only the slices each new shard needs."""
    if Path(dst).exists() and not force:
        raise FileExistsError(f"{dst} already exists (pass --force to replace it)")
    _return_freed_memory()
    source = CheckpointSource(src, verify=verify)
    try:
        with atomic_dir(dst, force, clean_stale=True) as tmp:
            meta = {**source.manifest.get("metadata", {}), "resharded_from": {"tp": source.tp, "pp": source.pp}}
            return write_checkpoint(source, tmp, tp=tp, pp=pp, virtual_stages=virtual_stages,
                                    dtype=parse_dtype(dtype), aux_names=source.manifest.get("aux_files", []),
                                    vocab_padding_multiple=vocab_padding_multiple or source.padding_multiple,
                                    metadata=meta, progress=progress, checksum=checksum)
    finally:
        source.close()


def parse_size(value) -> int:
    """'5GB' -> 5e9, '500MiB' -> 500 * 2**20, 1000 -> 1000 (transformers' conventions)."""
    if isinstance(value, int):
        return value
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]?i?B?)\s*", str(value), re.I)
    if not m:
        raise ConfigError(f"not a size: {value!r} (e.g. 5GB, 500MiB)")
    unit = m.group(2).upper().rstrip("B")
    scale = {"": 1, "K": 10**3, "M": 10**6, "G": 10**9, "T": 10**12,
             "KI": 2**10, "MI": 2**20, "GI": 2**30, "TI": 2**40}[unit]
    return int(float(m.group(1)) * scale)


def convert_to_hf(src, dst, *, force: bool = False, max_shard_size="5GB", dtype="auto", verify: bool = True,
                  progress: bool = True, quantize: str | None = None) -> list[str]:
    """A tpzoo checkpoint (any layout) -> a directory transformers' from_pretrained loads: config.json,
    model.safetensors (sharded with an index above max_shard_size), tokenizer and generation files. A kept-quantized
    checkpoint exports its quantized tensors as stored; `quantize="fp8-block"` writes the linear layers' weights in
    DeepSeek's block FP8 (tpzoo.quant.export)."""
    from tpzoo.models.registry import get_family
    from tpzoo.quant.export import QuantizingSource, export_maps, quantization_config

    if Path(dst).exists() and not force:
        raise FileExistsError(f"{dst} already exists (pass --force to replace it)")
    _return_freed_memory()
    source = QuantizingSource(sources.open_source(src, verify=verify), quantize)
    from tpzoo.models.mtp_hf import export_refusal

    refusal = export_refusal(source.cfg, get_family(source.cfg.family).hf_mtp)
    if refusal:  # before anything is written
        source.close()
        raise ConfigError(refusal)
    dtype = parse_dtype(dtype)
    try:
        cfg = source.cfg
        maps = export_maps(source, [m for m in get_family(cfg.family).hf_tensor_map(cfg) if m.export])
        source.check([m.name for m in maps])
        kept = stored_names(cfg) | set(source.shapes)  # exported as stored
        plan = []  # (map, full ParamInfo, out dtype, [(hf name, shape)], concatenation structure or None)
        for m in maps:
            full = source.full_shape(m.name)
            dt = source.dtype(m.name) if m.name in kept else _out_dtype(source.dtype(m.name), dtype)
            shapes = [tuple(t.shape) for t in m.to_hf(empty_meta(full, dt))]
            plan.append((m, ParamInfo(m.name, full, ShardSpec(None), full), dt, list(zip(m.hf, shapes)),
                         concat_structure(m, shapes)))
        groups = _group_files([(h, dt, s) for _, _, dt, hs, _ in plan for h, s in hs], parse_size(max_shard_size))
        names = (["model.safetensors"] if len(groups) == 1 else
                 [f"model-{i + 1:05d}-of-{len(groups):05d}.safetensors" for i in range(len(groups))])
        with atomic_dir(dst, force, clean_stale=True) as tmp:
            written = _write_hf_files(source, plan, groups, names, tmp, progress)
            weight_map = {h: names[i] for i, g in enumerate(groups) for h, _, _ in g}
            if len(groups) > 1:
                index = {"metadata": {"total_size": sum(nbytes(dt, s) for g in groups for _, dt, s in g)},
                         "weight_map": weight_map}
                (tmp / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
            aux = source.manifest.get("aux_files", []) if isinstance(source.source, CheckpointSource) else None
            copy_aux_files(source.aux_dir, tmp, aux)
            dtypes = [dt for m, _, dt, _, _ in plan if m.name not in kept]
            hf_config = hf_config_for(cfg, max(dtypes, key=dtypes.count))
            if quantization_config(cfg):
                hf_config["quantization_config"] = quantization_config(cfg)
            (tmp / "config.json").write_text(json.dumps(hf_config, indent=2) + "\n")
        return written
    finally:
        source.close()


def _group_files(tensors: list[tuple[str, torch.dtype, tuple]], max_bytes: int) -> list[list]:
    """Consecutive tensors packed into files of at most max_bytes (a bigger tensor gets a file of its own)."""
    groups, size = [[]], 0
    for h, dt, shape in tensors:
        n = nbytes(dt, shape)
        if groups[-1] and size + n > max_bytes:
            groups.append([])
            size = 0
        groups[-1].append((h, dt, shape))
        size += n
    return groups


def _write_hf_files(source, plan, groups, names, out_dir: Path, progress: bool) -> list[str]:
    file_of = {h: i for i, g in enumerate(groups) for h, _, _ in g}
    total = sum(nbytes(dt, s) for g in groups for _, dt, s in g)
    writer, current = None, -1

    def target(h: str):
        nonlocal writer, current
        if file_of[h] != current:
            if writer is not None:
                writer.close()
            current = file_of[h]
            writer = SafetensorsWriter(out_dir / names[current], groups[current], SAFETENSORS_META)
        return writer

    try:
        with _progress(total, "writing HF", progress) as bar:
            for m, info, dt, hs, structure in plan:
                if structure is not None:  # each HF tensor is a box of the full one: stream it, never whole
                    d, transposed, extents, _ = structure
                    offset = 0
                    for (h, _), extent in zip(hs, extents):
                        for piece in _box_pieces(source, m.name, info.full_shape, d, offset, extent, transposed, dt):
                            target(h).write(h, piece)
                            bar.update(_piece_bytes(piece))
                        offset += extent
                    continue
                full = torch.cat([p for p in shard_pieces(source, info, 0, 1)], dim=0).to(dt)
                for (h, _), t in zip(hs, m.to_hf(full)):
                    target(h).write(h, t)
                    bar.update(t.numel() * t.element_size())
                del full
        if writer is not None:
            writer.close()
    finally:
        if writer is not None:
            writer.abort()
    return list(names)


def _box_pieces(source, name: str, full: tuple, d: int, offset: int, extent: int, transposed: bool, dt):
    """The HF tensor full[offset:offset+extent along d] (transposed back when `transposed`, 2-d), in pieces of
    rows; byte ranges of the source files come as FileRuns when the dtype does not change."""
    esize = source.dtype(name).itemsize
    box = [(0, n) for n in full]
    box[d] = (offset, extent)
    if transposed:  # the HF tensor's rows are the box's columns
        (c0, cn), step = box[1], max(1, sources.PIECE_BYTES // max(1, box[0][1] * esize))
        for c in range(c0, c0 + cn, step):
            yield source.read_box(name, [box[0], (c, min(step, c0 + cn - c))]).t().contiguous().to(dt)
        return
    (r0, rn), row = box[0], math.prod(n for _, n in box[1:]) * esize
    step = max(1, sources.PIECE_BYTES // max(1, row))
    for r in range(r0, r0 + rn, step):
        sub = [(r, min(step, r0 + rn - r))] + box[1:]
        runs = source.byte_runs(name, sub) if dt == source.dtype(name) and hasattr(source, "byte_runs") else None
        if runs and sum(x[2] for x in runs) >= COPY_MIN_RUN * len(runs):
            yield FileRuns(runs, dt)
        else:
            yield source.read_box(name, sub).to(dt)


__all__ = ["convert_from_hf", "convert_to_hf", "reshard", "write_checkpoint", "parse_dtype", "parse_size",
           "aux_files_in"]
