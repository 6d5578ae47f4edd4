"""Multi-token prediction's inputs and targets (tpzoo.models.mtp): what depth k embeds and predicts at each position
of a batch of whole rows, computed before context parallelism cuts the rows (so the shift crosses cp ranks with
nothing sent: every cp rank of a replica holds the whole rows, tpzoo.parallel.context_parallel.shard_batch).

Depth k (1..D) at position i embeds t_{i+k} = input_ids[i+k] and predicts t_{i+k+1} = labels[i+k] (labels[i] is
t_{i+1}): a position counts only where that target is a trained token (Megatron-Core rolls the loss mask the same
way). Past the row's end, or past the end of position i's document in a packed row (doc_ids), nothing is read: the
input is token 0 and the target ignored, exactly what the document run alone gives there.
"""
from __future__ import annotations

import torch

from .packed import IGNORE_INDEX


def mtp_targets(input_ids: torch.Tensor, labels: torch.Tensor, depths: int,
                doc_ids: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(mtp_ids, mtp_labels), each [b, s, depths]: column k-1 holds depth k's input token and target."""
    b, s = input_ids.shape
    ids, targets = [], []
    for k in range(1, depths + 1):
        shifted_ids = input_ids.new_zeros(b, s)
        shifted_labels = labels.new_full((b, s), IGNORE_INDEX)
        if k < s:
            shifted_ids[:, :s - k] = input_ids[:, k:]
            shifted_labels[:, :s - k] = labels[:, k:]
            if doc_ids is not None:  # t_{i+k} in another document than position i: read nothing
                apart = torch.ones(b, s, dtype=torch.bool, device=input_ids.device)
                apart[:, :s - k] = doc_ids[:, k:] != doc_ids[:, :s - k]
                shifted_ids = shifted_ids.masked_fill(apart, 0)
                shifted_labels = shifted_labels.masked_fill(apart, IGNORE_INDEX)
        ids.append(shifted_ids)
        targets.append(shifted_labels)
    return torch.stack(ids, dim=-1), torch.stack(targets, dim=-1)


def with_mtp_targets(batch: dict, depths: int) -> dict:
    """`batch` ({"input_ids", "labels"[, "doc_ids"], ...} of whole rows) with "mtp_ids" and "mtp_labels" added
    (depths 0: unchanged)."""
    if not depths or "labels" not in batch:
        return batch
    mtp_ids, mtp_labels = mtp_targets(batch["input_ids"], batch["labels"], depths, batch.get("doc_ids"))
    return {**batch, "mtp_ids": mtp_ids, "mtp_labels": mtp_labels}
