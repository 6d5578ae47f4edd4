"""Megatron-LM's indexed dataset (``PREFIX.bin`` + ``PREFIX.idx``), read as a token store and written.

This is the format of Megatron-Core's ``IndexedDataset`` / ``IndexedDatasetBuilder`` (what Megatron-LM's
``tools/preprocess_data.py`` writes). Written from the layout, not from Megatron's code:

    PREFIX.bin   the token ids of every sequence, concatenated, in the index's dtype (native little-endian)
    PREFIX.idx   b"MMIDIDX\\x00\\x00"                     9 bytes, the magic
                 version              <u8  = 1
                 dtype code           <u1  (1 uint8, 2 int8, 3 int16, 4 int32, 5 int64, 8 uint16; 6/7 are floats)
                 sequence count S     <u8
                 document count D+1   <u8  (the length of the document index below)
                 sequence lengths     <i4 [S]   tokens per sequence
                 sequence pointers    <i8 [S]   byte offset of each sequence in PREFIX.bin
                 document index       <i8 [D+1] document d = sequences [index[d], index[d+1]); index[0] = 0
                 (sequence modes      <i1 [S]   only in multimodal datasets; ignored here)

A document is one or more sequences (``preprocess_data.py --split-sentences`` makes one per sentence; without it,
one per document, the EOD token appended to it). tpzoo's documents are Megatron's documents.

Reading (`MegatronStore`) memory-maps both files and never reads them whole: opening costs O(1) checks (magic,
version, sizes: a missing ``.idx``, a truncated ``.bin`` or ``.idx`` are one-line errors), and the document offsets
in tokens are computed from the memory-mapped pointers when asked (`DocOffsets`), so a terabyte dataset opens
without a pass over its index. Writing (`write_index`) streams the index from the document lengths.
"""
from __future__ import annotations

import struct
from pathlib import Path

import numpy as np

from tpzoo.errors import DataError

MAGIC = b"MMIDIDX\x00\x00"
HEADER = struct.Struct("<9sQBQQ")  # magic, version, dtype code, sequence count, document-index length
DTYPE_CODES = {1: np.uint8, 2: np.int8, 3: np.int16, 4: np.int32, 5: np.int64, 8: np.uint16}  # 6, 7: floats
CODE_OF = {np.dtype(t): code for code, t in DTYPE_CODES.items()}
# Below this many tokens Megatron's preprocess_data.py stores uint16, else int32 (DType.optimal_dtype).
UINT16_BELOW = 65500
_CHUNK = 1 << 22  # index entries per pass of a streamed loop (32 MiB of int64)

__all__ = ["MegatronStore", "DocOffsets", "is_megatron_prefix", "megatron_prefix", "megatron_dtype", "write_index"]


def megatron_prefix(path) -> str | None:
    """The dataset prefix a --data path names, or None: ``PREFIX`` itself, or ``PREFIX.bin`` / ``PREFIX.idx``,
    when one of the two files exists (the other one missing is then an error when the store is opened)."""
    s = str(path)
    if s.endswith((".bin", ".idx")) and Path(s).is_file():
        return s[:-4]
    if Path(s).exists():
        return None
    return s if Path(s + ".idx").is_file() or Path(s + ".bin").is_file() else None


def is_megatron_prefix(path) -> bool:
    return megatron_prefix(path) is not None


def megatron_dtype(vocab_size: int) -> np.dtype:
    """The token dtype Megatron-LM's preprocessing picks for a vocabulary: uint16 below 65500 ids, else int32."""
    return np.dtype("<u2") if vocab_size < UINT16_BELOW else np.dtype("<i4")


class DocOffsets:
    """Document boundaries in tokens, ``[D + 1]``, computed from the memory-mapped index on access.

    ``offsets[d]`` = the first token of document d (``offsets[D]`` = the token count); supports ``len``, integer
    and slice indexing (int64 arrays) and ``searchsorted`` like a numpy array, without materializing all of them.
    """

    def __init__(self, pointers: np.ndarray, doc_index: np.ndarray, itemsize: int, num_tokens: int):
        self.pointers, self.doc_index, self.itemsize, self.num_tokens = pointers, doc_index, itemsize, num_tokens
        self.shape = (len(doc_index),)
        # A valid document index one longer than the sequences is 0, 1, ..., S (one sequence per document, what
        # preprocess_data.py writes without --split-sentences): searches then run in numpy over the pointers.
        self.one_per_doc = len(doc_index) == len(pointers) + 1

    def __len__(self) -> int:
        return len(self.doc_index)

    def _at(self, seq: np.ndarray) -> np.ndarray:
        seq = np.asarray(seq, dtype=np.int64)
        inside = seq < len(self.pointers)
        starts = self.pointers[np.where(inside, seq, 0)] // self.itemsize if len(self.pointers) else seq
        return np.where(inside, starts, self.num_tokens).astype(np.int64)

    def __getitem__(self, i):
        out = self._at(self.doc_index[i])
        return int(out) if np.ndim(out) == 0 else out

    def __array__(self, dtype=None, copy=None):
        return self[:].astype(dtype or np.int64)

    def searchsorted(self, values, side: str = "left"):
        """Like ``np.searchsorted(offsets, values, side)`` (a binary search through the index, O(log D))."""
        scalar = np.ndim(values) == 0
        values = np.atleast_1d(np.asarray(values, dtype=np.int64))
        if self.one_per_doc:
            out = np.searchsorted(self.pointers, values * self.itemsize, side=side).astype(np.int64)
            past = values > self.num_tokens if side == "left" else values >= self.num_tokens
            out[(out == len(self.pointers)) & past] += 1  # past the last boundary, the token count
        else:
            out = np.asarray([self._search(int(v), side) for v in values], dtype=np.int64)
        return int(out[0]) if scalar else out

    def _search(self, value: int, side: str) -> int:
        lo, hi = 0, len(self)
        while lo < hi:
            mid = (lo + hi) // 2
            x = self[mid]
            if x < value or (side == "right" and x == value):
                lo = mid + 1
            else:
                hi = mid
        return lo


class MegatronStore:
    """A Megatron indexed dataset opened read-only with the `TokenStore` interface that training uses:
    ``tokens`` (a memmap of ``PREFIX.bin``), ``doc_offsets`` (`DocOffsets`), ``num_tokens``, ``num_docs``,
    ``dtype``, ``len``, slicing, ``doc(i)``. It records no tokenizer (``vocab_size`` is None): the run's
    tokenizer is checked against the ids instead (`check_tokenizer`)."""

    vocab_size = None
    metadata = {"format": "megatron-indexed-dataset"}

    def __init__(self, prefix):
        self.prefix = str(prefix)
        self.path = Path(self.prefix)
        idx, bin_ = Path(self.prefix + ".idx"), Path(self.prefix + ".bin")
        if not idx.is_file():
            raise DataError(f"{self.prefix}: Megatron dataset index {idx} is missing"
                            + (f" ({bin_} exists)" if bin_.is_file() else ""))
        if not bin_.is_file():
            raise DataError(f"{self.prefix}: Megatron dataset data file {bin_} is missing ({idx} exists)")
        size = idx.stat().st_size
        with idx.open("rb") as f:
            raw = f.read(HEADER.size)
        if len(raw) < HEADER.size or raw[:9] != MAGIC:
            raise DataError(f"{idx}: not a Megatron indexed dataset index (no MMIDIDX header)")
        _, version, code, n_seq, n_doc = HEADER.unpack(raw)
        if version != 1:
            raise DataError(f"{idx}: MMIDIDX version {version}, only version 1 is known")
        if code not in DTYPE_CODES:
            raise DataError(f"{idx}: token dtype code {code} is not an integer type (codes 1-5, 8)")
        self.dtype = np.dtype(DTYPE_CODES[code]).newbyteorder("<")
        need = HEADER.size + n_seq * 12 + n_doc * 8
        if size not in (need, need + n_seq):  # + one mode byte per sequence in a multimodal dataset
            raise DataError(f"{idx}: {size} bytes, but its header ({n_seq} sequences, {n_doc} document-index "
                            f"entries) needs {need}" + (": truncated" if size < need else ""))
        if n_doc < 1:
            raise DataError(f"{idx}: empty document index")
        off = HEADER.size
        # (np.memmap cannot map zero bytes: an index of no sequences gets empty arrays)
        self.lengths = (np.memmap(idx, dtype="<i4", mode="r", offset=off, shape=(n_seq,)) if n_seq
                        else np.zeros(0, "<i4"))
        self.pointers = (np.memmap(idx, dtype="<i8", mode="r", offset=off + 4 * n_seq, shape=(n_seq,)) if n_seq
                         else np.zeros(0, "<i8"))
        self.doc_index = np.memmap(idx, dtype="<i8", mode="r", offset=off + 12 * n_seq, shape=(n_doc,))
        isz = self.dtype.itemsize
        end = int(self.pointers[-1]) + int(self.lengths[-1]) * isz if n_seq else 0
        bin_size = bin_.stat().st_size
        if bin_size < end:
            raise DataError(f"{bin_}: {bin_size} bytes, but {idx} describes {end} ({end // isz} tokens of "
                            f"{self.dtype.name}): truncated")
        if bin_size != end:
            raise DataError(f"{bin_}: {bin_size} bytes, but {idx} describes {end}: not the data file of this index")
        if int(self.doc_index[0]) != 0 or int(self.doc_index[-1]) != n_seq or (n_seq and int(self.pointers[0]) != 0):
            raise DataError(f"{idx}: inconsistent index (document index from {int(self.doc_index[0])} to "
                            f"{int(self.doc_index[-1])} for {n_seq} sequences)")
        if n_seq <= _CHUNK:  # a small index is verified whole; a large one is trusted as Megatron writes it
            _check_contiguous(self.lengths, self.pointers, isz, idx)
        self.num_tokens = end // isz
        self.num_docs = n_doc - 1
        self.num_sequences = n_seq
        self.tokens = (np.memmap(bin_, dtype=self.dtype, mode="r", shape=(self.num_tokens,)) if self.num_tokens
                       else np.zeros(0, dtype=self.dtype))
        self.doc_offsets = DocOffsets(self.pointers, self.doc_index, isz, self.num_tokens)

    def __len__(self) -> int:
        return self.num_tokens

    def __getitem__(self, idx):
        return self.tokens[idx]

    def doc(self, i: int) -> np.ndarray:
        if not 0 <= i < self.num_docs:
            raise IndexError(f"document {i} out of range ({self.num_docs} documents)")
        return np.asarray(self.tokens[self.doc_offsets[i]:self.doc_offsets[i + 1]])

    def check_tokenizer(self, tokenizer, sample_tokens: int = 1 << 26) -> None:
        """Refuse a tokenizer whose vocabulary the ids do not fit, in one line naming both (TokenStore's check:
        the format records no tokenizer, so the ids are what is checked). The whole dataset is
        scanned when it has at most ``sample_tokens`` tokens, else its first and last ``sample_tokens // 2``
        (training also checks every window it reads: `PackedDataset(vocab_size=...)`)."""
        n, half = self.num_tokens, sample_tokens // 2
        parts = [(0, n)] if n <= sample_tokens else [(0, half), (n - half, n)]
        for a, b in parts:
            for s in range(a, b, _CHUNK):
                chunk = np.asarray(self.tokens[s:min(b, s + _CHUNK)])
                if chunk.size and (int(chunk.max()) >= tokenizer.vocab_size or int(chunk.min()) < 0):
                    bad = int(chunk.max()) if int(chunk.max()) >= tokenizer.vocab_size else int(chunk.min())
                    raise DataError(mismatch_message(self.prefix, bad, tokenizer))

    def __repr__(self) -> str:
        return (f"MegatronStore({self.prefix!r}, tokens={self.num_tokens}, docs={self.num_docs}, "
                f"dtype={self.dtype.name})")


def mismatch_message(what, token_id: int, tokenizer) -> str:
    return (f"{what}: token id {token_id} is outside the vocabulary of the tokenizer {tokenizer.spec!r} "
            f"(vocab_size {tokenizer.vocab_size}): the data was tokenized with another tokenizer (pass its "
            f"--tokenizer)")


def _check_contiguous(lengths, pointers, itemsize: int, idx) -> None:
    """Every sequence starts where the one before it ends (as Megatron writes them): a document is then one
    contiguous token range."""
    expect = np.zeros(len(lengths), dtype=np.int64)
    np.cumsum(np.asarray(lengths[:-1], dtype=np.int64) * itemsize, out=expect[1:])
    if (np.asarray(lengths) < 0).any() or not np.array_equal(expect, np.asarray(pointers)):
        raise DataError(f"{idx}: sequence pointers are not contiguous: not an index this reader supports")


def write_index(path, dtype: np.dtype, doc_offsets: np.ndarray) -> None:
    """Write a Megatron ``.idx`` for documents of one sequence each (``doc_offsets``: int64 token offsets
    ``[D + 1]``, may be a memmap), streamed ``_CHUNK`` documents at a time."""
    dtype = np.dtype(dtype)
    if dtype not in CODE_OF:
        raise ValueError(f"Megatron indexed datasets have no token dtype {dtype}")
    n = len(doc_offsets) - 1
    with open(path, "wb") as f:
        f.write(HEADER.pack(MAGIC, 1, CODE_OF[dtype], n, n + 1))
        for s in range(0, n, _CHUNK):  # sequence lengths
            lengths = np.diff(np.asarray(doc_offsets[s:min(n, s + _CHUNK) + 1], dtype=np.int64))
            if lengths.size and lengths.max() > np.iinfo(np.int32).max:
                raise DataError(f"a document of {int(lengths.max())} tokens does not fit Megatron's int32 lengths")
            f.write(lengths.astype("<i4").tobytes())
        for s in range(0, n, _CHUNK):  # sequence pointers: byte offsets
            f.write((np.asarray(doc_offsets[s:min(n, s + _CHUNK)], dtype=np.int64) * dtype.itemsize)
                    .astype("<i8").tobytes())
        for s in range(0, n + 1, _CHUNK):  # document index: one sequence per document
            f.write(np.arange(s, min(n + 1, s + _CHUNK), dtype="<i8").tobytes())
