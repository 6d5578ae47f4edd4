"""ZeRO levels and the overlapped data-parallel reduction against one process.

A tiny LLaMA (grouped-query attention, tied embeddings, so pp > 1 has a tied head copy) trains three AdamW steps
with DistributedAdamW at (tp, pp, dp) = (1,1,2), (1,1,4), (2,1,2)+SP, (1,2,2), (2,2,2)+SP, ZeRO 0, 1, 2 and 3
(ZeRO-3 also with full and selective recomputation and a stage kept gathered for the step),
the overlapped bucketed reduction on (small buckets: about twenty per rank, some cutting through a parameter) and
off, the 1f1b, zero-bubble and interleaved schedules. Loss, global grad norm and every parameter after the third step must equal torch.optim.AdamW on the dense
model in one process. With overlap, at ZeRO 0/1 every bucket without a late parameter must have started during
the backward pass that made its gradients final (the last backward, or zero-bubble W, action of its chunk), in
order from the end of the buffer; at ZeRO-2 and 3 every bucket is reduce-scattered during each backward pass that
filled it. At ZeRO-3 the layers were gathered when used: at most three layers' buffers alive at once (one in use,
one prefetched, one a finished backward left), or with the stage kept gathered all of them.

Layouts of one world size run in one run_on_ranks call (shared worker pools)."""
import pytest
import torch

import tpzoo
from tpzoo.models import Inputs, Transformer
from tpzoo.parallel import gather_tp_tensor, param_spec
from tpzoo.pipeline import build_model_chunks, finalize_grads, forward_backward
from tpzoo.testing import run_on_ranks

from test_3d_parity import MODELS, SEED, _full, assert_close, local_microbatches, reference_step

CFG = MODELS["llama"].replace(num_layers=4, tie_embeddings=True)
STEPS, LR, BUCKET = 3, 1e-3, 2048
# eps well above the gradients' rounding noise (typical entries are ~1e-2): AdamW divides by sqrt(v), so an entry whose gradient is zero up to
# rounding would otherwise take a step of random size and sign (see make_optimizer in test_3d_parity.py).
ADAM = dict(betas=(0.9, 0.95), eps=1e-4, weight_decay=0.1)


def reference() -> dict:
    model = Transformer(CFG, seed=SEED)
    decayed = [p for p in model.parameters() if p.dim() >= 2]  # DistributedAdamW decays matrices, not norms
    opt = torch.optim.AdamW([{"params": decayed}, {"params": [p for p in model.parameters() if p.dim() < 2],
                                                   "weight_decay": 0.0}], lr=LR, **ADAM)
    losses, norms = [], []
    for step in range(STEPS):
        losses.append(reference_step(model, CFG, step, opt))
        norms.append(float(torch.nn.utils.get_total_norm([p.grad for p in model.parameters()])))
        opt.step()
    return {"loss_sum": losses, "norms": norms,
            "params": {n: _full(n, p.detach().clone(), CFG) for n, p in model.named_parameters()}}


def backward_step(chunks, dims, cfg, opt, layout: dict, step: int) -> tuple[dict, int]:
    """Forward, backward and the gradient reductions of step `step` on this rank at `layout` (the optimizer's
    update is the caller's); returns the executor's result and the number of micro-batches."""
    mbs, tokens = local_microbatches(cfg, step)
    opt.zero_grad()
    out = forward_backward(chunks, mbs, dims, schedule=layout.get("schedule", "1f1b"), loss_scale=1.0 / tokens)
    finalize_grads(chunks, dims)
    opt.reduce_grads()
    return out, len(mbs)


def step_timing(opt, out, layout: dict, m: int) -> dict:
    """When the step's gradient buckets started reducing, against the gradient-producing actions (check_overlap)."""
    grads = opt.grads
    early = [t for _, t in grads.started[:grads.overlapped]]
    grad_actions = [(mb, t0, t1) for kind, mb, t0, t1 in out["timeline"]
                    if kind == ("W" if layout.get("schedule") == "zb" else "B")]
    late = [k for k, is_late in enumerate(grads.late) if is_late]
    return {"early": early, "n_early": grads.overlapped, "n_buckets": len(grads.buckets), "m": m, "late": late,
            "started": [k for k, _ in grads.started], "actions": grad_actions}


def check_overlap(timing: list[dict], layout: dict) -> None:
    """The overlapped reduction's promise, step by step (module docstring)."""
    for t in timing:
        if not layout["overlap"] and layout["zero"] < 2:  # ZeRO-2 reduces in every pass (waited on at its end)
            assert t["n_early"] == 0, layout
            continue
        normal = sorted(set(range(t["n_buckets"])) - set(t["late"]), reverse=True)
        if layout["zero"] >= 2:
            # every micro-batch's backward reduce-scatters every bucket it filled, during that backward
            passes = t["m"] * layout.get("v", 1)
            assert t["n_early"] >= len(normal) * t["m"] and t["n_early"] <= passes * len(normal), layout
            windows = [(t0, t1) for _, t0, t1 in t["actions"]]
        else:
            # every bucket without a late parameter started during the backward passes, from the end of the
            # buffer, inside its chunk's last gradient-producing action (none earlier: not final before)
            assert t["n_early"] == len(normal) > 0, layout
            assert t["started"][:t["n_early"]] == normal, layout
            windows = [(t0, t1) for mb, t0, t1 in t["actions"] if mb == t["m"] - 1]
        for when in t["early"]:
            assert any(t0 <= when <= t1 for t0, t1 in windows), (layout, when, windows)


def train_zero(layout: dict) -> dict:
    from tpzoo.train.optim import DistributedAdamW

    tp, pp, dp = layout["tp"], layout.get("pp", 1), layout["dp"]
    dims = tpzoo.init_parallel(tp=tp, pp=pp, dp=dp)
    try:
        chunks = build_model_chunks(CFG, dims, sequence_parallel=layout.get("sp", False), seed=SEED,
                                    virtual_stages=layout.get("v", 1), recompute=layout.get("recompute", "none"))
        opt = DistributedAdamW([p for c in chunks for p in c.parameters()], dims, zero=layout["zero"],
                               overlap=layout["overlap"], bucket_elems=BUCKET, modules=chunks,
                               keep_gathered=layout.get("keep", False), **ADAM)
        losses, norms, timing = [], [], []
        for step in range(STEPS):
            out, m = backward_step(chunks, dims, CFG, opt, layout, step)
            norms.append(opt.global_grad_norm()[0])
            opt.step(LR)
            losses.append(out["loss_sum"])
            timing.append(step_timing(opt, out, layout, m))
        with opt.weights_readable():  # ZeRO-3: the weights all-gathered from the shards
            params = {n: _full(n, gather_tp_tensor(p, param_spec(p), reduce="first"), CFG)
                      for c in chunks for n, p in c.named_parameters()}
        return {"loss_sum": losses, "norms": norms, "params": params, "timing": timing,
                "sharded": _sharded(opt), "state": (opt.buffer_bytes(), _planned(layout, dims))}
    finally:
        tpzoo.destroy_parallel()


def _planned(layout: dict, dims) -> dict:
    """tpzoo.plan's training state for this rank's stage (fp32 weights, the test's buckets): late buckets, a
    tied embedding kept whole at pp = 1 (ZeRO-3) included."""
    from tpzoo.plan import Layout, TrainingSpec, stage_params, state_bytes
    from tpzoo.plan.memory import late_params, resident_params

    tp, pp, dp = dims.tp, dims.pp, dims.dp
    count = stage_params(CFG, Layout(tp=tp, pp=pp, virtual_stages=layout.get("v", 1)), dims.pp_rank)
    training = TrainingSpec(8, 4, dtype="fp32", zero=layout["zero"], grad_bucket_elems=BUCKET)
    est = state_bytes(count, training, dp, late_params(count, tp, layout.get("sp", False)),
                      resident_params(CFG, count, training, tp, dp, dims.pp_rank == 0, dims.pp_rank == pp - 1))
    return {"params": est.params, "grads": est.grads, "master": est.master, "optimizer": est.optimizer}


def _sharded(opt) -> dict | None:
    """ZeRO-3: the bytes of the layers' buffers (all of them, the most alive at once during the steps) and what
    stays allocated (the owned shard, late buckets, resident parameters), against the whole flat weights."""
    if opt.shards is None:
        return None
    units = [u.nbytes for u in opt.shards.units if not u.resident]
    return {"units": sum(units), "largest": max(units), "peak": opt.shards.peak, "kept": opt.shards.nbytes(),
            "full": opt.padded * 4, "dp": opt.dp_size, "gathers": opt.shards.gathers,
            "prefetched": opt.shards.prefetched}


def run_layouts(layouts: list[dict]) -> list[dict]:
    return [train_zero(layout) for layout in layouts]


def check(ref: dict, ranks: list[dict], layout: dict) -> None:
    for r in ranks:
        assert r["loss_sum"][-1] != 0
        if layout["zero"] >= 2:  # the plan's training state, late buckets (and ZeRO-3's resident embedding) included
            assert r["state"][0] == r["state"][1], (layout, r["state"])
        if layout["zero"] == 3:  # the layers were gathered when used: at most three at once, or all kept
            sh = r["sharded"]
            if layout.get("keep"):
                assert sh["peak"] == sh["units"], layout
            else:
                assert 0 < sh["peak"] <= 3 * sh["largest"] and sh["peak"] <= sh["units"], (layout, sh)
            # most gathers were started ahead of need (the next layer's in forward, the previous one's in backward;
            # within a chunk: the interleaved layout's chunks hold one layer each)
            if layout.get("v", 1) == 1:
                assert sh["prefetched"] >= sh["gathers"] // 3 > 0, (layout, sh)
        assert r["norms"] == pytest.approx(ref["norms"], rel=1e-5), layout
        for name, p in r["params"].items():
            ref_name = "embed.weight" if name == "lm_head.weight" else name
            assert_close(p, ref["params"][ref_name], f"{layout} param {name}")
        check_overlap(r["timing"], layout)
    # loss_sum is reported on every pipeline rank; per dp rank it is that rank's share of the batch
    by_step = [sum(r["loss_sum"][s] for r in ranks) / (len(ranks) // layout["dp"]) for s in range(STEPS)]
    assert by_step == pytest.approx(ref["loss_sum"], rel=1e-5), layout


LAYOUTS = {  # every layout at ZeRO 0, 1, 2 and 3; schedules, recomputation and overlap off spread over them
    2: [dict(tp=1, dp=2, zero=z, overlap=o) for z in (0, 1, 2, 3) for o in (True, False)]
       + [dict(tp=1, dp=2, zero=3, overlap=True, recompute="full")],
    4: [dict(tp=1, dp=4, zero=z, overlap=True) for z in (0, 1, 2, 3)]
       + [dict(tp=2, dp=2, sp=True, zero=z, overlap=True) for z in (0, 1, 2, 3)]
       + [dict(tp=1, pp=2, dp=2, zero=0, overlap=False), dict(tp=1, pp=2, dp=2, zero=1, overlap=True),
          dict(tp=1, pp=2, dp=2, zero=2, overlap=True, schedule="zb"),
          dict(tp=1, pp=2, dp=2, zero=3, overlap=True, schedule="zb"),
          dict(tp=1, pp=2, dp=2, zero=3, overlap=True, keep=True, recompute="selective")],
    8: [dict(tp=2, pp=2, dp=2, sp=True, zero=0, overlap=True),
        dict(tp=2, pp=2, dp=2, sp=True, zero=1, overlap=True, schedule="zb"),
        dict(tp=2, pp=2, dp=2, sp=True, zero=2, overlap=True, schedule="interleaved", v=2),
        dict(tp=2, pp=2, dp=2, sp=True, zero=3, overlap=True),
        dict(tp=2, pp=2, dp=2, sp=True, zero=3, overlap=True, schedule="interleaved", v=2)],
}


@pytest.mark.parametrize("world", sorted(LAYOUTS))
def test_zero_levels_and_overlap_equal_one_process(world):
    ref = reference()
    results = run_on_ranks(world, run_layouts, LAYOUTS[world])
    for i, layout in enumerate(LAYOUTS[world]):
        check(ref, [r[i] for r in results], layout)


# -- memory: what a real step leaves allocated ----------------------------------------------------------------------

SMALL = MODELS["llama"].replace(num_layers=2)  # several buckets still (BUCKET elements each)

def _state_after_a_step(zeros: list[int]) -> list[tuple[int, int, dict]]:
    """At each ZeRO level, on this rank: every storage allocated while building DistributedAdamW (bf16 weights)
    and running one step (forward, backward, reduce, norm, AdamW) that is still alive afterwards."""
    from tpzoo.plan.measure import live_activation_bytes
    from tpzoo.train.optim import DistributedAdamW

    dims = tpzoo.init_parallel(tp=1)  # every rank a data-parallel replica
    try:
        out = []
        for zero in zeros:
            model = Transformer(SMALL, dims, seed=SEED)
            ids = torch.randint(0, 97, (2, 8), generator=torch.Generator().manual_seed(dims.dp_rank))
            with live_activation_bytes() as live:
                opt = DistributedAdamW(list(model.parameters()), dims, model_dtype=torch.bfloat16, zero=zero,
                                       bucket_elems=BUCKET, modules=[model])
                opt.zero_grad()
                model(Inputs(ids, labels=ids)).sum().backward()
                opt.reduce_grads()
                opt.global_grad_norm()
                opt.step(LR)
            out.append((zero, live.total, opt.buffer_bytes(), opt.shards.peak if opt.shards else 0))
            del opt, model
        return out
    finally:
        tpzoo.destroy_parallel()


def test_state_bytes_of_a_real_step_follow_the_formulas():
    """Measured at dp = 1, 2, 4 and ZeRO 0, 1, 2, 3 (bf16 weights): the storages a step leaves alive are exactly
    the documented training state (tpzoo.plan.state_bytes: weights 2 (ZeRO-3: 2/dp), master 4/dp at ZeRO >= 1,
    moments 8/dp at ZeRO >= 1, fp32 gradients 4 (+ the 4/dp shard at ZeRO-1) or, at ZeRO-2/3, only the 4/dp
    shard); at ZeRO-3 the layers gathered during the step never exceeded the plan's working set."""
    from tpzoo.plan import Layout, TrainingSpec, stage_params, state_bytes
    from tpzoo.plan.memory import gathered_bytes

    count = stage_params(SMALL, Layout(), 0)
    for dp in (1, 2, 4):
        for rank in run_on_ranks(dp, _state_after_a_step, [0, 1, 2, 3]):
            for zero, live, reported, peak in rank:
                training = TrainingSpec(8, 4, zero=zero, grad_bucket_elems=BUCKET)
                est = state_bytes(count, training, dp)
                if zero == 3:
                    assert 0 < peak <= gathered_bytes(SMALL, count, training, 1, dp), (dp, peak)
                    assert est.params == 2 * (-(-count.numel // dp))
                expected = {"params": est.params, "grads": est.grads, "master": est.master,
                            "optimizer": est.optimizer}
                assert reported == expected, (dp, zero)
                assert live == sum(expected.values()), (dp, zero, live, expected)
                if zero == 2 and dp > 1:  # no full-size fp32 gradient buffer
                    assert est.grads == 4 * (-(-count.numel // dp))


def test_both_update_paths_follow_torch_adamw(monkeypatch):
    """One process: DistributedAdamW's fused update (two multi-tensor kernels, the clipping scale folded in) and
    its multi-tensor reference path (torch without the fused kernel) follow torch.optim.AdamW for three steps
    whose gradients are scaled (clipping): loss, global norm and every parameter."""
    from tpzoo.parallel import local_dims
    from tpzoo.train import optim

    dims, scales = local_dims(), (0.3, 1.0, 0.7)
    for fused in (True, False):
        if not fused:
            monkeypatch.setattr(optim, "_FUSED", None)
        model, ref = Transformer(SMALL, dims, seed=SEED), Transformer(SMALL, dims, seed=SEED)
        opt = optim.DistributedAdamW(list(model.parameters()), dims, bucket_elems=BUCKET, **ADAM)
        decayed = [p for p in ref.parameters() if p.dim() >= 2]
        torch_opt = torch.optim.AdamW([{"params": decayed}, {"params": [p for p in ref.parameters() if p.dim() < 2],
                                                             "weight_decay": 0.0}], lr=LR, **ADAM)
        for step, scale in enumerate(scales):
            ids = torch.randint(0, SMALL.vocab_size, (2, 8), generator=torch.Generator().manual_seed(step))
            opt.zero_grad()
            model(Inputs(ids, labels=ids)).sum().backward()
            opt.reduce_grads()
            norm, _ = opt.global_grad_norm()
            opt.step(LR, scale)
            torch_opt.zero_grad()
            ref(Inputs(ids, labels=ids)).sum().backward()
            assert norm == pytest.approx(float(torch.nn.utils.get_total_norm([p.grad for p in ref.parameters()])),
                                         rel=1e-6), (fused, step)
            for p in ref.parameters():
                p.grad.mul_(scale)
            torch_opt.step()
        for (name, p), q in zip(model.named_parameters(), ref.parameters()):
            assert_close(p.detach(), q.detach(), f"fused={fused} {name}")
