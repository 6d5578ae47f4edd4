"""A corpus tokenized once into a memory-mapped token store.

On-disk layout of a store directory (see docs/data.md):

    tokens.bin        every document's token ids, concatenated; raw little-endian uint16 when the vocabulary
                      fits (vocab_size <= 65536), else uint32
    doc_offsets.npy   int64 [num_docs + 1]: document i is tokens[doc_offsets[i]:doc_offsets[i + 1]]
                      (doc_offsets[0] == 0, doc_offsets[-1] == num_tokens)
    index.json        metadata: format, version, dtype, num_tokens, num_docs, append_eos, prepend_bos,
                      tokenizer {spec, vocab_size, eos_id, bos_id, pad_id, dir}, sources
    tokenizer/        a copy of the tokenizer (so the store alone says how to decode it)

`tpzoo.data.preprocessing.preprocess` writes one (streaming, on every core, atomically, resumable).
`TokenStore` opens a store with numpy memmaps and never reads it whole; `open_store` opens either kind of token
store a --data path may name: this one, or a Megatron indexed dataset (`tpzoo.data.megatron.MegatronStore`).
"""
from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np

from tpzoo.errors import DataError

from .megatron import MegatronStore, megatron_prefix
from .tokenizer import load_tokenizer

FORMAT = "tpzoo-token-store"
VERSION = 1
TOKENS_FILE = "tokens.bin"
OFFSETS_FILE = "doc_offsets.npy"
INDEX_FILE = "index.json"
TOKENIZER_DIR = "tokenizer"

__all__ = ["TokenStore", "is_token_store", "open_store", "token_dtype"]


def token_dtype(vocab_size: int) -> np.dtype:
    """uint16 when every id (0 .. vocab_size-1) fits in 16 bits, else uint32; always little-endian."""
    return np.dtype("<u2") if vocab_size <= 2 ** 16 else np.dtype("<u4")


def is_token_store(path) -> bool:
    """A --data path that is already tokenized: a tpzoo token store directory or a Megatron dataset prefix."""
    return (Path(path) / INDEX_FILE).is_file() or megatron_prefix(path) is not None


def open_store(path) -> "TokenStore | MegatronStore":
    """The token store at ``path``: a tpzoo store directory, or a Megatron ``PREFIX`` (``PREFIX.bin`` /
    ``PREFIX.idx`` also name it)."""
    prefix = megatron_prefix(path)
    return MegatronStore(prefix) if prefix is not None else TokenStore(path)


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

    def check_tokenizer(self, tokenizer) -> None:
        """Refuse a run tokenizer other than the one the store was made with, in one line naming both."""
        mine = self.metadata["tokenizer"]
        if tokenizer.vocab_size != self.vocab_size:
            raise DataError(f"{self.path} was tokenized with {mine['spec']!r} (vocab_size {self.vocab_size}), but "
                            f"this run's tokenizer is {tokenizer.spec!r} (vocab_size {tokenizer.vocab_size}): pass "
                            f"--tokenizer {self.path} or preprocess the corpus again")

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
