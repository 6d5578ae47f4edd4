"""Fixed-length training samples cut from a concatenated token stream.

Sample ``i`` is the window ``stream[i * seq_len : i * seq_len + seq_len + 1]`` (consecutive windows share one
token), giving ``input_ids = window[:-1]`` and ``labels = window[1:]``, both ``seq_len`` long: ``labels[t]`` is
the token that position ``t`` must predict. There are ``(len(stream) - 1) // seq_len`` samples; the tokens after
the last whole window are not used.

With ``respect_doc_boundaries=True`` a label that is the first token of a document is set to -100 (ignored by the
loss): the last token of document A (its EOS) is not trained to predict the first token of the unrelated
document B that happens to follow it in the stream.

With ``document_masking=True`` (implies ``respect_doc_boundaries``; `tpzoo pretrain --document-masking`) each
sample also carries ``doc_ids`` (per input token, its document within the window: 0, 0, 1, 1, 1, 2, ...; the
piece of a document that the window starts in is document 0) and ``position_ids`` that restart at 0 with each
document; the model's attention then never crosses a boundary (models/documents.py), so a window trains exactly
as its documents' pieces would, each alone. Without it attention spans the boundaries of a window (the usual
pretraining packing, the fastest).

An optional per-token ``loss_mask`` (used by packed SFT) additionally sets ``labels[t] = -100`` wherever the
target token's mask is false.

Batches come from `tpzoo.data.loader.ResumableLoader`; `packed_loader` builds both in one call.
"""
from __future__ import annotations

import numpy as np

from tpzoo.errors import DataError

from .loader import ResumableLoader

IGNORE_INDEX = -100

__all__ = ["PackedDataset", "packed_loader", "documents_of", "single_documents_dropped", "IGNORE_INDEX"]


class PackedDataset:
    """Map-style dataset of packed windows over ``tokens`` (a `TokenStore` or any 1-D integer array).

    ``doc_offsets`` (document start offsets, optionally ending with the stream length) default to the store's;
    they are needed only with ``respect_doc_boundaries`` or ``document_masking``. ``dataset[i]`` is a dict of
    int64 numpy arrays ``{"input_ids": [seq_len], "labels": [seq_len]}`` (and ``"doc_ids"``, ``"position_ids"``
    with document masking).
    """

    def __init__(self, tokens, seq_len: int, *, respect_doc_boundaries: bool = False, doc_offsets=None,
                 loss_mask=None, document_masking: bool = False, check_tokenizer=None):
        if seq_len < 1:
            raise ValueError(f"seq_len must be positive, got {seq_len}")
        if doc_offsets is None:
            doc_offsets = getattr(tokens, "doc_offsets", None)
        self.tokens = getattr(tokens, "tokens", tokens)
        self.seq_len = seq_len
        self.document_masking = document_masking
        self.respect_doc_boundaries = respect_doc_boundaries or document_masking
        if self.respect_doc_boundaries and doc_offsets is None:
            raise ValueError("respect_doc_boundaries / document_masking need doc_offsets (or a TokenStore)")
        # A store's offsets stay as they are (a memmap, or a Megatron index's lazy DocOffsets): never read whole.
        if doc_offsets is not None and not hasattr(doc_offsets, "searchsorted"):
            doc_offsets = np.asarray(doc_offsets, dtype=np.int64)
        self.doc_offsets = doc_offsets
        # For data that records no tokenizer (a Megatron dataset): every window's ids must fit its vocabulary.
        self.check_tokenizer = check_tokenizer
        self.source = getattr(tokens, "path", "the token stream")
        if loss_mask is not None and len(loss_mask) != len(self.tokens):
            raise ValueError(f"loss_mask has {len(loss_mask)} entries for {len(self.tokens)} tokens")
        self.loss_mask = loss_mask
        self.num_samples = max(0, (len(self.tokens) - 1) // seq_len)

    def __len__(self) -> int:
        return self.num_samples

    def window_bounds(self, i: int) -> tuple[int, int]:
        """Stream positions ``[start, end)`` of sample ``i`` (``end - start == seq_len + 1``)."""
        if not 0 <= i < self.num_samples:
            raise IndexError(f"sample {i} out of range ({self.num_samples} samples)")
        start = i * self.seq_len
        return start, start + self.seq_len + 1

    def __getitem__(self, i: int) -> dict[str, np.ndarray]:
        start, end = self.window_bounds(i)
        window = np.asarray(self.tokens[start:end]).astype(np.int64)
        if self.check_tokenizer is not None:
            _check_ids(window, self.check_tokenizer, self.source)
        labels = window[1:].copy()
        if self.respect_doc_boundaries:
            # Document starts at stream positions start+1 .. end-1 are targets of label slots 0 .. seq_len-1.
            lo, hi = self.doc_offsets.searchsorted([start + 1, end])
            labels[np.asarray(self.doc_offsets[lo:hi]) - start - 1] = IGNORE_INDEX
        if self.loss_mask is not None:
            labels[~np.asarray(self.loss_mask[start + 1:end], dtype=bool)] = IGNORE_INDEX
        sample = {"input_ids": window[:-1], "labels": labels}
        if self.document_masking:
            # documents starting at input slots 1 .. seq_len-1 (stream positions start+1 .. start+seq_len-1)
            lo, hi = self.doc_offsets.searchsorted([start + 1, start + self.seq_len])
            starts = np.unique(np.asarray(self.doc_offsets[lo:hi])) - start
            sample.update(documents_of(starts, self.seq_len))
        return sample


def _check_ids(window: np.ndarray, tokenizer, source) -> None:
    vocab = tokenizer.vocab_size
    if window.size and (window.max() >= vocab or window.min() < 0):
        from .megatron import mismatch_message

        raise DataError(mismatch_message(source, int(window.max() if window.max() >= vocab else window.min()),
                                         tokenizer))


def documents_of(starts: np.ndarray, length: int) -> dict[str, np.ndarray]:
    """``doc_ids`` and ``position_ids`` (int64 [length]) of a row whose documents begin at slot 0 and at the
    increasing slots ``starts`` (> 0)."""
    first = np.zeros(length, dtype=np.int64)
    first[starts] = 1
    doc_ids = np.cumsum(first)
    return {"doc_ids": doc_ids, "position_ids": np.arange(length, dtype=np.int64)
            - np.concatenate([[0], starts]).astype(np.int64)[doc_ids]}


def single_documents_dropped(batch: dict) -> dict:
    """A batch whose every row is one document needs no document mask: without its doc_ids and position_ids
    (0 .. s-1 then) it takes attention's plain causal path (host tensors)."""
    ids = batch.get("doc_ids")
    if ids is None or bool((ids[:, -1] != ids[:, 0]).any()):
        return batch
    return {k: v for k, v in batch.items() if k not in ("doc_ids", "position_ids")}


def packed_loader(tokens, seq_len: int, micro_batch_size: int, *, respect_doc_boundaries: bool = False,
                  dp_rank: int = 0, dp_size: int = 1, seed: int = 0, shuffle: bool = True,
                  num_epochs: int | None = None, prefetch: int = 2,
                  document_masking: bool = False) -> ResumableLoader:
    """A `ResumableLoader` over a `PackedDataset` of ``tokens`` (a `TokenStore`, its path, or an array).

    Yields ``{"input_ids": LongTensor[b, seq_len], "labels": LongTensor[b, seq_len]}`` (and ``doc_ids``,
    ``position_ids`` with document masking).
    """
    if isinstance(tokens, (str, bytes)) or hasattr(tokens, "__fspath__"):
        from .token_store import TokenStore

        tokens = TokenStore(tokens)
    dataset = PackedDataset(tokens, seq_len, respect_doc_boundaries=respect_doc_boundaries,
                            document_masking=document_masking)
    return ResumableLoader(dataset, micro_batch_size, dp_rank=dp_rank, dp_size=dp_size, seed=seed,
                           shuffle=shuffle, num_epochs=num_epochs, prefetch=prefetch)
