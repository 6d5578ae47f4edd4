"""3D parallelism against one process: a tiny GPT (tied embeddings, learned positions, biases) and a tiny LLaMA
(grouped-query attention, RoPE, untied) train three optimizer steps at many (tp, pp, dp) layouts, with sequence
parallelism on and off and every pipeline schedule. Loss, every parameter gradient of the first step (shards
gathered to full tensors, pipeline stages merged by name) and every parameter after the third step must match the
single-process model built from the same config and seed, trained on the same global batch.

Layouts of one world size run in one run_on_ranks call (the worker pools are shared), so each test pays the
process start-up once. Helpers here are reused by the other pipeline test files."""
import pytest
import torch

import tpzoo
from tpzoo.models import Inputs, Transformer, apply_recompute, get_config
from tpzoo.parallel import (GradBuffer, get_dp_rank, get_dp_size, get_pp_rank, get_tp_rank, gather_tp_tensor,
                            grad_of, param_spec)
from tpzoo.pipeline import build_model_chunks, finalize_grads, forward_backward
from tpzoo.testing import run_on_ranks

GLOBAL_BATCH, SEQ, MICRO = 8, 8, 2  # 4 micro-batches at dp=1: few messages, every schedule phase
STEPS, SEED = 3, 1234
RTOL = 1e-5  # relative to each tensor's largest entry: summation-order rounding scales with the tensor, not the entry
MODELS = {
    "gpt": get_config("nano-gpt").replace(num_layers=8),
    "llama": get_config("nano-llama").replace(num_layers=8),  # 4 query heads, 2 kv heads
}


def global_batch(cfg, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Next-token data with some ignored labels (-100), different at every step."""
    g = torch.Generator().manual_seed(100 + step)
    ids = torch.randint(0, cfg.vocab_size, (GLOBAL_BATCH, SEQ), generator=g)
    labels = torch.cat([ids[:, 1:], torch.full((GLOBAL_BATCH, 1), -100)], dim=1)
    labels[torch.rand(labels.shape, generator=g) < 0.15] = -100
    return ids, labels


def make_optimizer(params):
    # SGD with momentum is linear in the gradients, so rounding-level differences stay rounding-level. (AdamW
    # divides by sqrt(v): gradients that are zero up to rounding, like the key biases' - softmax ignores a shift of
    # the keys - become full +-lr steps of random sign, which no layout-independent comparison survives.)
    return torch.optim.SGD(params, lr=0.5, momentum=0.9, weight_decay=0.01)


def _full(name, t, cfg):
    """Drop the vocabulary padding so tensors of any tp compare with the unpadded reference."""
    return t[: cfg.vocab_size] if name in ("embed.weight", "lm_head.weight") else t


def reference_step(model, cfg, step: int, opt) -> float:
    """Forward and backward of the single-process model on step `step`'s global batch (the gradient of the mean
    loss over its trained tokens); returns the summed loss. The caller reads the gradients and steps `opt`."""
    ids, labels = global_batch(cfg, step)
    opt.zero_grad(set_to_none=True)
    per_token = model(Inputs(ids, labels=labels))
    (per_token.sum() / (labels != -100).sum()).backward()
    return per_token.sum().item()


def reference(cfg, steps: int = STEPS, recompute: str = "none") -> dict:
    """The same model in one process, no pipeline machinery: one forward over the whole global batch."""
    model = apply_recompute(Transformer(cfg, seed=SEED), recompute)
    opt = make_optimizer(model.parameters())
    losses, grads, params = [], {}, []
    for step in range(steps):
        losses.append(reference_step(model, cfg, step, opt))
        if step == 0:
            grads = {n: _full(n, p.grad.clone(), cfg) for n, p in model.named_parameters()}
        opt.step()
        params.append({n: _full(n, p.detach().clone(), cfg) for n, p in model.named_parameters()})
    return {"loss_sum": losses, "grads": grads, "params": params}  # params[k]: after k+1 steps


def local_microbatches(cfg, step: int) -> tuple[list[dict], int]:
    """This data-parallel rank's share of the step's global batch, cut into micro-batches; and the number of
    non-ignored tokens in the whole global batch (the loss scale's denominator)."""
    ids, labels = global_batch(cfg, step)
    per_dp = GLOBAL_BATCH // get_dp_size()
    rows = slice(get_dp_rank() * per_dp, (get_dp_rank() + 1) * per_dp)
    ids, labels_local = ids[rows], labels[rows]
    mbs = [{"input_ids": ids[i: i + MICRO], "labels": labels_local[i: i + MICRO]} for i in range(0, per_dp, MICRO)]
    return mbs, int((labels != -100).sum())


def layout_step(chunks, dims, cfg, step: int, params: list, main_grads: GradBuffer, schedule: str = "1f1b") -> dict:
    """Forward and backward of this rank's share of step `step`'s global batch at the chunks' layout, then the TP
    and DP reductions; the parameters' .grad is their fp32 main grad, for an optimizer to step on. Returns the
    executor's result (loss_sum, tokens, ...)."""
    mbs, tokens = local_microbatches(cfg, step)
    main_grads.zero()
    out = forward_backward(chunks, mbs, dims, schedule=schedule, loss_scale=1.0 / tokens)
    finalize_grads(chunks, dims)
    main_grads.reduce(dims.grad_group)
    for p in params:
        p.grad = p.main_grad.to(p.dtype)  # what the optimizer steps on (fp32 main grads; float64 models too)
    return out


def train_layout(cfg, layout: dict, steps: int = STEPS) -> dict:
    """Train `steps` (or layout["steps"]) steps at one layout on this rank: loss, full (gathered over tp)
    gradients of the first step, full parameters at the end."""
    tp, pp, dp = layout["tp"], layout.get("pp", 1), layout.get("dp", 1)
    steps = layout.get("steps", steps)
    dims = tpzoo.init_parallel(tp=tp, pp=pp, dp=dp)
    try:
        chunks = build_model_chunks(cfg, dims, sequence_parallel=layout.get("sp", False), seed=SEED,
                                    recompute=layout.get("recompute", "none"), virtual_stages=layout.get("v", 1),
                                    boundaries=layout.get("boundaries"))
        params = list({id(p): p for c in chunks for p in c.parameters()}.values())
        opt = make_optimizer(params)
        main_grads = GradBuffer(params, device=dims.device)  # fp32 main grads and the one DP reduction
        losses, grads, results = [], {}, []
        for step in range(steps):
            out = layout_step(chunks, dims, cfg, step, params, main_grads, layout.get("schedule", "1f1b"))
            losses.append(out["loss_sum"])
            results.append({k: out[k] for k in ("tokens", "peak_inflight")})
            if step == 0:
                grads = _gathered(chunks, cfg, grad=True)
            opt.step()
        replicated = {n: p.detach().clone() for c in chunks for n, p in c.named_parameters()
                      if getattr(p, "tp_spec", None) is None or p.tp_spec.dim is None}
        return {"coords": (get_tp_rank(), get_pp_rank(), get_dp_rank()), "loss_sum": losses, "grads": grads,
                "params": _gathered(chunks, cfg, grad=False), "replicated": replicated, "steps": results}
    finally:
        tpzoo.destroy_parallel()


def _gathered(chunks, cfg, grad: bool) -> dict:
    # reduce="first": after finalize_grads every copy of a replicated kv head already holds the summed gradient
    # (gather_tp_param(grad=True) sums the copies, which is right only before that sync).
    return {n: _full(n, gather_tp_tensor(grad_of(p) if grad else p, param_spec(p), reduce="first"), cfg)
            for c in chunks for n, p in c.named_parameters()}


def run_layouts(model: str, layouts: list[dict], steps: int = STEPS) -> list[list[dict]]:
    """Worker entry point: every layout in turn (same world size), this rank's results of each."""
    return [train_layout(MODELS[model], layout, steps) for layout in layouts]


def assert_close(actual, expected, what: str) -> None:
    torch.testing.assert_close(actual, expected, rtol=RTOL, atol=RTOL * float(expected.abs().max()),
                               msg=lambda m: f"{what}: {m}")


def check_layout(cfg, ref: dict, ranks: list[dict], layout: dict) -> None:
    """Compare one layout's per-rank results with the reference."""
    tied = cfg.tie_embeddings
    ref_name = lambda n: "embed.weight" if tied and n == "lm_head.weight" else n  # noqa: E731
    merged_grads = {}
    for r in ranks:
        for name, g in r["grads"].items():
            assert_close(g, ref["grads"][ref_name(name)], f"{layout} rank {r['coords']} grad {name}")
            merged_grads[name] = g
        for name, p in r["params"].items():
            expected = ref["params"][len(r["loss_sum"]) - 1][ref_name(name)]
            assert_close(p, expected, f"{layout} rank {r['coords']} param {name} after {len(r['loss_sum'])} steps")
    missing = set(ref["grads"]) - set(merged_grads)
    assert not missing, f"{layout}: no rank holds {sorted(missing)}"
    # Loss: the sum over data-parallel replicas (each pipeline rank reports its pipeline's loss).
    for step, ref_loss in enumerate(ref["loss_sum"][: len(ranks[0]["loss_sum"])]):
        for pp_rank in {r["coords"][1] for r in ranks}:
            total = sum(r["loss_sum"][step] for r in ranks if r["coords"][0] == 0 and r["coords"][1] == pp_rank)
            assert abs(total - ref_loss) <= RTOL * abs(ref_loss), (layout, step, pp_rank, total, ref_loss)
    # Every TP rank holds bit-identical replicated parameters after the steps (Megatron-LM issue #1446).
    by_stage = {}
    for r in ranks:
        by_stage.setdefault((r["coords"][1], r["coords"][2]), []).append(r["replicated"])
    for copies in by_stage.values():
        for other in copies[1:]:
            for name, value in copies[0].items():
                assert torch.equal(value, other[name]), f"{layout}: TP ranks disagree on {name}"


@pytest.fixture(scope="module")
def references():
    return References(reference)


class References(dict):
    """The one-process reference of each model, computed when a test first asks for it."""

    def __init__(self, compute):
        super().__init__()
        self.compute = compute

    def __missing__(self, name: str) -> dict:
        self[name] = self.compute(MODELS[name])
        return self[name]


SCHEDULES = [("gpipe", 1), ("1f1b", 1), ("interleaved", 2), ("zb", 1)]
LAYOUTS = {
    2: [dict(tp=2), dict(tp=2, sp=True), dict(tp=1, dp=2)]
       + [dict(tp=1, pp=2, schedule=s, v=v) for s, v in SCHEDULES]
       + [dict(tp=1, pp=2, schedule="1f1b", boundaries=[0, 3, 8]),  # uneven split
          dict(tp=1, dp=2, schedule="interleaved", v=2)],  # two chunks on one stage: plain loop, shared tied weight
    # tp=4 with 2 kv heads: replicated kv heads under SP (one step: a 4-rank TP group is slow on 2 cores)
    4: [dict(tp=2, pp=2, sp=True), dict(tp=4, sp=True, steps=1), dict(tp=2, dp=2, sp=True, schedule="zb")]
       + [dict(tp=1, pp=4, schedule=s, v=v) for s, v in SCHEDULES],
    8: [dict(tp=2, pp=2, dp=2, sp=True), dict(tp=2, pp=2, dp=2, sp=True, schedule="interleaved", v=2),
        dict(tp=2, pp=4, sp=True, schedule="zb")],
}


# Default tier: every layout once, each with the model it tests most (2 ranks: the GPT, whose tied embedding crosses
# the pipeline and two chunks of one stage; 4 ranks: the Llama, whose 2 kv heads are copied at tp=4; 8 ranks: the
# GPT in 3D); the other model at each world size in the slow tier.
@pytest.mark.parametrize("model,world", [("gpt", 2), ("llama", 4), ("gpt", 8)] + [
    pytest.param(m, w, marks=pytest.mark.slow) for m, w in (("llama", 2), ("gpt", 4), ("llama", 8))])
def test_loss_grads_and_params_match_one_process(references, model, world):
    cfg, layouts = MODELS[model], LAYOUTS[world]
    per_rank = run_on_ranks(world, run_layouts, model, layouts)
    for i, layout in enumerate(layouts):
        check_layout(cfg, references[model], [rank_results[i] for rank_results in per_rank], layout)
