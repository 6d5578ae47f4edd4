"""Context parallelism (cp): each cp rank holds 2 of the 2N chunks of every sequence, in the load-balanced causal
order (chunks r and 2N-1-r), and computes its tokens' activations, loss and gradients; attention is the only
place where tokens of different ranks meet (tpzoo.parallel.ring_attention, or all-to-all over heads, "a2a").

`shard_batch` cuts a micro-batch {"input_ids", "labels"[, ...]} of full sequences into this rank's share: the
sequence is first padded to a multiple of 2N (times tp under sequence parallelism, which then splits each rank's
tokens over tp) with ignored labels at the end, where causality hides the padding from every real token; the
rank's tokens get their global positions ("position_ids"), so rotary and learned positions stay those of the whole
sequence. Loss sums and token counts are then summed over the dp x cp group, and so are the gradients.

A packed batch (document masking, models/documents.py) brings "position_ids" (restarting at each document) and
"doc_ids": the rank keeps its tokens' position_ids, and the doc_ids of the *whole* padded sequence (the padding a
document of its own), which attention needs on every rank (ring blocks mask by the ids of both sides).
"""
from __future__ import annotations

import torch

from .dims import ParallelDims
from .ring_attention import local_positions

IGNORE_INDEX = -100
CP_MODES = ("ring", "a2a")
# Batch keys sharded like the tokens ([b, s, ...]): the model's (multi-token prediction's inputs and targets
# included), then DPO's side of each token and a distillation cache's teacher top K (tpzoo.post)
PER_TOKEN = ("input_ids", "labels", "position_ids", "token_mask", "mtp_ids", "mtp_labels", "dpo_seq", "teacher_ids",
             "teacher_logprobs")


def padded_length(seq_len: int, cp: int, multiple: int = 1) -> int:
    """The sequence length after padding to whole chunks: a multiple of 2 * cp * multiple."""
    unit = 2 * cp * multiple
    return -(-seq_len // unit) * unit


def shard_batch(batch: dict, dims: ParallelDims, sequence_parallel: bool = False) -> dict:
    """This cp rank's tokens of a batch of full sequences [b, s] (the batch itself at cp=1), with position_ids."""
    cp = dims.cp
    if cp == 1:
        return batch
    ids = batch["input_ids"]
    s = ids.shape[1]
    padded = padded_length(s, cp, dims.tp if sequence_parallel else 1)
    pos = local_positions(padded // (2 * cp), cp, dims.cp_rank, "cpu")
    out = {}
    for key, t in batch.items():
        # the padding: ignored labels; a document of its own (ids < s within a row, so `padded` is new); not a
        # real token (token_mask 0); zeros for the per-token data of objectives (tpzoo.post)
        fill = {"labels": IGNORE_INDEX, "mtp_labels": IGNORE_INDEX, "doc_ids": padded}.get(key, 0)
        if key in (*PER_TOKEN, "doc_ids") and padded > s:
            t = torch.cat([t, t.new_full((t.shape[0], padded - s, *t.shape[2:]), fill)], dim=1)
        out[key] = t.index_select(1, pos.to(t.device)) if key in PER_TOKEN else t
    if "position_ids" not in batch:
        out["position_ids"] = pos.unsqueeze(0).to(ids.device)
    if padded > s and "token_mask" not in batch:
        # the real tokens (the router statistics of a mixture of experts must not count the padding)
        out["token_mask"] = (pos < s).unsqueeze(0).expand(ids.shape[0], -1).to(ids.device)
    return out
