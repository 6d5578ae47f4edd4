"""The held-out sequences one evaluation of a training run takes: the same ones at every layout.

An evaluation reads the first `eval_batches x micro_batch_size` sequences of the held-out split (all of it when it
is shorter), whatever dp, cp, pp and tp, so runs at different layouts report the same held-out loss (to rounding)
for the same weights. The data-parallel ranks split them into dp consecutive slices of equal length, each cut into
micro-batches of micro_batch_size; where a slice runs short (past the end, or a last micro-batch not full) it is
filled with copies of the first sequence whose labels are all ignored (no loss, no tokens). Every dp rank thus runs
the same number of forwards of one shape, which the executor needs (one shape per call) and so do the collectives
of a forward over dp (ZeRO-3's weight gathers, a mixture of experts' token dispatch). The
context-parallel ranks of a replica take its sequences whole and keep their own chunks (shard_batch), as in
training; the loss is summed over dp x cp and divided by the predicted tokens.
"""
from __future__ import annotations

import numpy as np

from tpzoo.data import IGNORE_INDEX, collate_long


def heldout_batches(dataset, eval_batches: int, micro_batch_size: int, dp_rank: int, dp: int) -> list[dict]:
    """This dp rank's micro-batches (host tensors) of one evaluation of `dataset`; [] when it is empty."""
    n = min(len(dataset), eval_batches * micro_batch_size)
    if n == 0:
        return []
    per_rank = -(-n // dp)
    start = dp_rank * per_rank
    rows = [dataset[i] for i in range(start, min(start + per_rank, n))]
    padded = -(-per_rank // micro_batch_size) * micro_batch_size  # whole micro-batches
    if len(rows) < padded:
        first = dataset[0]
        filler = {**first, "labels": np.full_like(first["labels"], IGNORE_INDEX)}
        rows += [filler] * (padded - len(rows))
    return [collate_long(rows[i:i + micro_batch_size]) for i in range(0, padded, micro_batch_size)]
