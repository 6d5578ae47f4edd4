"""Post-training's frozen models in the plan (tpzoo.post): DPO's frozen reference copy of a fully fine-tuned model
(none with LoRA, whose reference is the base without its adapters, nor with --dpo-precompute-ref), a live
distillation teacher (none with a `tpzoo distill-cache` directory). Each is held at the trained model's layout
in the run's dtype, split over pipeline stages by its own layers (tpzoo.post.reference.frozen_model loads it with
one chunk per rank): its weights add to the stage's parameters. Its forward-only pass runs before the trained
model's, so its activations are gone before the step's peak; distillation's student computes its logits unfused
(plan it with fused_linear_cross_entropy off)."""
from __future__ import annotations

import dataclasses

from .spec import Layout, TrainingSpec


def frozen_stage_bytes(training: TrainingSpec, layout: Layout, stage: int) -> int:
    """Bytes of the frozen models' weights on one GPU of pipeline stage `stage`."""
    from .memory import stage_params  # (memory.py reads this module inside stage_memory)

    if not training.frozen:
        return 0
    own = dataclasses.replace(layout, virtual_stages=1, boundaries=None)
    return sum(training.act_bytes * stage_params(cfg, own, stage, training.vocab_padding_multiple).numel
               for cfg in training.frozen)


def frozen_text(training: TrainingSpec) -> str:
    """', frozen beside it: NAME (N B params, dtype)' for the plan's header, '' without."""
    if not training.frozen:
        return ""
    names = ", ".join(f"{cfg.name or cfg.family} ({cfg.num_parameters() / 1e9:.2f} B params)"
                      for cfg in training.frozen)
    return f", frozen beside it in {training.dtype}: {names}"
