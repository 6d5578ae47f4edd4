"""`tpzoo plan --lora-rank R` on a mixture of experts, with and without `--lora-experts`, against what tpzoo builds
and allocates:
- the training state of a rank (frozen base + the adapters' optimizer: ExpertParallelAdamW, the experts' adapters
  over edp) at (tp, ep) = (1, 1), (2, 1), (1, 2), (2, 2) equals the buffers of the real optimizer for that emulated
  rank, its E / ep experts' adapters;
- the activations of a LoRA chunk at ep = 1 (each dispatched row keeps its expert adapters' u) equal what a
  forward saves;
- the FLOPs: the experts' adapters add 2 per element of one expert's adapters per dispatched row;
- the headline: Qwen3-30B-A3B's LoRA with expert adapters plans on 8 GPUs, each ep rank holding its experts'
  adapters only (less adapter state at ep 8 than at ep 1);
- Qwen3-Next (all-linear refused by its regrouped projections) plans with the projections a run can name;
- bad input is one line: --lora-experts without --lora-rank, on a dense model."""
import pytest
import torch

from tpzoo import kernels as K
from tpzoo.errors import ConfigError
from tpzoo.models import ModelLayout, Stage, Transformer, get_config
from tpzoo.models.lora import LoRAConfig, add_lora
from tpzoo.plan import ClusterSpec, Layout, RankLayout, TrainingSpec, search, stage_memory
from tpzoo.plan.estimate import stage_flops
from tpzoo.plan.lora import lora_layer_flops
from tpzoo.plan.measure import forward_activation_bytes
from tpzoo.plan.memory import chunk_activation_bytes
from tpzoo.train.expert_optim import ExpertParallelAdamW
from tpzoo.train.optim import DistributedAdamW

from test_plan_experts import MIDDLE, QWEN
from test_plan_memory import build_stage, unique_params

RANK = 4


@pytest.mark.parametrize("experts", [False, True])
def test_lora_state_on_moe_is_what_the_optimizer_allocates(experts):
    training = TrainingSpec(seq_len=16, global_batch_size=8, dtype="bf16", zero=1, lora_rank=RANK,
                            lora_experts=experts)
    for tp, dp, ep in [(1, 2, 1), (2, 2, 1), (1, 2, 2), (2, 4, 2)]:
        chunks = build_stage(QWEN, tp, tp - 1, 1, 0, device="cpu", dtype=torch.bfloat16, dp=dp, ep=ep, sp=True)
        add_lora(chunks, LoRAConfig(RANK, 8.0, experts=experts))
        params = unique_params(chunks)
        trained = [p for p in params if p.requires_grad]
        assert any(getattr(p, "expert_parallel", False) for p in trained) == experts
        kw = dict(model_dtype=torch.bfloat16, zero=1)
        parts = (ExpertParallelAdamW(trained, chunks[0].dims, **kw).parts if ep > 1 and experts else  # (trainer's)
                 (DistributedAdamW(trained, chunks[0].dims, **kw),))
        got = {k: sum(o.buffer_bytes()[k] for o in parts) for k in ("params", "grads", "master", "optimizer")}
        frozen = sum(p.numel() * p.element_size() for p in params if not p.requires_grad)
        est = stage_memory(QWEN, Layout(tp=tp, dp=dp, ep=ep, sequence_parallel=True), training, 0)
        assert (est.params, est.grads, est.master, est.optimizer) == (
            frozen + got["params"], got["grads"], got["master"], got["optimizer"]), (tp, dp, ep, experts)


def test_lora_activations_with_expert_adapters_ep1():
    cfg = QWEN.replace(output_router_logits=False)
    for experts in (False, True):
        torch.manual_seed(0)
        model = Transformer(cfg, ModelLayout(dtype=torch.bfloat16), MIDDLE)
        add_lora([model], LoRAConfig(RANK, 8.0, experts=experts))
        for p in model.parameters():
            if p.requires_grad:
                torch.nn.init.normal_(p, std=0.02)
        with K.use_backend("torch"):
            got = forward_activation_bytes(model, 2, 16)
        est = sum(chunk_activation_bytes(cfg, RankLayout(kernels="reference"), range(cfg.num_layers), 2, 16, False,
                                         False, lora_rank=RANK, lora_experts=experts).values())
        assert abs(est / got - 1) <= 0.02, (experts, est, got)


def test_lora_flops_with_expert_adapters():
    """What the experts' adapters add per token: k rows of one expert's r (2h + 3f/tp) elements, 2 FLOPs each."""
    k, h, f = QWEN.num_experts_per_tok, QWEN.hidden_size, QWEN.expert_ffn
    for tp, ep in [(1, 1), (2, 1), (2, 2)]:
        moe = [i for i in range(QWEN.num_layers) if QWEN.is_moe_layer(i)]
        added = sum(lora_layer_flops(QWEN, i, tp, RANK, 10, ep, True) - lora_layer_flops(QWEN, i, tp, RANK, 10, ep)
                    for i in range(QWEN.num_layers))
        assert added == len(moe) * 2 * 10 * k * RANK * (2 * h + 3 * f // tp), (tp, ep)
    lay = Layout(tp=2, dp=2, ep=2, micro_batch_size=1)
    plain, with_experts = (stage_flops(QWEN, lay, TrainingSpec(seq_len=16, global_batch_size=4, lora_rank=RANK,
                                                                 lora_experts=x), 0) for x in (False, True))
    assert with_experts["wgrad"] > plain["wgrad"] and with_experts["forward"] > plain["forward"]


def test_qwen3_30b_a3b_lora_with_expert_adapters_plans_on_8_gpus():
    """Its 128 experts' rank-16 adapters are ~0.6 B elements (2% of the base): at ep 1 their training state (16
    B/element) take 10 GB a GPU (beside the 58 GiB base), at ep 8 each rank holds its 16 experts' adapters only."""
    cfg, cluster = get_config("qwen3-30b-a3b"), ClusterSpec(gpus=8, gpu_memory_gib=80)
    training = TrainingSpec(seq_len=4096, global_batch_size=64, lora_rank=16, lora_experts=True)
    fitting = [e for e in search(cfg, cluster, training, tp=1, pp=1, recompute="full") if e.fits]
    assert {1, 2, 4, 8} <= {e.layout.ep for e in fitting}
    state = {}
    for ep in (1, 8):
        mem = stage_memory(cfg, Layout(tp=1, dp=8, ep=ep, micro_batch_size=1, recompute="full"), training, 0)
        state[ep] = mem.grads + mem.master + mem.optimizer
    assert 6 < state[1] / state[8] < 8, state  # (the attention's adapters on every rank)


def test_a_model_refusing_all_linear_plans_what_a_run_names():
    """Qwen3-Next's regrouped in_proj_qkvz / in_proj_ba take no adapters (a run names the other projections): the
    plan adapts the others rather than refusing."""
    cfg = get_config("nano-qwen3-next")
    ests = search(cfg, ClusterSpec(gpus=2), TrainingSpec(seq_len=16, global_batch_size=8, lora_rank=4,
                                                         lora_experts=True), max_micro_batch=1)
    assert ests and ests[0].memory.optimizer > 0


def test_bad_input_is_one_line(capsys):
    from tpzoo.cli import main

    with pytest.raises(ValueError, match="--lora-experts adapts the routed experts in a LoRA run"):
        TrainingSpec(seq_len=16, global_batch_size=8, lora_experts=True)
    with pytest.raises(ConfigError, match="has no routed experts"):
        search(get_config("tiny-llama"), ClusterSpec(gpus=2), TrainingSpec(seq_len=16, global_batch_size=8,
                                                                           lora_rank=4, lora_experts=True))
    for args, needle in ((["--lora-experts"], "give --lora-rank R"),
                         (["--lora-rank", "4", "--lora-experts", "--model", "tiny-llama"], "has no routed experts")):
        rc = main(["plan", "--model", "nano-mixtral", "--gpus", "2", "--gpu-memory", "80", "--seq-len", "16",
                   "--global-batch-size", "8", *args])
        err = capsys.readouterr().err.strip().splitlines()
        assert rc != 0 and len(err) == 1 and needle in err[0], err
