"""Auxiliary outputs of layer kinds: what a layer produces beside its activation (a router's statistics today).

A layer records its outputs of a forward in the Context (`ctx.record(layer, key, value)`, overwritten by a
recomputation). An AuxRule, which the kind declares (`aux_rules` on its class), says what becomes of them:

  - `combine(cfg, records, device)`: this chunk's layers' records -> one fp32 vector of `size(cfg)`, additive over
    chunks (the sum of the chunk's layers: a stage without such layers gives zeros);
  - `carried(cfg, loss)`: whether a labelled forward with these LossOptions needs the whole model's total (a
    pipeline then carries the partial sums from stage to stage beside the activation, an opaque dict
    {key: vector} to it: tpzoo/pipeline/p2p.py);
  - `trains(cfg)`: whether the total enters the training loss (then a stage split without the carried sums is
    refused: the loss couples every layer of the model);
  - `reduce(cfg, layout, total)`: on the last stage, the total -> (the loss term added to every trained token's
    loss, or None; a dict of detached values reported in Transformer.aux_reports, named in `reports`, which
    evaluation averages beside the loss).

State a kind updates from statistics gathered over a whole optimizer step (a selection bias set from the expert
loads of the step) does not travel: the module accumulates it itself in its forward (skipping recomputation:
models/recompute.py is_recomputing) and updates it after each optimizer step (`after_optimizer_step(chunks)`,
which the trainer calls once per step with all of this rank's chunks), in one of two ways:

  - step sums, summed over every rank of the job: the kind class says how many fp32 values layer i contributes
    (`step_sums_size(cfg, i)`, static, 0: none), its module returns this rank's (`step_sums()`) and receives the
    total (`apply_step_sums(total)`; None after a skipped step: drop what was gathered). Every layer of the model
    has a slot in one vector (a pipeline stage fills its own layers', zeros elsewhere): ONE all-reduce over the
    world per step, whatever the number of layers, stages or kinds;
  - anything else: a module's own `after_optimizer_step()`, called on every module of every chunk (in module
    order, the same on every rank: it may issue its own collectives).
"""
from __future__ import annotations

import torch

from tpzoo.parallel import comm

from .config import ModelConfig
from .registry import layer_kinds


class AuxRule:
    key: str = ""
    reports: tuple = ()

    def size(self, cfg: ModelConfig) -> int:
        raise NotImplementedError

    def combine(self, cfg: ModelConfig, records: list, device) -> torch.Tensor:
        """Default: the records are vectors of size(cfg); their sum."""
        if not records:
            return torch.zeros(self.size(cfg), dtype=torch.float32, device=device)
        return torch.stack(records).sum(0)

    def carried(self, cfg: ModelConfig, loss) -> bool:
        raise NotImplementedError

    def trains(self, cfg: ModelConfig) -> bool:
        raise NotImplementedError

    def reduce(self, cfg: ModelConfig, layout, total: torch.Tensor) -> tuple:
        raise NotImplementedError


def model_rules(cfg: ModelConfig) -> dict[str, AuxRule]:
    """The aux rules of every layer kind of the model (all its layers, not one chunk's): key -> rule."""
    rules = {}
    for i in range(cfg.num_layers):
        for kind in layer_kinds(cfg, i):
            for rule in getattr(kind, "aux_rules", ()):
                rules[rule.key] = rule
    return rules


def carried_sizes(cfg: ModelConfig, loss) -> dict[str, int]:
    """{key: vector size} of what a labelled forward with `loss` carries between pipeline stages."""
    return {key: rule.size(cfg) for key, rule in sorted(model_rules(cfg).items()) if rule.carried(cfg, loss)}


def step_sum_slots(cfg: ModelConfig) -> list[tuple[int, str, int]]:
    """(layer, "attn" | "mlp", size) of every mixer of the model with step sums, in layer order."""
    slots = []
    for i in range(cfg.num_layers):
        for part, kind in zip(("attn", "mlp"), layer_kinds(cfg, i)):
            size = kind.step_sums_size(cfg, i) if hasattr(kind, "step_sums_size") else 0
            if size:
                slots.append((i, part, size))
    return slots


@torch.no_grad()
def after_optimizer_step(chunks, applied: bool = True) -> None:
    """After an optimizer step (`applied`; False: the step was skipped, what was gathered is dropped): the step
    sums of every layer of this rank's chunks, summed over every rank in one all-reduce and handed back, then every
    module's own after_optimizer_step(). Collective over the world when any layer has step sums: every rank calls
    it once per step, with all its chunks."""
    chunks = list(chunks)
    cfg, dims = chunks[0].cfg, chunks[0].dims
    slots = step_sum_slots(cfg)
    if slots:
        mine = {(int(i), part): getattr(layer, part) for chunk in chunks for i, layer in chunk.layers.items()
                for part in ("attn", "mlp")}
        if applied:
            device = next(chunks[0].parameters()).device
            total = torch.zeros(sum(n for _, _, n in slots), dtype=torch.float32, device=device)
            offsets, offset = [], 0
            for i, part, n in slots:
                offsets.append(offset)
                if (i, part) in mine:
                    total[offset:offset + n] = mine[(i, part)].step_sums()
                offset += n
            comm.all_reduce(total, dims.group("world"))
            for (i, part, n), offset in zip(slots, offsets):
                if (i, part) in mine:
                    mine[(i, part)].apply_step_sums(total[offset:offset + n])
        else:
            for module in mine.values():
                if hasattr(module, "apply_step_sums"):
                    module.apply_step_sums(None)
    if applied:
        for chunk in chunks:
            for module in chunk.modules():
                if module is not chunk and hasattr(module, "after_optimizer_step"):
                    module.after_optimizer_step()
