"""DPO's reference log-probabilities: per micro-batch, the summed log-probabilities [b, 2] of each row's (chosen,
rejected) under the reference model, on the last pipeline stage, before the policy's pass reads them.

  LoRA                      the policy with its adapters switched off (tpzoo.post.reference.adapters_disabled):
                            one forward-only pass of the executor per step, no second copy of the base
  full fine-tune            a frozen copy of --base at the run's layout (tpzoo.post.reference.frozen_model)
  --dpo-precompute-ref      the table of every pair's reference log-probabilities (training and held-out pairs),
                            computed once before the first step by the model itself (the base then; with LoRA,
                            without its adapters), the pairs spread over the dp ranks; kept in every checkpoint
                            (dpo_reference.safetensors) so that a resumed run reads it instead of a model that has
                            moved on. Memory: 16 bytes per pair; time: one forward over the data.
"""
from __future__ import annotations

import contextlib
from pathlib import Path

import torch

from tpzoo.errors import ConfigError
from tpzoo.models import LossOptions
from tpzoo.parallel import comm

from .dpo import side_sums
from .objective import side_pass
from .reference import adapters_disabled, frozen_model

TABLE_FILE = "dpo_reference.safetensors"


class LiveReference:
    """A reference model run on each step's micro-batches: `chunks` inside `context()` (adapters off, or none)."""

    def __init__(self, chunks, dims, what: str, context=contextlib.nullcontext, fused: bool = True):
        self.chunks, self.dims, self.what, self.context = chunks, dims, what, context
        self.loss = LossOptions(aux_losses=False, fused=fused)

    def logps(self, batches: list[dict]) -> list:
        keep: list = [None] * len(batches)

        def last(mb, per_token, batch):
            keep[mb] = side_sums(per_token, batch, self.dims)[0]

        with self.context():
            side_pass(self.chunks, batches, self.dims, last, loss=self.loss)
        return keep

    def describe(self) -> str:
        return self.what

    def save(self, trainer, directory) -> None:
        pass


class PrecomputedReference:
    """The table of every pair's reference log-probabilities ([rows, 2] fp64, by `dpo_row`)."""

    def __init__(self, table: torch.Tensor, what: str):
        self.table, self.what = table, what

    def logps(self, batches: list[dict]) -> list:
        return [self.table[b["dpo_row"].to(self.table.device)] for b in batches]

    def describe(self) -> str:
        return f"precomputed for {self.table.shape[0]} pairs ({self.what})"

    def save(self, trainer, directory) -> None:
        if trainer.rank == 0:
            from safetensors.torch import save_file

            save_file({"logps": self.table.cpu()}, str(Path(directory) / TABLE_FILE))


@torch.no_grad()
def precompute(live: LiveReference, datasets: list, prepare, micro_batch_size: int, group: int = 8) -> torch.Tensor:
    """The reference log-probabilities of every row of `datasets` (their dpo_row numbering covers them all), each
    dp rank computing an equal share (held-out style: whole micro-batches, fillers without trained tokens) and the
    shares summed over dp; `prepare(host batch)` gives this rank's device batch (its cp share)."""
    from tpzoo.train.heldout import heldout_batches

    dims = live.dims
    device = live.chunks[0].device
    rows = sum(len(d) for d in datasets if d is not None)
    table = torch.zeros(rows, 2, dtype=torch.float64, device=device)
    for ds in datasets:
        if ds is None or len(ds) == 0:
            continue
        host = heldout_batches(ds, -(-len(ds) // micro_batch_size), micro_batch_size, dims.dp_rank, dims.dp)
        for i in range(0, len(host), group):
            batches = [prepare(b) for b in host[i:i + group]]
            for batch, sums in zip(batches, live.logps(batches)):
                if sums is not None:  # the last stage (a filler's rows add zeros)
                    table.index_add_(0, batch["dpo_row"].to(device), sums)
    if dims.dp > 1:
        comm.all_reduce(table, dims.dp_group)
    if dims.pp > 1:  # every rank holds it (rank 0 saves it)
        table = comm.broadcast(table, src=dims.pp_peer(dims.pp - 1), group=dims.pp_group)
    return table


def _base_of(trainer) -> str:
    """--base, else the base of the run being resumed (its train_state's config)."""
    if trainer.cfg.base:
        return trainer.cfg.base
    saved = (trainer.train_state or {}).get("config", {}).get("model", {}).get("base", "")
    if not saved:
        raise ConfigError("DPO of a full model needs its reference: --base (a frozen copy of it), or "
                          "--dpo-precompute-ref")
    return saved


def reference_of_run(trainer):
    """The reference a training run uses (see the module docstring)."""
    cfg, dims = trainer.cfg, trainer.dims
    fused = cfg.fused_linear_cross_entropy
    if trainer.lora:
        live = LiveReference(trainer.chunks, dims, "the base without the adapters",
                             lambda: adapters_disabled(trainer.chunks), fused)
    elif cfg.dpo_precompute_ref:
        live = LiveReference(trainer.chunks, dims, "the model before its first step", fused=fused)
    else:
        base = _base_of(trainer)
        live = LiveReference(frozen_model(base, dims, cfg), dims, f"a frozen copy of {base}", fused=fused)
    if not cfg.dpo_precompute_ref:
        return live
    rows = len(trainer.train_ds) + (len(trainer.eval_ds) if trainer.eval_ds is not None else 0)
    saved = Path(trainer.resume_dir) / TABLE_FILE if trainer.resume_dir is not None else None
    if saved is not None and saved.is_file():
        from safetensors.torch import load_file

        table = load_file(str(saved))["logps"].to(trainer.device)
        if table.shape != (rows, 2):
            raise ConfigError(f"{saved} holds {table.shape[0]} pairs' reference log-probabilities, the data "
                              f"{rows}")
        return PrecomputedReference(table, f"read from {saved.parent.name}")
    if saved is not None and not trainer.lora:
        raise ConfigError(f"--dpo-precompute-ref: the checkpoint to resume, {trainer.resume_dir}, has no {TABLE_FILE}, "
                          f"and a fully fine-tuned model is no longer its reference; resume without "
                          f"--dpo-precompute-ref (a frozen copy of --base)")
    table = precompute(live, [trainer.train_ds, trainer.eval_ds],
                       lambda b: trainer._to_device(trainer._local(b)), cfg.micro_batch_size)
    return PrecomputedReference(table, live.what)
