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
models/recompute.py is_recomputing) and updates it in `after_optimizer_step()`, which the trainer calls on every
module of every chunk that has one after each optimizer step (Transformer.after_optimizer_step).
"""
from __future__ import annotations

import torch

from .config import ModelConfig


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
    from .kinds import channel_mixer_kind, token_mixer_kind

    rules = {}
    for i in range(cfg.num_layers):
        for kind in (token_mixer_kind(cfg.token_mixer(i)), channel_mixer_kind(cfg.channel_mixer(i))):
            for rule in getattr(kind, "aux_rules", ()):
                rules[rule.key] = rule
    return rules


def carried_sizes(cfg: ModelConfig, loss) -> dict[str, int]:
    """{key: vector size} of what a labelled forward with `loss` carries between pipeline stages."""
    return {key: rule.size(cfg) for key, rule in sorted(model_rules(cfg).items()) if rule.carried(cfg, loss)}
