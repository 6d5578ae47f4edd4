"""`tpzoo eval CKPT --objective dpo --data prefs.jsonl`: the DPO loss, reward accuracy and margins of a checkpoint
on preference pairs, at any layout (forward only, the training pass's code: tpzoo.post.dpo.dpo_pass).

The reference: a LoRA checkpoint's own base (its adapters switched off), else `--reference` (the model DPO
started from, e.g. the SFT checkpoint). Every pair of the file is evaluated once (the dp ranks take equal shares,
completed by fillers that count for nothing); the sums are reduced over dp x cp.
"""
from __future__ import annotations

import torch

from tpzoo.checkpoint.lora_io import lora_info
from tpzoo.parallel import comm, strict
from tpzoo.parallel.context_parallel import shard_batch

from .dpo import METRICS, DPOSettings, dpo_pass
from .dpo_data import build_preference_datasets
from .dpo_reference import LiveReference
from .reference import adapters_disabled, frozen_model


def reference_for(ckpt, chunks, reference, dims, layout_cfg) -> LiveReference:
    """The reference of an evaluated checkpoint (see the module docstring)."""
    if lora_info(ckpt) is not None and not reference:
        return LiveReference(chunks, dims, "the base without the adapters", lambda: adapters_disabled(chunks))
    return LiveReference(frozen_model(reference, dims, layout_cfg), dims, f"{reference}")


@torch.no_grad()
def evaluate_pairs(chunks, data, tokenizer, dims, settings: DPOSettings, reference: LiveReference, *,
                   seq_len: int, batch_size: int = 1, template: str = "auto", sequence_parallel: bool = False,
                   group: int = 8) -> dict:
    """{"pairs", "loss", rewards/..., logps/...} of the pairs in `data` (a JSONL path or records): means over the
    pairs; collective over every rank of `dims`."""
    from tpzoo.train.heldout import heldout_batches

    dataset, _ = build_preference_datasets(data, tokenizer, seq_len, template=template)
    host = heldout_batches(dataset, -(-len(dataset) // batch_size), batch_size, dims.dp_rank, dims.dp)
    device = chunks[0].device
    names = ("loss", *METRICS, "pairs")
    totals = torch.zeros(len(names), dtype=torch.float64, device=device)
    for i in range(0, len(host), group):
        batches = [{k: v.to(device) for k, v in shard_batch(b, dims, sequence_parallel).items()}
                   for b in host[i:i + group]]
        out = dpo_pass(chunks, batches, dims, settings, reference.logps(batches), group=dims.grad_group)
        totals += torch.tensor([out[k] for k in names], dtype=torch.float64, device=device)
    comm.all_reduce(totals, dims.grad_group)
    sums = dict(zip(names, totals.tolist()))
    n = sums.pop("pairs")
    strict.check_all_waited("the end of eval")
    return {"pairs": int(n), **{k: v / max(n, 1.0) for k, v in sums.items()}}
