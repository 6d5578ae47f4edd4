"""Language-model evaluation: mean next-token loss and perplexity of a token stream, under tp, pp and dp.

The stream is cut into windows of seq_len + 1 tokens with stride seq_len (consecutive windows share one
token), so every token but the first is predicted exactly once. Pipeline stages run one after the other: each
stage forwards and sends its hidden states to the next (point-to-point); the last stage computes the loss.
Data-parallel replicas take every dp-th batch; the sums are reduced over the world at the end.
"""
from __future__ import annotations

import math

import torch
import torch.distributed as dist

from tpzoo.parallel import comm
from tpzoo.parallel import state as ps

IGNORE = -100


def token_windows(tokens, seq_len: int) -> list[torch.Tensor]:
    tokens = torch.as_tensor(tokens, dtype=torch.long)
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


def pipeline_forward(model, input_ids: torch.Tensor, labels: torch.Tensor | None = None):
    """One forward through every pipeline stage; returns the last stage's output (per-token loss with labels,
    else the logits shard) there, and None on the other stages."""
    if ps.get_pp_size() == 1:
        return model(input_ids, labels=labels)
    b, s = input_ids.shape
    dtype = next(model.parameters()).dtype
    device = next(model.parameters()).device
    hidden = None
    if not model.pre_process:
        hidden = torch.empty(b, s, model.cfg.hidden_size, dtype=dtype, device=device)
        comm.batch_send_recv([], [(hidden, ps.get_pp_prev_rank())], ps.get_pp_group())
    out = model(input_ids if model.pre_process else None, hidden=hidden,
                labels=labels if model.post_process else None)
    if not model.post_process:
        comm.batch_send_recv([(out, ps.get_pp_next_rank())], [], ps.get_pp_group())
        return None
    return out


@torch.no_grad()
def evaluate(model, tokens, seq_len: int, batch_size: int = 1) -> dict:
    """{"tokens", "loss", "perplexity"} of `tokens` (a list or 1-d tensor); collective over every rank."""
    if getattr(model, "sequence_parallel", False):
        raise ValueError("evaluate: load the model without sequence parallelism")
    device = next(model.parameters()).device
    all_batches = batches(token_windows(tokens, seq_len), batch_size)
    dp, dp_rank = ps.get_dp_size(), ps.get_dp_rank()
    loss_sum = torch.zeros((), dtype=torch.float64)
    count = 0
    for i, batch in enumerate(all_batches):
        if i % dp != dp_rank:
            continue
        batch = batch.to(device)
        per_token = pipeline_forward(model, batch[:, :-1], labels=batch[:, 1:])
        if per_token is not None:
            loss_sum += per_token.double().sum().cpu()
            count += batch[:, 1:].numel()
    # Only one rank per (dp replica) contributes: the last stage's TP rank 0 (TP ranks hold the same loss).
    contributes = model.post_process and ps.get_tp_rank() == 0
    totals = torch.tensor([loss_sum.item(), float(count)] if contributes else [0.0, 0.0], dtype=torch.float64)
    if ps.is_initialized() and dist.is_initialized() and dist.get_world_size() > 1:
        comm.all_reduce(totals, None)
    n = int(totals[1].item())
    loss = totals[0].item() / max(n, 1)
    return {"tokens": n, "loss": loss, "perplexity": math.exp(loss) if n else float("nan")}
