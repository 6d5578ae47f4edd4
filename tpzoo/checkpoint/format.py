"""The tpzoo sharded checkpoint on disk: manifest.json + one safetensors file per (tp, pp) rank.

Specified in docs/checkpoint-format.md. This module reads and writes the manifest, checks every path in it
(nothing may point outside the checkpoint directory), verifies shard files (size, header, checksum), copies the
tokenizer files that travel with a checkpoint, and re-exports `atomic_dir` (atomic.py: write into a temporary
sibling, rename into place only once complete). Field types: schema.py; consistency with the model config and the
shard headers: structure.py.
"""
from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

from tpzoo.errors import UserError

from .atomic import atomic_dir, is_temp_dir  # noqa: F401 - atomic_dir: re-exported (tpzoo.train imports it here)
from .safetensors_io import CHECKSUMS, DTYPES, SafetensorsError, file_checksum, read_header
from .schema import SchemaError, check_schema

FORMAT_NAME = "tpzoo-checkpoint"
FORMAT_VERSION = 2  # 2: model_config nests each layer kind's settings (1, flat, still reads)
MANIFEST_NAME = "manifest.json"

# Files that travel with a model: tokenizer files (every kind transformers writes) and generation defaults.
AUX_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
             "vocab.json", "merges.txt", "vocab.txt", "tokenizer.model", "spiece.model", "chat_template.json",
             "chat_template.jinja", "generation_config.json", "tpzoo_tokenizer.json")
AUX_SUFFIXES = (".tiktoken",)


class CheckpointError(UserError, ValueError):
    """A checkpoint that is incomplete, corrupt, or unsafe to read."""


def shard_file_name(tp_rank: int, pp_rank: int) -> str:
    return f"model-tp{tp_rank:02d}-pp{pp_rank:02d}.safetensors"


def is_checkpoint(path) -> bool:
    """A directory with a manifest, and not the temporary directory of an unfinished write (atomic.py)."""
    return (Path(path) / MANIFEST_NAME).is_file() and not is_temp_dir(path)


def refuse_temp_dir(path) -> None:
    """Readers call this first: an unfinished write may hold a complete-looking manifest and weights."""
    if is_temp_dir(path):
        raise CheckpointError(f"{path} is the temporary directory of a conversion or save that did not finish "
                              f"(killed?): not a checkpoint; the next write into the same destination removes it")


def safe_path(root, rel: str, what: str = "manifest entry") -> Path:
    """root/rel, refusing absolute paths, `..` and symlinks that resolve outside root."""
    if not isinstance(rel, str) or not rel or os.path.isabs(rel) or rel.startswith(("/", "\\")):
        raise CheckpointError(f"{what} {rel!r}: absolute or empty path; must be relative to the checkpoint")
    if any(part == ".." for part in Path(rel).parts) or "\\" in rel:
        raise CheckpointError(f"{what} {rel!r} points outside the checkpoint directory {root}")
    root_real = os.path.realpath(root)
    full = os.path.realpath(os.path.join(root_real, rel))
    if os.path.commonpath([root_real, full]) != root_real:
        raise CheckpointError(f"{what} {rel!r} resolves to {full}, outside the checkpoint directory {root}")
    return Path(root) / rel


# --- manifest -----------------------------------------------------------------------------------------------

def write_manifest(directory, manifest: dict) -> None:
    path = Path(directory) / MANIFEST_NAME
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(manifest, indent=1, sort_keys=False) + "\n")
    os.replace(tmp, path)  # a reader never sees half a manifest


def read_manifest(directory) -> dict:
    """The manifest of a checkpoint directory, with every field's type and every path checked (errors name the
    manifest file and the field)."""
    directory = Path(directory)
    refuse_temp_dir(directory)
    path = directory / MANIFEST_NAME
    if not path.is_file():
        raise FileNotFoundError(f"{directory} is not a tpzoo checkpoint: no {MANIFEST_NAME}")
    try:
        m = json.loads(path.read_bytes().decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{path}: corrupt manifest (not valid JSON): {e}") from None
    if not isinstance(m, dict) or m.get("format") != FORMAT_NAME:
        found = m.get("format") if isinstance(m, dict) else type(m).__name__
        raise CheckpointError(f"{path}: not a tpzoo checkpoint manifest (format={found!r})")
    version = m.get("format_version", 1)
    if isinstance(version, int) and version > FORMAT_VERSION:
        raise CheckpointError(f"{path}: format version {version} is newer than this tpzoo reads "
                              f"({FORMAT_VERSION}); upgrade tpzoo")
    try:
        check_schema(m)
    except SchemaError as e:
        raise CheckpointError(f"{path}: corrupt manifest: {e}") from None
    for f in m["files"]:
        safe_path(directory, f["path"], "shard file")
    for name in m.get("aux_files", []):
        safe_path(directory, name, "auxiliary file")
    ranks = [(f["tp_rank"], f["pp_rank"]) for f in m["files"]]
    missing = [(t, p) for t in range(m["tp"]) for p in range(m["pp"]) if (t, p) not in ranks]
    if missing:
        raise CheckpointError(f"{path}: manifest lists no shard file for (tp_rank, pp_rank) {missing}")
    twice = sorted({r for r in ranks if ranks.count(r) > 1})
    if twice:
        raise CheckpointError(f"{path}: manifest lists several shard files for (tp_rank, pp_rank) {twice}")
    return m


def file_entry(m: dict, tp_rank: int, pp_rank: int) -> dict:
    for f in m["files"]:
        if f["tp_rank"] == tp_rank and f["pp_rank"] == pp_rank:
            return f
    raise CheckpointError(f"no shard file for tp_rank={tp_rank} pp_rank={pp_rank}")


def verify_file(directory, entry: dict, checksum: bool = True) -> Path:
    """Check one shard file against its manifest entry: present, the recorded size, a header listing exactly
    the recorded tensors, and (checksum=True) the recorded checksum. Errors name the file."""
    path = safe_path(directory, entry["path"], "shard file")
    if not path.is_file():
        raise CheckpointError(f"missing shard file {path}")
    size = path.stat().st_size
    if size != entry["bytes"]:
        raise CheckpointError(f"shard file {path} is {size} bytes, the manifest records {entry['bytes']}: "
                              f"{'truncated' if size < entry['bytes'] else 'corrupt'}")
    try:
        tensors, _, _ = read_header(path)
    except SafetensorsError as e:
        raise CheckpointError(f"shard file {path}: {e}") from None
    for name, info in entry["tensors"].items():
        got = tensors.get(name)
        if got is None:
            raise CheckpointError(f"shard file {path}: no tensor {name} in its header (the manifest lists it)")
        if got[0] != DTYPES[info["dtype"]]:
            raise CheckpointError(f"shard file {path}: tensor {name} is {got[0]} in its header, "
                                  f"{DTYPES[info['dtype']]} in the manifest")
        if list(got[1]) != list(info["shape"]):
            raise CheckpointError(f"shard file {path}: tensor {name} has shape {list(got[1])} in its header, "
                                  f"{list(info['shape'])} in the manifest")
    if set(tensors) != set(entry["tensors"]):
        extra = sorted(set(tensors) - set(entry["tensors"]))
        raise CheckpointError(f"shard file {path}: tensors not in the manifest: {extra[:5]}")
    if checksum:
        algo = str(entry.get("checksum", "")).split(":")[0]
        if algo not in CHECKSUMS:
            raise CheckpointError(f"shard file {path}: unknown checksum {entry.get('checksum')!r} in the manifest")
        digest = file_checksum(path, algo)
        if digest != entry["checksum"]:
            raise CheckpointError(f"shard file {path}: checksum {digest} does not match the manifest's "
                                  f"{entry['checksum']}: the file is corrupt")
    return path


# --- tokenizer and other files that travel with the weights ---------------------------------------------------

def aux_files_in(directory) -> list[str]:
    directory = Path(directory)
    if not directory.is_dir():
        return []
    return sorted(p.name for p in directory.iterdir()
                  if p.is_file() and (p.name in AUX_FILES or p.name.endswith(AUX_SUFFIXES)))


def copy_aux_files(src_dir, dst_dir, names: list[str] | None = None) -> list[str]:
    """Copy tokenizer/generation files from src_dir (all it has, or `names`); returns the names copied."""
    names = aux_files_in(src_dir) if names is None else names
    for name in names:
        shutil.copyfile(safe_path(src_dir, name, "auxiliary file"), Path(dst_dir) / name)
    return list(names)


def make_manifest(cfg, *, tp: int, pp: int, stages: list[dict], tensors: dict, files: list[dict],
                  vocab_padded: int, padding_multiple: int, aux_files: list[str], metadata: dict | None = None) -> dict:
    """The manifest dict (docs/checkpoint-format.md). `tensors`: name -> {shape, dtype, split, vocab_dim,
    pp_rank}; `files`: one entry per shard file (path, tp_rank, pp_rank, bytes, checksum, tensors)."""
    from collections import Counter

    from tpzoo.quant import stored_names

    from .safetensors_io import DTYPES

    kept = stored_names(cfg)  # a kept-quantized model's dtype is that of its other tensors
    dtypes = Counter(t["dtype"] for name, t in tensors.items() if name not in kept)
    layer_to_stage = [None] * cfg.num_layers
    for st in stages:
        for i in range(*st["layers"]):
            layer_to_stage[i] = st["pp_rank"]
    return {
        "format": FORMAT_NAME, "format_version": FORMAT_VERSION,
        "model_config": cfg.to_dict(),
        "tp": tp, "pp": pp, "virtual_stages": len(stages) // pp,
        "dtype": str(DTYPES[dtypes.most_common(1)[0][0]]).replace("torch.", "") if dtypes else None,
        "vocab": {"size": cfg.vocab_size, "padded": vocab_padded, "padding_multiple": padding_multiple},
        "stages": stages, "layer_to_stage": layer_to_stage,
        "tensors": tensors,
        "files": sorted(files, key=lambda f: (f["pp_rank"], f["tp_rank"])),
        "aux_files": sorted(aux_files),
        "metadata": dict(metadata or {}),
    }
