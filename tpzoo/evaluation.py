"""Language-model evaluation: mean next-token loss and perplexity of a token stream, under tp, pp and dp.

The stream is cut into windows of seq_len + 1 tokens with stride seq_len (consecutive windows share one
token), so every token but the first is predicted exactly once. The batches run through the pipeline executor
(forward only, the same executor and loss as training); data-parallel replicas take every dp-th batch and the
sums are reduced over the data-parallel group at the end. Under sequence parallelism a window is padded on the
right to a multiple of tp with ignored labels (causal attention: the padding changes no real position's loss).
Under context parallelism every cp rank of a replica takes the same batches and keeps its load-balanced chunks
(tpzoo.parallel.context_parallel.shard_batch, which pads to whole chunks); the sums are reduced over dp x cp.

`loss` and `perplexity` are the language model's alone (transformers' causal-LM loss from the logits), whether or
not the model trains with auxiliary losses. The auxiliary losses its layer kinds report (models/aux.py; a mixture
of experts: `router_aux_loss`, HF's load-balancing loss, and `router_z_loss`, ST-MoE's) come beside them, without
their coefficients, each a mean over forwards weighted by the forward's predicted tokens (they are per forward, as
in training, whose loss is then loss + router_aux_loss_coef * router_aux_loss + router_z_loss_coef *
router_z_loss). Padding, whether sequence parallelism's or context parallelism's, is masked out of the
statistics (token_mask). A model with multi-token prediction reports `mtp_loss` too: its depths' mean loss per
predicted token (tpzoo.models.mtp), the part of the training loss --mtp-loss-scale weighs.
"""
from __future__ import annotations

import math

import torch

from tpzoo.data.mtp import with_mtp_targets
from tpzoo.models import LossOptions
from tpzoo.parallel import comm, strict
from tpzoo.parallel.context_parallel import shard_batch
from tpzoo.parallel.dims import ParallelDims
from tpzoo.pipeline import as_chunks, execute, lm_step

# the language model's loss; the auxiliary ones (and multi-token prediction's) reported beside it
HELD_OUT = LossOptions(aux_losses=False, mtp=0.0)

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
    """{"tokens", "loss", "perplexity"} of `tokens` (a list or 1-d tensor) under this rank's model chunk(s), and
    the auxiliary losses the model reports (a mixture of experts: "router_aux_loss", "router_z_loss"); collective
    over every rank of `dims` (default: the chunks' dims)."""
    chunks = as_chunks(model_or_chunks)
    dims = dims or chunks[0].dims
    multiple = dims.tp if any(c.sequence_parallel for c in chunks) else 1
    device = chunks[0].device
    sp = any(c.sequence_parallel for c in chunks)
    # Every cp rank of a replica takes the same windows (and keeps its own chunks of them).
    every = batches(token_windows(tokens, seq_len), batch_size)
    mine = [b for i, b in enumerate(every) if i % dims.dp == dims.dp_rank]
    cfg = chunks[0].cfg
    sums = _Sums(chunks, device, reported_losses(cfg))

    def batch(ids, labels):  # this rank's share, with multi-token prediction's targets from the whole rows
        return _padded(shard_batch(with_mtp_targets({"input_ids": ids, "labels": labels}, cfg.mtp_depths), dims, sp),
                       multiple, device)

    # Micro-batches of one shape share one executor call (the pipeline streams them); a short tail runs alone.
    for shape in sorted({tuple(b.shape) for b in (every if dims.ep > 1 else mine)}, reverse=True):
        group = [batch(b[:, :-1], b[:, 1:]) for b in mine if tuple(b.shape) == shape]
        if dims.ep > 1:
            # Expert dispatch is collective over the ep group: every replica runs as many forwards of each shape,
            # the ones short of a batch on a filler whose labels are all ignored (no loss, no tokens).
            same = [b for b in every if tuple(b.shape) == shape]
            filler = batch(same[0][:, :-1], torch.full_like(same[0][:, 1:], IGNORE))
            group += [filler] * (-(-len(same) // dims.dp) - len(group))
        execute(chunks, group, dims, lm_step(HELD_OUT, sums), forward_only=True)
    totals = sums.totals
    if dims.pp > 1:  # only the last stage computed them
        totals = comm.broadcast(totals, src=dims.pp_peer(dims.pp - 1), group=dims.pp_group)
    comm.all_reduce(totals, dims.grad_group)
    loss_sum, n, *reported = totals.tolist()
    n = int(n)
    loss = loss_sum / max(n, 1)
    out = {"tokens": n, "loss": loss, "perplexity": math.exp(loss) if n else float("nan")}
    out.update({name: value / max(n, 1) for name, value in zip(sums.names, reported)})
    strict.check_all_waited("the end of eval")  # strict collective mode; else a no-op
    return out


def reported_losses(cfg) -> list[str]:
    """The auxiliary losses a held-out forward of this model reports (models/aux.py rules), in a fixed order."""
    from tpzoo.models.aux import model_rules

    return [name for _, rule in sorted(model_rules(cfg).items()) if rule.carried(cfg, HELD_OUT)
            for name in rule.reports] + (["mtp_loss"] if cfg.mtp is not None else [])


class _Sums:
    """Last stage: sums, on the device (no host sync per forward), of the language-model loss over the predicted
    tokens, their number, and each reported auxiliary loss of the forward times its predicted tokens (the
    head's aux_reports, which the forward just computed from the statistics of every layer)."""

    def __init__(self, chunks, device, names: list[str]):
        self.head, self.names = next((c for c in chunks if c.post_process), None), names
        self.totals = torch.zeros(2 + len(names), dtype=torch.float64, device=device)

    def __call__(self, mb, per_token, batch) -> None:
        n = (batch["labels"] != IGNORE).sum().double()
        self.totals[:2] += torch.stack([per_token.detach().double().sum(), n])
        if self.names:
            reports = self.head.aux_reports
            self.totals[2:] += torch.stack([reports[name].double() for name in self.names]) * n


def _padded(batch: dict, multiple: int, device) -> dict:
    """Right-pad the sequence to a multiple of `multiple` (labels ignored there, and token_mask 0: the router
    statistics of a mixture of experts skip the padding, which HF's sequence does not have), on `device`."""
    pad = -batch["input_ids"].shape[1] % multiple
    if pad and "position_ids" not in batch:  # (a cp shard is padded already)
        b, s = batch["input_ids"].shape
        batch = {k: torch.nn.functional.pad(v, (0, 0) * (v.dim() - 2) + (0, pad),  # (along the sequence)
                                            value=0 if k in ("input_ids", "mtp_ids") else IGNORE)
                 for k, v in batch.items()}
        batch["token_mask"] = (torch.arange(s + pad, device="cpu") < s).expand(b, -1)  # on the host, as the batch
    return {k: v.to(device) for k, v in batch.items()}
