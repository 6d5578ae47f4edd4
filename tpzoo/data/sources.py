"""Document sources: local text / JSONL / Parquet files, directories of them, hub datasets, the stdlib corpus.

A *document* is one string. Sources are read lazily, one document (or one Parquet record batch) at a time, so a
corpus of any size streams through `tpzoo.data.preprocess` in bounded memory.

  - text files (``.txt .text .md .rst .py``): the whole file is one document (UTF-8; undecodable bytes become
    U+FFFD, with a warning naming the file, line and byte offset of the first). Reading whole files is
    deliberate: the ``datasets`` "text" builder would make every *line* a document.
  - JSON lines (``.jsonl``, ``.json`` with one object per line, or ``.json`` holding one array of objects): each
    record's ``text_field`` (default ``"text"``) is a document; a record without the field, invalid JSON and
    invalid UTF-8 are errors naming the file and line (and the column, or the byte offset).
  - Parquet (``.parquet``): column ``text_field`` of every row, read batch by batch with pyarrow.
  - a directory: every file with one of the suffixes above, recursively, in sorted path order; hidden files and
    directories are skipped.
  - anything else that is not a local path (``"owner/name"``, or ``"hf:owner/name[:config][@split]"``): a
    Hugging Face hub dataset through ``datasets.load_dataset(..., streaming=True)`` (best effort; needs network
    or the local cache, and fails with a clear error otherwise).

Empty documents are skipped (they would add nothing but an EOS token).
"""
from __future__ import annotations

import itertools
import json
import os
import sysconfig
import warnings
from pathlib import Path
from typing import Iterable, Iterator

from tpzoo.errors import DataError

TEXT_SUFFIXES = (".txt", ".text", ".md", ".rst", ".py")
JSON_SUFFIXES = (".jsonl", ".json")
PARQUET_SUFFIXES = (".parquet",)
SUPPORTED_SUFFIXES = TEXT_SUFFIXES + JSON_SUFFIXES + PARQUET_SUFFIXES
_EXCLUDED_STDLIB_DIRS = {"test", "tests", "idle_test", "site-packages", "dist-packages", "__pycache__"}

__all__ = ["iter_documents", "expand_paths", "default_corpus", "read_text_file", "read_jsonl", "read_parquet",
           "read_hub_dataset", "SourceError", "SUPPORTED_SUFFIXES"]


class SourceError(DataError):
    """A data source that cannot be read (bad record, unsupported file, unreachable hub dataset)."""


def _is_hidden(path: Path, root: Path) -> bool:
    return any(part.startswith(".") for part in path.relative_to(root).parts)


def is_local_spec(spec: str) -> bool:
    """A spec that names a local path even when it does not exist (so a typo is not sent to the hub)."""
    return (spec.startswith(("/", "./", "../", "~", ".")) or spec.lower().endswith(SUPPORTED_SUFFIXES)
            or Path(spec).expanduser().exists())


def expand_paths(paths: Iterable[str | os.PathLike]) -> list[Path]:
    """Local paths -> the data files they name: files as given, directories expanded recursively and sorted.

    Raises FileNotFoundError for a missing path and SourceError for a file with an unsupported suffix.
    """
    files: list[Path] = []
    for p in paths:
        p = Path(p).expanduser()
        if p.is_dir():
            found = [f for f in p.rglob("*") if f.is_file() and f.suffix.lower() in SUPPORTED_SUFFIXES
                     and not _is_hidden(f, p)]
            files.extend(sorted(found, key=lambda f: f.relative_to(p).as_posix()))
        elif p.is_file():
            if p.suffix.lower() not in SUPPORTED_SUFFIXES:
                raise SourceError(f"{p}: unsupported file type {p.suffix!r}; "
                                  f"supported: {', '.join(SUPPORTED_SUFFIXES)}")
            files.append(p)
        else:
            raise FileNotFoundError(f"data path does not exist: {p}")
    return files


def utf8_error(path, raw: bytes, e: UnicodeDecodeError, base: int = 0, line: int | None = None) -> str:
    """'PATH:LINE: invalid UTF-8 (byte 0xff at byte offset N)' for a decode error at raw[e.start] (raw starts at
    file offset `base`; its line is counted when not given)."""
    line = line if line is not None else raw.count(b"\n", 0, e.start) + 1
    return f"{path}:{line}: invalid UTF-8 (byte 0x{raw[e.start]:02x} at byte offset {base + e.start})"


def read_text_file(path: str | os.PathLike) -> Iterator[str]:
    """The whole file as one document (nothing when it is empty). Undecodable bytes become U+FFFD, with a
    warning naming the file, line and byte offset of the first (one stray byte should not stop a corpus)."""
    raw = Path(path).read_bytes()
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        warnings.warn(f"{utf8_error(path, raw, e)}; undecodable bytes replaced with U+FFFD", stacklevel=2)
        text = raw.decode("utf-8", errors="replace")
    if text:
        yield text


def _field(record, field: str, where: str) -> str:
    if not isinstance(record, dict) or field not in record:
        keys = sorted(record) if isinstance(record, dict) else type(record).__name__
        raise SourceError(f"{where}: record has no field {field!r} (has {keys}); set text_field")
    value = record[field]
    if not isinstance(value, str):
        raise SourceError(f"{where}: field {field!r} is {type(value).__name__}, expected a string")
    return value


def read_jsonl(path: str | os.PathLike, text_field: str = "text") -> Iterator[str]:
    """``record[text_field]`` of every record of a JSON-lines file (or of a .json file holding one array)."""
    path = Path(path)
    with path.open("rb") as f:
        head = f.read(4096).lstrip(b"\xef\xbb\xbf \t\r\n")
        f.seek(0)
        if head.startswith(b"["):  # one JSON array: parsed whole (use JSON lines for large corpora)
            for i, record in enumerate(_json_array(f.read(), path)):
                text = _field(record, text_field, f"{path} [{i}]")
                if text:
                    yield text
            return
        for where, record in _json_lines(f, path):
            text = _field(record, text_field, where)
            if text:
                yield text


def _json_array(raw: bytes, path) -> list:
    """A whole-file JSON array; errors name the file, line and column (or the byte offset of invalid UTF-8)."""
    try:
        records = json.loads(raw.decode("utf-8-sig"))
    except UnicodeDecodeError as e:
        raise SourceError(utf8_error(path, raw, e)) from None
    except json.JSONDecodeError as e:
        raise SourceError(f"{path}:{e.lineno}:{e.colno}: invalid JSON: {e.msg}") from None
    if not isinstance(records, list):
        raise SourceError(f"{path}: expected a JSON array of records or one JSON object per line")
    return records


def _json_lines(f, path) -> Iterator[tuple[str, object]]:
    """("file:line", parsed record) for every non-blank line of a JSON-lines file open in binary mode. Errors name
    the file and line: invalid JSON (and its column), invalid UTF-8 (and its byte offset in the file)."""
    offset = 0
    for lineno, raw in enumerate(f, 1):
        start, offset = offset, offset + len(raw)
        try:
            line = raw.decode("utf-8")
        except UnicodeDecodeError as e:
            raise SourceError(utf8_error(path, raw, e, base=start, line=lineno)) from None
        if lineno == 1:
            line = line.removeprefix("\ufeff")  # a UTF-8 byte-order mark, as some editors write
        if not line.strip():
            continue
        try:  # without the newline, an unterminated record's column is its line's end, not "line 2, column 1"
            yield f"{path}:{lineno}", json.loads(line.rstrip("\r\n"))
        except json.JSONDecodeError as e:
            raise SourceError(f"{path}:{lineno}:{e.colno}: invalid JSON: {e.msg}") from None


def read_jsonl_records(path: str | os.PathLike) -> Iterator[tuple[str, object]]:
    """("file:line", record) for each record of a JSON-lines file; invalid JSON or UTF-8 raises SourceError
    naming the line."""
    with Path(path).open("rb") as f:
        yield from _json_lines(f, path)


def read_parquet(path: str | os.PathLike, text_field: str = "text", batch_size: int = 1024) -> Iterator[str]:
    """Column ``text_field`` of a Parquet file, streamed one record batch at a time."""
    import pyarrow.parquet as pq

    pf = pq.ParquetFile(str(path))
    if text_field not in pf.schema_arrow.names:
        raise SourceError(f"{path}: no column {text_field!r} (has {pf.schema_arrow.names}); set text_field")
    for batch in pf.iter_batches(batch_size=batch_size, columns=[text_field]):
        for text in batch.column(0).to_pylist():
            if text:
                yield text


def read_hub_dataset(spec: str, text_field: str = "text") -> Iterator[str]:
    """A Hugging Face hub dataset, streamed: ``[hf:]name[:config][@split]`` (split defaults to "train")."""
    name = spec[3:] if spec.startswith("hf:") else spec
    name, _, split = name.partition("@")
    name, _, config = name.partition(":")
    try:
        import datasets

        ds = datasets.load_dataset(name, config or None, split=split or "train", streaming=True)
        records = iter(ds)
        first = next(records, None)
    except Exception as e:  # noqa: BLE001 - network, auth and missing-dataset errors all land here
        raise SourceError(f"{spec!r} is not a local file or directory, and loading it as a Hugging Face hub "
                          f"dataset failed (offline? no such dataset?): {type(e).__name__}: {e}") from e
    if first is None:
        return
    for i, record in enumerate(itertools.chain([first], records)):
        text = _field(record, text_field, f"{spec} [{i}]")
        if text:
            yield text


def read_file(path: Path, text_field: str = "text") -> Iterator[str]:
    """Documents of one local file, by suffix."""
    suffix = path.suffix.lower()
    if suffix in JSON_SUFFIXES:
        return read_jsonl(path, text_field)
    if suffix in PARQUET_SUFFIXES:
        return read_parquet(path, text_field)
    return read_text_file(path)


def iter_documents(sources, text_field: str = "text") -> Iterator[str]:
    """Every document of ``sources`` (one path/name or a list), in order; see the module docstring."""
    if isinstance(sources, (str, os.PathLike)):
        sources = [sources]
    for spec in sources:
        s = os.fspath(spec)
        if s.startswith("hf:") or not is_local_spec(s):
            yield from read_hub_dataset(s, text_field)
            continue
        for path in expand_paths([s]):
            yield from read_file(path, text_field)


def default_corpus() -> list[Path]:
    """The Python standard library's ``*.py`` files: a corpus present on every machine, with no download.

    Sorted by path relative to the stdlib directory; test directories, ``site-packages`` and caches are
    excluded. Deterministic for a given Python build (a different Python version gives a different corpus).
    """
    root = Path(sysconfig.get_paths()["stdlib"])
    files = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if d not in _EXCLUDED_STDLIB_DIRS]  # prune: never walk site-packages
        files.extend(Path(dirpath) / f for f in filenames if f.endswith(".py"))
    return sorted((f for f in files if f.is_file()), key=lambda f: f.relative_to(root).as_posix())
