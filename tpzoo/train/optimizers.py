"""The run's optimizer (`--optimizer adamw|muon`): one DistributedAdamW or DistributedMuon over this rank's trained
parameters, or with expert parallelism one for the expert weights and one for the rest (ExpertParallelAdamW)."""
from __future__ import annotations

import functools

import torch

from . import diloco
from .expert_optim import ExpertParallelAdamW, is_expert
from .muon import DistributedMuon
from .muon_matrices import place
from .optim import DistributedAdamW


def build_optimizer(cfg, dims, chunks, trainable: list, model_dtype):
    """All parameters, or a LoRA run's adapters (`trainable`), of this rank's model chunks."""
    kw = dict(model_dtype=model_dtype, zero=cfg.zero_level, overlap=cfg.overlap_grad_reduce,
              bucket_elems=cfg.grad_bucket_elems, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps,
              weight_decay=cfg.weight_decay, modules=chunks, keep_gathered=cfg.zero3_gather_per_step,
              grad_accumulation_fusion=cfg.grad_accumulation_fusion, **diloco.optimizer_groups(cfg, dims))
    inner = DistributedAdamW
    if cfg.optimizer == "muon":
        inner = functools.partial(DistributedMuon, matrices=place(chunks), momentum=cfg.muon_momentum,
                                  ns_steps=cfg.muon_ns_steps,
                                  ns_dtype={"bf16": torch.bfloat16, "fp32": torch.float32}[cfg.muon_ns_dtype])
    if dims.ep > 1 and any(is_expert(p) for p in trainable):  # expert weights reduce over their own group
        return ExpertParallelAdamW(trainable, dims, inner=inner, **kw)
    kw.pop("expert_group", None)
    return inner(trainable, dims, **kw)


def check(cfg, model_cfg, what: str) -> None:
    """--optimizer muon and --qk-clip against the model before any rank starts (the ranks would raise the same):
    every trained matrix has a place, and there are attention logits to clip whose projections set them."""
    if cfg.optimizer != "muon":
        return
    from tpzoo.errors import ConfigError
    from tpzoo.models import ModelLayout, Transformer
    from tpzoo.parallel import ParallelDims

    from .qk_clip import MaxLogits

    model = Transformer(model_cfg, ModelLayout(ParallelDims.for_rank(), device="meta"))
    place([model])
    if cfg.qk_clip > 0:
        if not any(callable(getattr(m, "qk_clip_scales", None)) for m in model.modules()):
            raise ConfigError(f"--qk-clip {cfg.qk_clip:g}: {what} has no attention layer MuonClip can clip")
        MaxLogits([model], ParallelDims.for_rank(), cfg.qk_clip).close()  # refuses q/k norms
