"""The plan advisor against tpzoo on several gloo ranks: activation bytes at tp=2 (with and without sequence
parallelism, every recompute mode), with the torch reference kernels and with the Triton kernels (Triton's
interpreter, in a dedicated pool of rank processes started with TRITON_INTERPRET=1: the flag must be set before
Triton loads in a process, and never in the shared pools or in pytest's own process); and the collective volume
of a training step, call for call and byte for byte, against count_collectives()."""

import pytest
import torch

import tpzoo
from tpzoo.models import Inputs, ModelLayout, Stage, Transformer, apply_recompute, get_config
from tpzoo.models.config import ModelConfig
from tpzoo.parallel import count_collectives, finish_tp_grads
from tpzoo.plan import Layout, RankLayout, chunk_activation_bytes, chunk_layer_ranges, tp_step_volume
from tpzoo.plan.measure import forward_activation_bytes
from tpzoo.testing import RankPool, run_on_ranks

from test_plan_memory import NEW_FAMILIES

GQA = ModelConfig.from_dict(dict(family="qwen2", vocab_size=101, hidden_size=64, num_layers=3, num_heads=8,
                                 num_kv_heads=1, ffn_hidden_size=96, max_position_embeddings=64, qkv_bias=True,
                                 tie_embeddings=True, name="gqa-kv1"))
CONFIGS = [get_config("nano-gpt"), get_config("nano-llama"), GQA]
MODES = ("none", "selective", "full")
B, S, TOL = 2, 16, 0.02


def _measure(tp: int, kernels: str, cases: list) -> list[int]:
    """On every rank: the live bytes of each case (cfg, recompute, sp, pp stage of 2 or None)."""
    from tpzoo import kernels as K

    tpzoo.init_parallel(tp=tp)  # with tp=1 on 2 ranks: dp=2, both ranks measure the same thing
    out = []
    with K.use_backend("triton" if kernels == "fused" else "torch"):
        for cfg, mode, sp, stage in cases:
            layers, pre, post = None, True, True
            if stage is not None:
                layers, pre, post = chunk_layer_ranges(cfg, Layout(pp=2))[stage], stage == 0, stage == 1
            torch.manual_seed(0)
            layout = ModelLayout(sequence_parallel=sp, dtype=torch.bfloat16)
            model = apply_recompute(Transformer(cfg, layout, Stage(layers, pre, post)), mode)
            out.append(forward_activation_bytes(model, B, S))
    return out


def _estimate(tp, kernels, case) -> int:
    cfg, mode, sp, stage = case
    lo, hi = (0, cfg.num_layers) if stage is None else chunk_layer_ranges(cfg, Layout(pp=2))[stage]
    first, last = stage in (None, 0), stage in (None, 1)
    at = RankLayout(tp=tp, sequence_parallel=sp, recompute=mode, kernels=kernels)
    return sum(chunk_activation_bytes(cfg, at, range(lo, hi), B, S, first, last).values())


def _check(results, tp, kernels, cases):
    # Every rank against the estimate (tp ranks hold the same sizes, but gloo's work object can keep a tensor
    # it just reduced, e.g. the loss's [b, s] fp32 maximum, alive a moment longer on one rank).
    for rank, per_rank in enumerate(results):
        for case, got in zip(cases, per_rank):
            est = _estimate(tp, kernels, case)
            assert abs(est / got - 1) <= TOL, (kernels, tp, rank, case[0].name, case[1:], est, got)


def _tp2_cases():
    return [(cfg, mode, sp, None) for cfg in CONFIGS for mode in MODES for sp in (False, True)] + [
        (get_config("nano-llama"), mode, True, stage) for mode in ("none", "full") for stage in (0, 1)]


def test_activation_bytes_tp2_reference_kernels():
    cases = _tp2_cases()
    _check(run_on_ranks(2, _measure, 2, "reference", cases), 2, "reference", cases)


@pytest.fixture(scope="module")
def interpreter_ranks():
    """Two rank processes in which Triton runs interpreted (the flag is inherited at spawn only)."""
    pytest.importorskip("triton")
    pool = RankPool(2, env={"TRITON_INTERPRET": "1"})
    yield pool
    pool.close()


def test_activation_bytes_fused_kernels(interpreter_ranks):
    """What runs on CUDA: the Triton norms, rotary, SwiGLU/GeLU and cross-entropy save less than the torch
    references (no fp32 copies); the estimate's default describes them. The interpreter takes ~0.3 s a kernel
    call, so a representative few: RMSNorm/SwiGLU/RoPE and LayerNorm/GeLU/learned positions at tp=1 (two
    recompute modes), replicated kv heads with SP and a last pipeline stage at tp=2."""
    llama = get_config("nano-llama")
    one = [(llama, "none", False, None), (llama, "full", False, None), (get_config("nano-gpt"), "none", False, None)]
    _check(interpreter_ranks.run(_measure, 1, "fused", one), 1, "fused", one)
    two = [(GQA, "none", True, None), (llama, "selective", True, 1)]
    _check(interpreter_ranks.run(_measure, 2, "fused", two), 2, "fused", two)


def _step_collectives(cfg, sp, mode, micro_batches):
    """One training step on 2 tp ranks: forward + backward of each micro-batch, then finish_tp_grads."""
    tpzoo.init_parallel(tp=2)
    torch.manual_seed(0)
    model = apply_recompute(Transformer(cfg, ModelLayout(sequence_parallel=sp)), mode)
    g = torch.Generator().manual_seed(1)
    with count_collectives() as counter:
        for _ in range(micro_batches):
            ids = torch.randint(0, cfg.vocab_size, (B, S), generator=g)
            model(Inputs(ids, labels=ids.roll(-1, 1))).sum().backward()
        finish_tp_grads(model)
    return {k: {f: v[f] for f in ("calls", "payload_bytes", "sent_bytes")} for k, v in counter.summary().items()}


@pytest.mark.parametrize("sp", [False, True], ids=["no-sp", "sp"])
def test_collective_volume_of_a_step_equals_count_collectives(sp):
    # the new families' activations are modeled approximately (docs/plan.md), their collectives exactly
    for cfg in CONFIGS + NEW_FAMILIES:
        for mode in ("none", "full"):
            got = run_on_ranks(2, _step_collectives, cfg, sp, mode, 2)
            assert got[0] == got[1]
            layout = Layout(tp=2, micro_batch_size=B, recompute=mode, sequence_parallel=sp)
            est = tp_step_volume(cfg, layout, 0, 2, S, act_bytes=4, grad_bytes=4).summary()
            assert est == got[0], (cfg.name, mode, est, got[0])


def _zero1_step(cfg, zero1):
    """A real DistributedAdamW step on 2 data-parallel ranks (bf16 weights): every buffer it holds afterwards."""
    from tpzoo.train.optim import DistributedAdamW

    dims = tpzoo.init_parallel(tp=1)  # 2 ranks: dp=2
    torch.manual_seed(0)
    model = Transformer(cfg, dims)
    opt = DistributedAdamW(list(model.parameters()), dims, model_dtype=torch.bfloat16, zero1=zero1)
    ids = torch.randint(0, cfg.vocab_size, (B, S), generator=torch.Generator().manual_seed(dims.dp_rank))
    opt.zero_grad()
    model(Inputs(ids, labels=ids)).sum().backward()
    opt.reduce_grads()
    opt.global_grad_norm()
    opt.step(lr=1e-3)
    return opt.buffer_bytes()


@pytest.mark.parametrize("zero1", [False, True], ids=["plain", "zero1"])
def test_training_state_of_a_real_dp2_step(zero1):
    from tpzoo.plan import TrainingSpec, stage_params, state_bytes

    for cfg in (get_config("nano-llama"), GQA):
        est = state_bytes(stage_params(cfg, Layout(), 0), TrainingSpec(S, 4, zero1=zero1), dp=2)
        for got in run_on_ranks(2, _zero1_step, cfg, zero1):
            assert got == {"params": est.params, "master": est.master, "optimizer": est.optimizer,
                           "grads": est.grads}, (cfg.name, zero1)
