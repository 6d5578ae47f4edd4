"""A corpus tokenized once into a memory-mapped token store.

On-disk layout of a store directory (see docs/data.md):

    tokens.bin        every document's token ids, concatenated; raw little-endian uint16 when the vocabulary
                      fits (vocab_size <= 65536), else uint32
    doc_offsets.npy   int64 [num_docs + 1]: document i is tokens[doc_offsets[i]:doc_offsets[i + 1]]
                      (doc_offsets[0] == 0, doc_offsets[-1] == num_tokens)
    index.json        metadata: format, version, dtype, num_tokens, num_docs, append_eos, prepend_bos,
                      tokenizer {spec, vocab_size, eos_id, bos_id, pad_id, dir}, sources
    tokenizer/        a copy of the tokenizer (so the store alone says how to decode it)

`preprocess` streams: documents are tokenized a small batch at a time and appended to ``tokens.bin``; offsets go
to a scratch file and become ``doc_offsets.npy`` at the end, so memory does not grow with the corpus. It writes
into a temporary sibling directory and renames it into place only when complete, so a crash never leaves a
half-written store under the final name. `TokenStore` opens a store with numpy memmaps and never reads it whole.
"""
from __future__ import annotations

import json
import os
import shutil
import uuid
from pathlib import Path
from typing import Callable, Iterable

import numpy as np

from tpzoo.errors import ConfigError, DataError

from .tokenizer import load_tokenizer

FORMAT = "tpzoo-token-store"
VERSION = 1
TOKENS_FILE = "tokens.bin"
OFFSETS_FILE = "doc_offsets.npy"
INDEX_FILE = "index.json"
TOKENIZER_DIR = "tokenizer"

__all__ = ["preprocess", "TokenStore", "token_dtype"]


def token_dtype(vocab_size: int) -> np.dtype:
    """uint16 when every id (0 .. vocab_size-1) fits in 16 bits, else uint32; always little-endian."""
    return np.dtype("<u2") if vocab_size <= 2 ** 16 else np.dtype("<u4")


def _batches(documents: Iterable[str], max_docs: int, max_chars: int):
    batch, chars = [], 0
    for doc in documents:
        if not doc:
            continue
        batch.append(doc)
        chars += len(doc)
        if len(batch) >= max_docs or chars >= max_chars:
            yield batch
            batch, chars = [], 0
    if batch:
        yield batch


def _write_npy_from_raw(raw_path: Path, npy_path: Path, dtype: np.dtype, count: int) -> None:
    """Wrap a raw array file in an .npy header, streaming the bytes across."""
    with npy_path.open("wb") as out, raw_path.open("rb") as raw:
        np.lib.format.write_array_header_1_0(out, {"descr": np.lib.format.dtype_to_descr(dtype),
                                                   "fortran_order": False, "shape": (count,)})
        shutil.copyfileobj(raw, out, 1 << 20)


def preprocess(documents: Iterable[str], tokenizer, out_dir: str | os.PathLike, *, append_eos: bool = True,
               prepend_bos: bool = False, force: bool = False, sources: list[str] | None = None,
               save_tokenizer: bool = True, batch_docs: int = 256, batch_chars: int = 4 << 20,
               on_progress: Callable[[int, int], None] | None = None) -> "TokenStore":
    """Tokenize ``documents`` into a new token store at ``out_dir`` and return it opened.

    Each non-empty document becomes ``[bos] + encode(doc) + [eos]`` (bos only with ``prepend_bos``, eos with
    ``append_eos``). An existing ``out_dir`` is refused unless ``force=True``, which replaces it only once the new
    store is complete. ``on_progress(docs, tokens)`` is called after every batch with the batch's counts.
    ``sources`` is recorded in index.json for provenance.
    """
    tok = load_tokenizer(tokenizer)
    out_dir = Path(out_dir).expanduser()
    if out_dir.exists() and not force:
        raise FileExistsError(f"token store output {out_dir} already exists (pass force=True / --force to replace)")
    if append_eos and tok.eos_id is None:
        raise ConfigError(f"{tok!r} has no eos token; pass append_eos=False")
    if prepend_bos and tok.bos_id is None:
        raise ConfigError(f"{tok!r} has no bos token; pass prepend_bos=False")
    dtype = token_dtype(tok.vocab_size)
    prefix = [tok.bos_id] if prepend_bos else []
    suffix = [tok.eos_id] if append_eos else []

    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = out_dir.parent / f".{out_dir.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    tmp.mkdir()
    try:
        num_tokens = num_docs = 0
        raw_offsets = tmp / "doc_offsets.raw"
        with (tmp / TOKENS_FILE).open("wb") as tf, raw_offsets.open("wb") as of:
            np.zeros(1, dtype="<i8").tofile(of)
            for batch in _batches(documents, batch_docs, batch_chars):
                encoded = [prefix + ids + suffix for ids in tok.encode_batch(batch)]
                lengths = np.fromiter((len(ids) for ids in encoded), dtype=np.int64, count=len(encoded))
                flat = np.fromiter((i for ids in encoded for i in ids), dtype=np.int64, count=int(lengths.sum()))
                if flat.size and (flat.min() < 0 or flat.max() >= tok.vocab_size):
                    raise DataError(f"token id {int(flat.max())} outside the vocabulary (size {tok.vocab_size})")
                flat.astype(dtype).tofile(tf)
                (num_tokens + np.cumsum(lengths)).astype("<i8").tofile(of)
                num_tokens += int(flat.size)
                num_docs += len(encoded)
                if on_progress is not None:
                    on_progress(len(encoded), int(flat.size))
        _write_npy_from_raw(raw_offsets, tmp / OFFSETS_FILE, np.dtype("<i8"), num_docs + 1)
        raw_offsets.unlink()
        tok_meta = {"spec": tok.spec, "vocab_size": tok.vocab_size, "eos_id": tok.eos_id, "bos_id": tok.bos_id,
                    "pad_id": tok.pad_id, "dir": None}
        if save_tokenizer:
            tok.save(tmp / TOKENIZER_DIR)
            tok_meta["dir"] = TOKENIZER_DIR
        index = {"format": FORMAT, "version": VERSION, "dtype": dtype.name, "num_tokens": num_tokens,
                 "num_docs": num_docs, "append_eos": append_eos, "prepend_bos": prepend_bos,
                 "tokenizer": tok_meta, "sources": [str(s) for s in (sources or [])]}
        (tmp / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")
        _move_into_place(tmp, out_dir, force)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return TokenStore(out_dir)


def _move_into_place(tmp: Path, out_dir: Path, force: bool) -> None:
    if out_dir.exists():
        if not force:
            raise FileExistsError(f"token store output {out_dir} appeared while preprocessing; not replaced")
        old = out_dir.parent / f".{out_dir.name}.old-{uuid.uuid4().hex[:8]}"
        os.rename(out_dir, old)
        os.rename(tmp, out_dir)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.rename(tmp, out_dir)


class TokenStore:
    """A token store opened read-only through numpy memmaps.

    ``len(store)`` is the number of tokens; ``store[a:b]`` / ``store[i]`` read tokens (as numpy values, only the
    pages touched are read); ``doc(i)``, ``doc_bounds(i)``, ``doc_offsets`` and ``doc_index(pos)`` describe the
    documents. ``tokens`` is the underlying ``np.memmap``.
    """

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        index_path = self.path / INDEX_FILE
        if not index_path.is_file():
            raise FileNotFoundError(f"not a token store (no {INDEX_FILE}): {self.path}")
        self.metadata = json.loads(index_path.read_text())
        if self.metadata.get("format") != FORMAT or self.metadata.get("version") != VERSION:
            raise DataError(f"{index_path}: unsupported format {self.metadata.get('format')!r} "
                             f"version {self.metadata.get('version')!r}")
        self.dtype = np.dtype(self.metadata["dtype"]).newbyteorder("<")
        self.num_tokens = int(self.metadata["num_tokens"])
        self.num_docs = int(self.metadata["num_docs"])
        tokens_path = self.path / TOKENS_FILE
        expected = self.num_tokens * self.dtype.itemsize
        if tokens_path.stat().st_size != expected:
            raise DataError(f"{tokens_path}: {tokens_path.stat().st_size} bytes, index.json says {expected}")
        # np.memmap cannot map an empty file; an empty store gets an empty in-memory array instead.
        self.tokens = (np.memmap(tokens_path, dtype=self.dtype, mode="r", shape=(self.num_tokens,))
                       if self.num_tokens else np.zeros(0, dtype=self.dtype))
        self.doc_offsets = np.load(self.path / OFFSETS_FILE, mmap_mode="r")
        if self.doc_offsets.shape != (self.num_docs + 1,):
            raise DataError(f"{self.path / OFFSETS_FILE}: shape {self.doc_offsets.shape}, "
                             f"expected ({self.num_docs + 1},)")

    def __len__(self) -> int:
        return self.num_tokens

    def __getitem__(self, idx):
        return self.tokens[idx]

    @property
    def vocab_size(self) -> int:
        return int(self.metadata["tokenizer"]["vocab_size"])

    @property
    def tokenizer_spec(self) -> str:
        return self.metadata["tokenizer"]["spec"]

    def load_tokenizer(self):
        """The tokenizer saved with the store (falling back to the recorded spec)."""
        saved = self.metadata["tokenizer"].get("dir")
        return load_tokenizer(self.path / saved if saved else self.tokenizer_spec)

    def doc_bounds(self, i: int) -> tuple[int, int]:
        if not -self.num_docs <= i < self.num_docs:
            raise IndexError(f"document {i} out of range ({self.num_docs} documents)")
        i %= self.num_docs
        return int(self.doc_offsets[i]), int(self.doc_offsets[i + 1])

    def doc(self, i: int) -> np.ndarray:
        start, end = self.doc_bounds(i)
        return np.asarray(self.tokens[start:end])

    def doc_index(self, pos: int) -> int:
        """The document that holds token ``pos``."""
        if not 0 <= pos < self.num_tokens:
            raise IndexError(f"token {pos} out of range ({self.num_tokens} tokens)")
        return int(np.searchsorted(self.doc_offsets, pos, side="right")) - 1

    def __repr__(self) -> str:
        return (f"TokenStore({str(self.path)!r}, tokens={self.num_tokens}, docs={self.num_docs}, "
                f"dtype={self.dtype.name})")
