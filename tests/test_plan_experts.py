"""The plan advisor on mixtures of experts (docs/plan.md "Mixtures of experts"), against what tpzoo really builds,
allocates, saves and sends:
- parameters per rank (total, experts split over tp x ep, router, Qwen3-MoE's dense layers) equal the real model's at
  every (tp, ep, pp) stage and rank (meta models);
- the training state equals ExpertParallelAdamW's buffers (experts over edp, the rest over dp x cp) for emulated
  ranks, and a real step at dp = ep = 2 (ZeRO 0 and 1) on 2 gloo ranks;
- activations: exact at ep = 1; at ep = 2 the two ranks' sum is exactly twice the estimate (the ep group computes
  exactly T*k rows per rank on average), each rank within ACT_TOL of it (routing makes its received rows vary);
- the all-to-all calls and bytes of a forward + backward at ep = 2 equal count_collectives' (payloads summed over
  the ep group: what one rank's experts receive is what its peers send);
- the search proposes ep > 1 for Mixtral 8x7B on 16 GPUs, what it proposes fits, and ep is searched only for MoE.
"""
import pytest
import torch

import tpzoo
from tpzoo.errors import ConfigError
from tpzoo.models import Inputs, ModelLayout, Stage, Transformer, apply_recompute, get_config
from tpzoo.parallel import count_collectives
from tpzoo.plan import ClusterSpec, Layout, RankLayout, TrainingSpec, estimate, search, stage_params
from tpzoo.plan.estimate import GIB
from tpzoo.plan.measure import forward_activation_bytes
from tpzoo.plan.memory import chunk_activation_bytes, expert_state_bytes, late_params
from tpzoo.plan.volume import layer_volume, tp_step_volume
from tpzoo.testing import run_on_ranks
from tpzoo.train.expert_optim import ExpertParallelAdamW
from tpzoo.train.optim import DistributedAdamW

from test_plan_memory import build_stage, unique_params

MIXTRAL = get_config("nano-mixtral")
# Qwen3-MoE's switches: a dense layer among MoE ones, experts narrower than the dense FFN, no top-k renormalization
QWEN = MIXTRAL.replace(family="qwen3_moe", name="tiny-qwen3-moe", num_layers=3, num_experts=8, num_experts_per_tok=2,
                       moe_ffn_hidden_size=16, mlp_only_layers=[0], norm_topk_prob=False)
MIDDLE = Stage(pre_process=False, post_process=False)  # a chunk without the embedding and the head
# Per rank at ep > 1 the expert rows are what this rank received: T*k only on average. At these shapes a rank's
# experts may receive up to about half as many rows again (k = 2 of 4 experts, 32 tokens); the rows are ~55% of a
# layer's bytes, so a rank is within 30% of the estimate, and the ep group's sum is exact.
ACT_TOL = 0.3


@pytest.mark.parametrize("cfg", [MIXTRAL, QWEN, "qwen3-30b-a3b", "mixtral-8x7b"],
                         ids=lambda c: c if isinstance(c, str) else c.name)
def test_expert_parameters_exact(cfg):
    cfg = get_config(cfg) if isinstance(cfg, str) else cfg
    for tp, ep, pp in [(1, 1, 1), (2, 1, 1), (1, 2, 1), (2, 2, 2), (1, 4, 2)]:
        for stage in range(pp):
            count = stage_params(cfg, Layout(tp=tp, pp=pp, ep=ep), stage)
            for rank in {0, tp - 1}:
                params = unique_params(build_stage(cfg, tp, rank, pp, stage, sp=True, dp=ep, ep=ep))
                what = f"{cfg.name} tp={tp}/{rank} ep={ep} pp={pp}/{stage}"
                assert count.numel == sum(p.numel() for p in params), what
                assert count.tensors == len(params), what
                assert count.sequence_parallel == sum(p.numel() for p in params if p.sequence_parallel), what
                assert count.expert == sum(p.numel() for p in params if getattr(p, "expert_parallel", False)), what
    # FLOPs follow the active parameters: the matmuls a token goes through are a dense model's with k experts'
    # FFN, plus the router
    if not cfg.mlp_only_layers:
        k, h, L = cfg.num_experts_per_tok, cfg.hidden_size, cfg.num_layers
        dense = cfg.replace(num_experts=0, num_experts_per_tok=0, moe_ffn_hidden_size=None,
                            ffn_hidden_size=k * cfg.expert_ffn)
        assert stage_params(cfg, Layout(), 0).matmul == stage_params(dense, Layout(), 0).matmul + L * cfg.num_experts * h


@pytest.mark.parametrize("zero", [0, 1, 2])
@pytest.mark.parametrize("dtype", ["bf16", "fp32"])
def test_state_bytes_match_expert_parallel_adamw(dtype, zero):
    """ExpertParallelAdamW built for emulated ranks (no process group needed to construct it)."""
    torch_dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[dtype]
    training = TrainingSpec(seq_len=16, global_batch_size=8, dtype=dtype, zero=zero)
    for cfg in (MIXTRAL, QWEN):
        for tp, pp, stage, dp, ep in [(1, 1, 0, 2, 2), (2, 1, 0, 4, 2), (1, 2, 1, 4, 4), (2, 1, 0, 2, 1)]:
            chunks = build_stage(cfg, tp, tp - 1, pp, stage, device="cpu", dtype=torch.float32, dp=dp, ep=ep, sp=True)
            params = unique_params(chunks)
            kw = dict(model_dtype=torch_dtype, zero=zero)
            parts = (ExpertParallelAdamW(params, chunks[0].dims, **kw).parts if ep > 1 else
                     (DistributedAdamW(params, chunks[0].dims, **kw),))
            got = [sum(o.buffer_bytes()[k] for o in parts) for k in ("params", "grads", "master", "optimizer")]
            count = stage_params(cfg, Layout(tp=tp, pp=pp, ep=ep), stage)
            est = expert_state_bytes(count, training, dp, ep, late_params(count, tp, True))
            assert [est.params, est.grads, est.master, est.optimizer] == got, (cfg.name, tp, pp, dp, ep)


def test_activation_bytes_ep1_exact():
    for cfg in (MIXTRAL, QWEN.replace(output_router_logits=False)):
        moe = sum(map(cfg.is_moe_layer, range(cfg.num_layers)))
        for mode in ("none", "selective", "full"):
            torch.manual_seed(0)
            model = apply_recompute(Transformer(cfg, ModelLayout(dtype=torch.bfloat16), MIDDLE), mode)
            got = forward_activation_bytes(model, 2, 16)
            est = sum(chunk_activation_bytes(cfg, RankLayout(recompute=mode, kernels="reference"),
                                             range(cfg.num_layers), 2, 16, False, False).values())
            assert est == got, (cfg.name, mode, est, got)


def _real_step_at_ep2(zeros):
    """dp = ep = 2: activations of a middle chunk, then per ZeRO level one training step (forward + backward with
    the collectives counted, reduce, AdamW step) and the optimizer's buffers."""
    dims = tpzoo.init_parallel(tp=1, dp=2, ep=2)
    try:
        torch.manual_seed(0)
        middle = Transformer(MIXTRAL, ModelLayout(dims, dtype=torch.bfloat16), MIDDLE)
        acts = forward_activation_bytes(middle, 2, 16, seed=1 + dims.dp_rank)  # different tokens per rank
        out = {"acts": acts, "state": {}}
        g = torch.Generator().manual_seed(7 + dims.dp_rank)
        ids = torch.randint(0, MIXTRAL.vocab_size, (2, 16), generator=g).to(dims.device)
        for zero in zeros:
            torch.manual_seed(0)
            model = Transformer(MIXTRAL, dims)
            opt = ExpertParallelAdamW(list(model.parameters()), dims, model_dtype=torch.bfloat16, zero=zero)
            opt.zero_grad()
            with count_collectives() as counted:
                model(Inputs(ids, labels=ids)).sum().backward()
            opt.reduce_grads()
            opt.step(lr=1e-3)
            out["state"][zero] = [sum(o.buffer_bytes()[k] for o in opt.parts)
                                  for k in ("params", "grads", "master", "optimizer")]
            out["a2a"] = {kind: (counted.get(kind, "ep").calls, counted.get(kind, "ep").payload_bytes)
                          for kind in ("all_to_all", "all_to_all_v")}
        return out
    finally:
        tpzoo.destroy_parallel()


def test_real_step_at_ep2_state_activations_and_all_to_all():
    ranks = run_on_ranks(2, _real_step_at_ep2, (0, 1))
    count = stage_params(MIXTRAL, Layout(ep=2), 0)
    for zero in (0, 1):
        est = expert_state_bytes(count, TrainingSpec(seq_len=16, global_batch_size=4, zero=zero), 2, 2)
        for r in ranks:
            assert r["state"][zero] == [est.params, est.grads, est.master, est.optimizer], zero
    est = sum(chunk_activation_bytes(MIXTRAL, RankLayout(ep=2, kernels="reference"), range(MIXTRAL.num_layers),
                                     2, 16, False, False).values())
    assert sum(r["acts"] for r in ranks) == 2 * est, ([r["acts"] for r in ranks], est)
    assert all(abs(r["acts"] / est - 1) <= ACT_TOL for r in ranks)
    # forward + backward of one micro-batch of 2 x 16 tokens through 2 MoE layers, in bf16 (the optimizer's
    # flat buffer holds the weights in the model dtype)
    vol = layer_volume(MIXTRAL, 0, Layout(dp=2, ep=2, micro_batch_size=2), 16, 2).table
    for kind in ("all_to_all", "all_to_all_v"):
        want = vol[(kind, "ep")]
        assert all(r["a2a"][kind][0] == MIXTRAL.num_layers * want.calls for r in ranks), kind
        assert sum(r["a2a"][kind][1] for r in ranks) == 2 * MIXTRAL.num_layers * want.payload_bytes, kind


@pytest.mark.parametrize("sp", [False, True], ids=["no-sp", "sp"])
def test_tp_collectives_of_an_moe_step_equal_count_collectives(sp):
    """At tp = 2 an MoE layer adds the top-k weights' (and under SP the indices') entry into the TP region, and
    under SP the router loss's all-reduce of the statistics."""
    from test_plan_parallel import B, S, _step_collectives

    for mode in ("none", "full"):
        got = run_on_ranks(2, _step_collectives, MIXTRAL, sp, mode, 2)
        layout = Layout(tp=2, micro_batch_size=B, recompute=mode, sequence_parallel=sp)
        est = tp_step_volume(MIXTRAL, layout, 0, 2, S, act_bytes=4, grad_bytes=4).summary()
        assert est == {k: v for k, v in got[0].items() if k.endswith("@tp")}, (mode, est, got[0])


def test_search_proposes_expert_parallelism_that_fits():
    cfg = get_config("mixtral-8x7b")
    cluster = ClusterSpec(gpus=16, gpu_memory_gib=80)
    training = TrainingSpec(seq_len=4096, global_batch_size=256)
    ests = search(cfg, cluster, training, max_micro_batch=1, recompute="full", pp=2)
    fitting = [e for e in ests if e.fits]
    assert fitting and any(e.layout.ep > 1 for e in fitting[:5])
    best = fitting[0]
    assert best.memory.total <= 80 * GIB and best.time.ep_comm > 0
    # what it proposes: expert weights over tp * ep, their state over dp / ep; bigger ep, less memory
    lay = best.layout
    one = estimate(cfg, Layout(**{**lay.to_dict(), "ep": 1}), cluster, training)
    assert best.memory.params < one.memory.params and one.time.ep_comm == 0
    assert {e.layout.ep for e in ests} == {1, 2, 4, 8}  # the divisors of 8 experts dividing dp
    dense = search(get_config("tiny-llama"), ClusterSpec(gpus=4), TrainingSpec(seq_len=64, global_batch_size=8),
                   max_micro_batch=1)
    assert {e.layout.ep for e in dense} == {1}


def test_bad_input_is_one_line(capsys):
    from tpzoo.cli import main

    cfg, cluster, training = MIXTRAL, ClusterSpec(gpus=4), TrainingSpec(seq_len=16, global_batch_size=8)
    with pytest.raises(ConfigError, match="--ep 3: does not divide num_experts=4"):
        search(cfg, cluster, training, ep=3)
    with pytest.raises(ConfigError, match="no experts"):
        search(get_config("tiny-llama"), cluster, training, ep=2)
    # (LoRA on a mixture of experts is planned: tests/test_plan_lora_experts.py)
    rc = main(["plan", "--model", "nano-mixtral", "--gpus", "4", "--gpu-memory", "80", "--seq-len", "16",
               "--global-batch-size", "8", "--ep", "3"])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc != 0 and len(err) == 1 and "does not divide num_experts=4" in err[0]
