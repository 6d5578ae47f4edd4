"""Mixture-of-experts training against one process: a tiny Mixtral-shaped model (8 experts, top-2, with the
load-balancing loss and a router z-loss in the loss) trains two SGD steps at (tp, ep, dp, pp) = (1, 2, 2, 1),
(2, 2, 2, 1) + SP, (1, 2, 2, 1) with full recomputation (the dispatch runs again inside the backward),
(1, 2, 2, 2) with 1F1B (layer 0 dense, as Qwen3-MoE's mlp_only_layers: stage 0 has no router) and
(1, 2, 2, 2) with zero-bubble and full recomputation (the router statistics travel
with the activations; zero-bubble's B sends their gradient back, W finishes the router weights), and
(tp, cp, ep, dp) = (1, 2, 2, 2) (ring attention; the ep peers are the two cp ranks) on sequences of 7 tokens,
padded to 8 by shard_batch: the router statistics are summed over cp and skip the padding. The loss sum,
every gradient of the first step (tp shards and ep experts gathered to full tensors) and every parameter after
the second step equal the single-process model on the same micro-batches (1e-5 of each tensor's largest entry).

Expert weights are summed over the expert-data-parallel group, everything else over dp x cp (two GradBuffers).
Each micro-batch holds one sequence of 8 tokens (16 top-2 assignments over 8 experts): the test checks that some
expert of some rank receives no token in some micro-batch."""
import torch

import tpzoo
from tpzoo.models import AttentionConfig, Inputs, MLPConfig, ModelConfig, MoEConfig, Transformer
from tpzoo.parallel import GradBuffer, comm, gather_tp_tensor, grad_of, param_spec
from tpzoo.parallel.context_parallel import shard_batch
from tpzoo.pipeline import build_model_chunks, finalize_grads, forward_backward
from tpzoo.testing import run_on_ranks

from test_3d_parity import assert_close, make_optimizer

GLOBAL_BATCH, SEQ, MICRO, STEPS, SEED = 4, 8, 1, 2, 11
CFG = ModelConfig(family="mixtral", vocab_size=64, hidden_size=32, num_layers=2,
                  attention=AttentionConfig(num_heads=4, num_kv_heads=2), mlp=MLPConfig(32),
                  moe=MoEConfig(num_experts=8, num_experts_per_tok=2, norm_topk_prob=True, router_aux_loss_coef=0.05,
                                router_z_loss_coef=0.01, output_router_logits=True))
DENSE_FIRST = CFG.replace(mlp_only_layers=(0,))  # at pp = 2 stage 0 has no MoE layer (passes zeros on)
CP_SEQ = 7  # cp = 2 cuts each sequence into 4 chunks: padded to 8, the padding must not count in the router loss
LAYOUTS = {2: [dict(tp=1, ep=2, dp=2), dict(tp=1, ep=2, dp=2, recompute="full")],
           4: [dict(tp=2, ep=2, dp=2, sp=True), dict(tp=1, ep=2, dp=2, pp=2, cfg="dense_first"),
               dict(tp=1, ep=2, dp=2, pp=2, schedule="zb", recompute="full"),
               dict(tp=1, cp=2, ep=2, dp=2, seq=CP_SEQ)]}


def global_batch(step: int, seq: int = SEQ):
    g = torch.Generator().manual_seed(50 + step)
    ids = torch.randint(0, CFG.vocab_size, (GLOBAL_BATCH, SEQ), generator=g)[:, :seq]
    labels = torch.cat([ids[:, 1:], torch.full((GLOBAL_BATCH, 1), -100)], dim=1)
    labels[torch.rand(labels.shape, generator=g) < 0.15] = -100
    return ids, labels


def reference(cfg, seq: int = SEQ) -> dict:
    """One process, the same micro-batches (the router losses are per forward, so the split matters)."""
    model = Transformer(cfg, seed=SEED)
    opt = make_optimizer(model.parameters())
    losses, grads = [], {}
    for step in range(STEPS):
        ids, labels = global_batch(step, seq)
        tokens = (labels != -100).sum()
        opt.zero_grad(set_to_none=True)
        total = 0.0
        for i in range(0, GLOBAL_BATCH, MICRO):
            per_token = model(Inputs(ids[i:i + MICRO], labels=labels[i:i + MICRO]))
            (per_token.sum() / tokens).backward()
            total += per_token.sum().item()
        losses.append(total)
        if step == 0:
            grads = {n: p.grad.clone() for n, p in model.named_parameters()}
        opt.step()
    return {"loss_sum": losses, "grads": grads, "params": {n: p.detach().clone() for n, p in model.named_parameters()}}


def _full(p, t, dims):
    t = gather_tp_tensor(t, param_spec(p), reduce="first")
    return comm.all_gather(t, dims.group("ep"), dim=0) if getattr(p, "expert_parallel", False) else t


class ExpertGrads:
    """A step's gradients at any layout with experts, reduced as the trainer does: the dense parameters' over dp x
    cp (the grad group), the experts' over the expert-data-parallel group (the grad group at ep 1)."""

    def __init__(self, params, dims):
        experts = [p for p in params if getattr(p, "expert_parallel", False)]
        dense = [p for p in params if not getattr(p, "expert_parallel", False)]
        self.params, self.dims = params, dims
        self.buffers = [(GradBuffer(dense, device=dims.device), dims.grad_group),
                        (GradBuffer(experts, device=dims.device),
                         dims.expert_grad_group if dims.ep > 1 else dims.grad_group)]

    def step(self, chunks, ids, labels, sp: bool = False, micro: int = 1, **kw) -> dict:
        """forward_backward over this dp rank's rows of the global batch (micro-batches of `micro` sequences), each
        parameter's .grad the reduced gradient; forward_backward's output."""
        dims = self.dims
        per_dp = ids.shape[0] // dims.dp
        rows = slice(dims.dp_rank * per_dp, (dims.dp_rank + 1) * per_dp)
        mbs = [shard_batch({"input_ids": ids[rows][i:i + micro], "labels": labels[rows][i:i + micro]}, dims, sp)
               for i in range(0, per_dp, micro)]
        for buf, _ in self.buffers:
            buf.zero()
        out = forward_backward(chunks, mbs, dims, loss_scale=1.0 / int((labels != -100).sum()), **kw)
        finalize_grads(chunks, dims)
        for buf, group in self.buffers:
            buf.reduce(group)
        for p in self.params:
            p.grad = p.main_grad.to(p.dtype)
        return out


def train(layout: dict) -> dict:
    cfg = DENSE_FIRST if layout.get("cfg") == "dense_first" else CFG
    dims = tpzoo.init_parallel(tp=layout["tp"], pp=layout.get("pp", 1), dp=layout["dp"], ep=layout["ep"],
                               cp=layout.get("cp", 1))
    try:
        chunks = build_model_chunks(cfg, dims, sequence_parallel=layout.get("sp", False), seed=SEED,
                                    recompute=layout.get("recompute", "none"))
        params = list({id(p): p for c in chunks for p in c.parameters()}.values())
        reducer = ExpertGrads(params, dims)
        opt = make_optimizer(params)
        losses, grads, empty = [], {}, 0
        for step in range(STEPS):
            ids, labels = global_batch(step, layout.get("seq", SEQ))
            out = reducer.step(chunks, ids, labels, layout.get("sp", False), MICRO,
                               schedule=layout.get("schedule", "1f1b"))
            losses.append(out["loss_sum"])
            if step == 0:
                grads = {n: _full(p, grad_of(p), dims) for c in chunks for n, p in c.named_parameters()}
            opt.step()
            for c in chunks:  # an expert with no token in the last micro-batch, on this rank's ep peers
                empty = max([empty] + [int((layer.mlp.last_stats["counts"] == 0).sum())
                                       for layer in c.layers.values() if layer.mlp.kind == "moe"])
        return {"coords": (dims.tp_rank, dims.pp_rank, dims.dp_rank), "loss_sum": losses, "grads": grads,
                "params": {n: _full(p, p.detach(), dims) for c in chunks for n, p in c.named_parameters()},
                "empty": empty}
    finally:
        tpzoo.destroy_parallel()


def run_layouts(layouts):
    return [train(layout) for layout in layouts]


def test_moe_training_matches_one_process():
    refs = {SEQ: reference(CFG), CP_SEQ: reference(CFG, CP_SEQ), "dense_first": reference(DENSE_FIRST)}
    for world, layouts in LAYOUTS.items():
        per_rank = run_on_ranks(world, run_layouts, layouts)
        for i, layout in enumerate(layouts):
            ref = refs[layout.get("cfg", layout.get("seq", SEQ))]
            ranks = [r[i] for r in per_rank]
            for r in ranks:
                for name, g in r["grads"].items():
                    assert_close(g, ref["grads"][name], f"{layout} rank {r['coords']} grad {name}")
                for name, p in r["params"].items():
                    assert_close(p, ref["params"][name], f"{layout} rank {r['coords']} param {name}")
            for step, ref_loss in enumerate(ref["loss_sum"]):
                for pp_rank in {r["coords"][1] for r in ranks}:
                    total = sum(r["loss_sum"][step] for r in ranks if r["coords"][:2] == (0, pp_rank))
                    assert abs(total - ref_loss) <= 1e-5 * abs(ref_loss), (layout, step, total, ref_loss)
            assert any(r["empty"] for r in ranks), f"{layout}: every expert got tokens (routing too even to test)"


# -- the trainer ----------------------------------------------------------------------------------------------------

def _train(cfg, meta: bool = False):
    """The trainer on this rank; with `meta`, under torch.set_default_device("meta") (the device-placement proof of
    tests/test_device_placement.py: a tensor created without the runtime's device lands on meta and fails)."""
    from tpzoo.train import train

    if meta:
        torch.set_default_device("meta")
    try:
        return train(cfg)
    finally:
        torch.set_default_device(None)


def test_trainer_with_expert_parallelism(tmp_path):
    """`tpzoo pretrain` at dp=2, ep=2 with ZeRO-1 (expert weights in their own AdamW over the edp group) gives the
    losses and global grad norms of ep=1 (run with the default device meta: every tensor of the expert dispatch is
    placed explicitly); its checkpoint (optimizer state included) resumes at ep=1 on the same path."""
    import sysconfig
    from pathlib import Path

    import pytest

    from tpzoo.data import iter_documents, preprocess
    from tpzoo.train import load_config

    lib = Path(sysconfig.get_paths()["stdlib"])
    store = str(preprocess(iter_documents([str(lib / "textwrap.py")]), "byte", tmp_path / "store").path)
    base = dict(model="nano-mixtral", data=[store], seq_len=16, global_batch_size=4, micro_batch_size=1, steps=3,
                lr=3e-3, warmup_steps=1, min_lr=3e-4, tp=1, pp=1, dp=2, save="", sample_prompt="", quiet=True,
                log_interval=100, eval_fraction=0.0, seed=0, prefetch=1)
    ref = run_on_ranks(2, _train, load_config(None, base))[0]
    saved = run_on_ranks(2, _train, load_config(None, {**base, "ep": 2, "zero1": True, "steps": 2,
                                                       "save": str(tmp_path / "run"), "save_every": 2}), True)[0]
    resumed = run_on_ranks(2, _train, load_config(None, {**base, "save": str(tmp_path / "run"),
                                                         "resume": "auto"}))[0]
    assert saved["losses"] == pytest.approx(ref["losses"][:2], abs=1e-5)
    assert saved["grad_norms"] == pytest.approx(ref["grad_norms"][:2], rel=1e-5)
    assert resumed["losses"][-1] == pytest.approx(ref["losses"][-1], abs=1e-5)
