"""Language-model evaluation: mean next-token loss and perplexity of a token stream, under tp, pp and dp.

The stream is cut into windows of seq_len + 1 tokens with stride seq_len (consecutive windows share one
token), so every token but the first is predicted exactly once. The batches run through the pipeline executor
(forward only, the same executor and loss as training); data-parallel replicas take every dp-th batch and the
sums are reduced over the data-parallel group at the end. Under sequence parallelism a window is padded on the
right to a multiple of tp with ignored labels (causal attention: the padding changes no real position's loss).
Under context parallelism every cp rank of a replica takes the same batches and keeps its load-balanced chunks
(tpzoo.parallel.context_parallel.shard_batch, which pads to whole chunks); the sums are reduced over dp x cp.
"""
from __future__ import annotations

import math

import torch

from tpzoo.parallel import comm, strict
from tpzoo.parallel.context_parallel import shard_batch
from tpzoo.parallel.dims import ParallelDims
from tpzoo.pipeline import as_chunks, forward_backward

IGNORE = -100


def token_windows(tokens, seq_len: int) -> list[torch.Tensor]:
    tokens = torch.as_tensor(tokens, dtype=torch.long, device="cpu")
    return [tokens[s: s + seq_len + 1] for s in range(0, max(1, len(tokens) - 1), seq_len)
            if len(tokens[s: s + seq_len + 1]) > 1]


def batches(windows: list[torch.Tensor], batch_size: int) -> list[torch.Tensor]:
    """Batches of equal-length windows (only the last window may be shorter: it gets a batch of its own)."""
    if not windows:
        return []
    full = [w for w in windows if len(w) == len(windows[0])]
    out = [torch.stack(full[i: i + batch_size]) for i in range(0, len(full), batch_size)]
    out += [w[None] for w in windows[len(full):]]
    return out


@torch.no_grad()
def evaluate(model_or_chunks, tokens, seq_len: int, batch_size: int = 1, dims: ParallelDims | None = None) -> dict:
    """{"tokens", "loss", "perplexity"} of `tokens` (a list or 1-d tensor) under this rank's model chunk(s);
    collective over every rank of `dims` (default: the chunks' dims)."""
    chunks = as_chunks(model_or_chunks)
    dims = dims or chunks[0].dims
    multiple = dims.tp if any(c.sequence_parallel for c in chunks) else 1
    device = chunks[0].device
    sp = any(c.sequence_parallel for c in chunks)
    # Every cp rank of a replica takes the same windows (and keeps its own chunks of them).
    every = batches(token_windows(tokens, seq_len), batch_size)
    mine = [b for i, b in enumerate(every) if i % dims.dp == dims.dp_rank]
    loss_sum, count = 0.0, 0
    # Micro-batches of one shape share one executor call (the pipeline streams them); a short tail runs alone.
    for shape in sorted({tuple(b.shape) for b in (every if dims.ep > 1 else mine)}, reverse=True):
        group = [_padded(shard_batch({"input_ids": b[:, :-1], "labels": b[:, 1:]}, dims, sp), multiple, device)
                 for b in mine if tuple(b.shape) == shape]
        if dims.ep > 1:
            # Expert dispatch is collective over the ep group: every replica runs as many forwards of each shape,
            # the ones short of a batch on a filler whose labels are all ignored (no loss, no tokens).
            same = [b for b in every if tuple(b.shape) == shape]
            filler = _padded(shard_batch({"input_ids": same[0][:, :-1],
                                          "labels": torch.full_like(same[0][:, 1:], IGNORE)}, dims, sp),
                             multiple, device)
            group += [filler] * (-(-len(same) // dims.dp) - len(group))
        out = forward_backward(chunks, group, dims, forward_only=True)
        loss_sum, count = loss_sum + out["loss_sum"], count + out["tokens"]
    totals = torch.tensor([loss_sum, float(count)], dtype=torch.float64, device=device)
    comm.all_reduce(totals, dims.grad_group)
    n = int(totals[1].item())
    loss = totals[0].item() / max(n, 1)
    strict.check_all_waited("the end of eval")  # strict collective mode; else a no-op
    return {"tokens": n, "loss": loss, "perplexity": math.exp(loss) if n else float("nan")}


def _padded(batch: dict, multiple: int, device) -> dict:
    """Right-pad the sequence to a multiple of `multiple` (labels ignored there), on `device`."""
    pad = -batch["input_ids"].shape[1] % multiple
    if pad and "position_ids" not in batch:  # (a cp shard is padded already)
        batch = {k: torch.nn.functional.pad(v, (0, pad), value=0 if k == "input_ids" else IGNORE)
                 for k, v in batch.items()}
    return {k: v.to(device) for k, v in batch.items()}
