"""Packed sequences' documents: the data type a micro-batch's `doc_ids` become (attention over them is a kind's:
models/kinds/document_attention.py).

A packed micro-batch carries `doc_ids` [b, S]: per token, the index of its document within the row (0, 0, 0, 1,
1, 2, ...; a run of equal ids is one document, padding is a document of its own). Query i may see key j when
j <= i, both lie in the same document and, for a sliding-window layer, i - j < window: exactly what each document
would get trained alone, so packing changes the speed of training, never what is learned. Positions restart at
0 in every document (`document_positions`, when the batch brings no position_ids).

`Documents` (built once per forward by Transformer.forward, handed to every layer like cos/sin) holds the ids of
each row's *whole* sequence in natural order (under context parallelism every cp rank holds all of them: ring
attention picks the ids of each block, Ulysses attends over the whole sequence) and caches the masks it builds,
one per sliding window, so the layers of a forward and their recomputation (activation checkpointing) share one.
"""
from __future__ import annotations

import torch


def document_positions(doc_ids: torch.Tensor) -> torch.Tensor:
    """Positions [b, S] that restart at 0 where each document (run of equal ids) starts."""
    b, s = doc_ids.shape
    idx = torch.arange(s, device=doc_ids.device).expand(b, s)
    starts = torch.ones_like(doc_ids, dtype=torch.bool)
    starts[:, 1:] = doc_ids[:, 1:] != doc_ids[:, :-1]
    return idx - torch.where(starts, idx, 0).cummax(dim=1).values


class Documents:
    """The documents of a packed micro-batch: `ids` [b, S] of whole sequences, natural order (see above)."""

    def __init__(self, doc_ids: torch.Tensor):
        if doc_ids.dim() != 2 or doc_ids.dtype.is_floating_point:
            raise ValueError(f"doc_ids must be integer [batch, seq], got {doc_ids.dtype} {tuple(doc_ids.shape)}")
        self.ids = doc_ids
        self._masks: dict = {}

    def _visible(self, window: int | None) -> torch.Tensor:
        s = self.ids.shape[1]
        pos = torch.arange(s, device=self.ids.device)
        mask = (pos.unsqueeze(0) <= pos.unsqueeze(1)) & (self.ids.unsqueeze(2) == self.ids.unsqueeze(1))
        if window is not None:
            mask &= pos.unsqueeze(1) - pos.unsqueeze(0) < window
        return mask.unsqueeze(1)

    def visible(self, window: int | None) -> torch.Tensor:
        """Boolean [b, 1, S, S]: query i may see key j (causal, same document, within the window)."""
        key = ("bool", window)
        if key not in self._masks:
            self._masks[key] = self._visible(window)
        return self._masks[key]

    def additive(self, window: int | None, dtype: torch.dtype) -> torch.Tensor:
        """visible() as SDPA's additive mask (0 / -inf) in `dtype`: built once, so every layer saves this one
        tensor for its backward (a boolean mask would be converted, and saved, per call)."""
        key = ("add", window, dtype)
        if key not in self._masks:
            zero = torch.zeros((), dtype=dtype, device=self.ids.device)
            self._masks[key] = torch.where(self._visible(window), zero, float("-inf"))
        return self._masks[key]

    def block_mask(self, window: int | None, compiled: bool):
        """FlexAttention's BlockMask of visible() (same for every head)."""
        key = ("flex", window)
        if key not in self._masks:
            from torch.nn.attention.flex_attention import create_block_mask

            ids = self.ids

            def mask_mod(b, h, q_idx, kv_idx):
                seen = (kv_idx <= q_idx) & (ids[b, q_idx] == ids[b, kv_idx])
                return seen & (q_idx - kv_idx < window) if window is not None else seen

            b, s = ids.shape
            self._masks[key] = create_block_mask(mask_mod, b, None, s, s, device=ids.device, _compile=compiled)
        return self._masks[key]
