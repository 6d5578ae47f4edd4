"""`tpzoo plan --lora-rank`: the frozen base, the adapters' training state and the activations of a LoRA model,
against real allocations (DistributedAdamW over the adapters, saved tensors of a forward) at tp 1 and tp 2 + SP;
and the headline: llama-3-70b LoRA at seq 4096 fits on 8 GPUs of 80 GiB, where full fine-tuning fits nowhere."""
import pytest
import torch

import tpzoo
from tpzoo import kernels as K
from tpzoo.models import ModelLayout, Stage, Transformer, apply_recompute, get_config
from tpzoo.models.lora import LoRAConfig, add_lora, init_lora
from tpzoo.plan import ClusterSpec, Layout, RankLayout, TrainingSpec, chunk_activation_bytes, search, stage_memory
from tpzoo.plan.measure import forward_activation_bytes
from tpzoo.testing import run_on_ranks
from tpzoo.train.optim import DistributedAdamW

TOL = 0.02  # as tests/test_plan_memory.py: CPU layer_norm keeps bf16 statistics, 4 bytes per row less
RANK, B, S = 4, 2, 16


def _lora_model(cfg, *, pre=True, post=True, recompute="none", sp=False, dtype=torch.bfloat16):
    model = apply_recompute(Transformer(cfg, ModelLayout(sequence_parallel=sp, dtype=dtype), Stage(None, pre, post)),
                            recompute)
    add_lora([model], LoRAConfig(rank=RANK, alpha=8))
    init_lora([model], 0)
    return model


def test_lora_training_state_is_what_a_run_allocates():
    for name in ("nano-gpt", "nano-llama"):
        cfg = get_config(name)
        for dtype, zero1 in (("bf16", False), ("bf16", True), ("fp32", False)):
            model = _lora_model(cfg, dtype={"bf16": torch.bfloat16, "fp32": torch.float32}[dtype])
            opt = DistributedAdamW([p for p in model.parameters() if p.requires_grad], model.dims,
                                   model_dtype=next(model.parameters()).dtype, zero1=zero1)
            frozen = sum(p.numel() * p.element_size() for p in model.parameters() if not p.requires_grad)
            got = opt.buffer_bytes()
            est = stage_memory(cfg, Layout(), TrainingSpec(seq_len=S, global_batch_size=B, dtype=dtype, zero1=zero1,
                                                           lora_rank=RANK), 0)
            assert (est.params, est.grads, est.master, est.optimizer) == (
                frozen + got["params"], got["grads"], got["master"], got["optimizer"]), (name, dtype, zero1)


STAGES = ((True, True), (False, True), (True, False), (False, False))  # (embedding, head) on the chunk


def _lora_activations(cases) -> None:
    for name in ("nano-gpt", "nano-llama"):
        cfg = get_config(name)
        for mode, (pre, post) in cases:
            with K.use_backend("torch"):
                got = forward_activation_bytes(_lora_model(cfg, pre=pre, post=post, recompute=mode), B, S)
            est = sum(chunk_activation_bytes(cfg, RankLayout(recompute=mode, kernels="reference"),
                                             range(cfg.num_layers), B, S, pre, post, lora_rank=RANK).values())
            assert abs(est / got - 1) <= TOL, (name, mode, pre, post, est, got)


def test_lora_activations_tp1():
    """Each recompute mode on a whole model, each pipeline stage kind without recomputation."""
    _lora_activations([(mode, STAGES[0]) for mode in ("none", "selective", "full")]
                      + [("none", stage) for stage in STAGES[1:]])


@pytest.mark.slow
def test_lora_activations_tp1_every_mode_at_every_stage():
    _lora_activations([(mode, stage) for mode in ("selective", "full") for stage in STAGES[1:]])


def _measure_tp2(name: str) -> list:
    tpzoo.init_parallel(tp=2)
    try:
        cfg, out = get_config(name), []
        with K.use_backend("torch"):
            for pre, post in ((True, True), (False, False)):
                out.append(forward_activation_bytes(_lora_model(cfg, pre=pre, post=post, sp=True), B, S))
        return out
    finally:
        tpzoo.destroy_parallel()


def test_lora_activations_tp2_sequence_parallel():
    for name in ("nano-gpt", "nano-llama"):
        cfg = get_config(name)
        for got, (pre, post) in zip(run_on_ranks(2, _measure_tp2, name)[0], ((True, True), (False, False))):
            est = sum(chunk_activation_bytes(cfg, RankLayout(tp=2, sequence_parallel=True, kernels="reference"),
                                             range(cfg.num_layers), B, S, pre, post, lora_rank=RANK).values())
            assert abs(est / got - 1) <= TOL, (name, pre, post, est, got)


def test_llama3_70b_lora_fits_on_8_gpus_where_full_fine_tuning_does_not():
    cfg, cluster = get_config("llama-3-70b"), ClusterSpec(gpus=8, gpu_memory_gib=80)
    fitting = {}
    for lora in (16, 0):
        training = TrainingSpec(seq_len=4096, global_batch_size=64, zero1=True, lora_rank=lora)
        fitting[lora] = [e for e in search(cfg, cluster, training, tp=8) if e.fits]
    assert fitting[16] and not fitting[0]
    best = fitting[16][0].memory
    assert best.grads + best.master + best.optimizer < 0.1 * best.params  # the adapters' state: small
