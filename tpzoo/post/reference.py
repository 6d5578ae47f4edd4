"""Frozen models beside the trained one: DPO's reference, a distillation teacher.

- LoRA: the reference is the trained model itself with its adapters switched off (`adapters_disabled`: no second
  copy of the base, one extra forward without the adapters).
- A full fine-tune: a frozen copy of --base loaded at the run's layout (`frozen_model`: every rank reads only its
  tp / pp slices, whatever layout the checkpoint was saved at), or nothing at all with --dpo-precompute-ref (the
  reference log-probabilities of every pair computed once, before the first step, by the model itself, which is
  the base then).
- A teacher: `frozen_model` of its checkpoint or Hugging Face directory, at the student's layout.
A frozen model is in the run's dtype, its parameters never require gradients and no optimizer sees them; its own
pipeline split (balanced by its own layers) ends, like the trained model's, on the last pipeline rank.
"""
from __future__ import annotations

import contextlib

from tpzoo.pipeline import as_chunks


@contextlib.contextmanager
def adapters_disabled(chunks):
    """Inside: every LoRA layer of `chunks` computes its frozen base alone (its adapter detached, then put back),
    as PEFT's disable_adapter() does."""
    layers = [m for c in chunks for m in c.modules() if getattr(m, "lora", None) is not None]
    adapters = [m.lora for m in layers]
    try:
        for m in layers:
            m.lora = None
        yield
    finally:
        for m, adapter in zip(layers, adapters):
            m.lora = adapter


def frozen_model(path, dims, cfg) -> list:
    """This rank's chunks of the model at `path` (a tpzoo checkpoint at any layout, LoRA or not, or a Hugging Face
    directory) at the run's layout (`cfg`: sequence parallelism, cp mode, dtype, FP8), frozen, in eval mode."""
    from tpzoo.checkpoint import load_model, parse_dtype
    from tpzoo.models import ModelLayout
    from tpzoo.parallel.fp8 import enable_fp8

    layout = ModelLayout(dims, sequence_parallel=cfg.sequence_parallel, cp_mode=cfg.cp_mode,
                         dtype=parse_dtype(cfg.dtype))
    chunks = as_chunks(load_model(str(path), layout, virtual_stages=1))
    for c in chunks:
        c.requires_grad_(False)
        c.eval()
    enable_fp8(chunks, getattr(cfg, "fp8", "none"))  # a frozen weight is cast once for the run
    return chunks
