"""tpzoo plan --optimizer muon: Muon's optimizer memory as DistributedMuon allocates it (one fp32 momentum for its
matrices, AdamW's two moments for the rest), and the orthogonalization in the step time, spread over tp x dp owners
under ZeRO. The matrices come from the trainer's own placement (tpzoo.train.muon_matrices) on meta layers."""
import torch

from tpzoo.models import get_config
from tpzoo.plan import ClusterSpec, Layout, TrainingSpec, estimate
from tpzoo.plan.memory import stage_memory
from tpzoo.train.expert_optim import ExpertParallelAdamW
from tpzoo.train.muon import DistributedMuon
from tpzoo.train.muon_matrices import place

from test_muon import MODELS
from test_plan_memory import build_stage, unique_params


def test_muon_optimizer_state_matches_distributed_muon():
    """ZeRO 0: what Muon saves over AdamW in the plan (4 bytes per Muon element of this rank's stage) is exactly
    what DistributedMuon saves over DistributedAdamW; tp, pp, and ep 2 with MLA and experts."""
    import functools

    from tpzoo.train.optim import DistributedAdamW

    plan = {o: TrainingSpec(seq_len=16, global_batch_size=8, dtype="fp32", optimizer=o) for o in ("adamw", "muon")}
    for cfg in (get_config("nano-llama"), MODELS["mla"], MODELS["gdn"]):
        for tp, rank, pp, stage, ep in [(1, 0, 1, 0, 1), (2, 1, 1, 0, 1), (1, 0, 2, 1, 1), (2, 0, 2, 1, 2)]:
            if ep > 1 and not cfg.moe.num_experts:
                continue
            chunks = build_stage(cfg, tp, rank, pp, stage, device="cpu", dtype=torch.float32, dp=ep, ep=ep)
            params = unique_params(chunks)
            experts = ep > 1 and any(getattr(p, "expert_parallel", False) for p in params)  # as the trainer
            real = {}
            for name, inner in (("adamw", DistributedAdamW),
                                ("muon", functools.partial(DistributedMuon, matrices=place(chunks)))):
                opt = (ExpertParallelAdamW(params, chunks[0].dims, inner=inner) if experts
                       else inner(params, chunks[0].dims))
                real[name] = opt.buffer_bytes()["optimizer"]
            layout = Layout(tp=tp, pp=pp, dp=ep, ep=ep)
            est = {o: stage_memory(cfg, layout, plan[o], stage).optimizer for o in plan}
            what = (cfg.family, tp, rank, pp, stage, ep)
            assert est["adamw"] - est["muon"] == real["adamw"] - real["muon"] > 0, what


def test_muon_step_time_counts_the_orthogonalization_spread_over_owners():
    cfg, cluster = get_config("llama-3.2-1b"), ClusterSpec(gpus=8)
    spec = dict(seq_len=4096, global_batch_size=64)
    layout = Layout(tp=2, dp=4, micro_batch_size=1)
    adamw = estimate(cfg, layout, cluster, TrainingSpec(**spec, zero=1))
    replicated = estimate(cfg, layout, cluster, TrainingSpec(**spec, optimizer="muon"))
    spread = estimate(cfg, layout, cluster, TrainingSpec(**spec, optimizer="muon", zero=1))
    assert adamw.time.muon == 0 and "muon" not in adamw.to_dict()["time_s"]
    assert 0 < spread.time.muon < replicated.time.muon  # ZeRO deals the matrices over the dp ranks too
    assert spread.time.total == adamw.time.total + spread.time.muon
    assert spread.memory.optimizer < adamw.memory.optimizer
