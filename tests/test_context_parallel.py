"""Context parallelism against one process: a tiny GPT (learned positions, tied embeddings), a tiny LLaMA
(grouped-query attention, RoPE) and a Gemma 3-like LLaMA (sliding-window layers with their own rotary base, q/k
norms; cp=2 only) take one step on packed documents (labels ignored at document starts and at random), with a
sequence of 8 tokens and one of 11 (padded to whole chunks, the padding's labels ignored), at cp = 2 and 4,
(tp, cp) = (2, 2) with sequence parallelism, (cp, pp) = (2, 2), (cp, dp) = (2, 2), ring and all-to-all modes, with
recomputation. The loss summed over the dp x cp ranks and every gradient (after the dp x cp reduction, gathered
over tp, stages merged) must equal the single-process model's (1e-5 of each tensor's largest entry, as
tests/test_3d_parity.py). Layouts of one world size share one pool of ranks."""
import pytest
import torch

import tpzoo
from tpzoo.models import Inputs, Transformer, get_config
from tpzoo.parallel import GradBuffer, comm
from tpzoo.parallel.context_parallel import shard_batch
from tpzoo.pipeline import build_model_chunks, finalize_grads, forward_backward
from tpzoo.testing import run_on_ranks

from test_3d_parity import SEED, _full, _gathered, assert_close
from test_train import _train, store, tiny  # noqa: F401 (store: the token-store fixture)

BATCH, MICRO = 4, 2
SEQS = (8, 11)
MODELS = {"gpt": get_config("nano-gpt").replace(num_layers=4),
          "llama": get_config("nano-llama").replace(num_layers=4),  # 4 query heads, 2 kv heads
          # Gemma 3-like: sliding layers (window 3, across chunk boundaries) with their own rope base, q/k norms
          "window": get_config("nano-llama").replace(num_layers=4, sliding_window=3, rope_local_theta=100.0,
                                                     layer_types=["sliding_attention", "full_attention"] * 2,
                                                     qk_norm="head")}
LAYOUTS = {
    2: [dict(cp=2), dict(cp=2, mode="a2a", recompute="selective")],
    4: [dict(cp=4), dict(cp=4, mode="a2a"), dict(tp=2, cp=2, sp=True), dict(cp=2, pp=2),
        dict(cp=2, dp=2, recompute="full"), dict(cp=2, dp=2, mode="a2a")],
}


def packed_batch(cfg, seq: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Documents packed back to back: the label predicting a document's first token is ignored (as
    tpzoo.data.PackedDataset does), plus some labels ignored at random."""
    g = torch.Generator().manual_seed(7 + seq)
    ids = torch.randint(0, cfg.vocab_size, (BATCH, seq), generator=g)
    labels = torch.cat([ids[:, 1:], torch.full((BATCH, 1), -100)], dim=1)
    doc_starts = torch.rand(labels.shape, generator=g) < 0.2
    labels[doc_starts] = -100
    labels[torch.rand(labels.shape, generator=g) < 0.1] = -100
    return ids, labels


def reference(cfg, seq: int) -> dict:
    model = Transformer(cfg, seed=SEED)
    ids, labels = packed_batch(cfg, seq)
    per_token = model(Inputs(ids, labels=labels))
    (per_token.sum() / (labels != -100).sum()).backward()
    grads = {n: _full(n, p.grad, cfg) for n, p in model.named_parameters()}
    return {"loss_sum": per_token.sum().item(), "grads": grads}


def run_layout(model: str, layout: dict, seq: int) -> dict:
    cfg = MODELS[model]
    tp, cp, pp, dp, sp = (layout.get(k, 1) for k in ("tp", "cp", "pp", "dp", "sp"))
    dims = tpzoo.init_parallel(tp=tp, cp=cp, pp=pp, dp=dp)
    try:
        chunks = build_model_chunks(cfg, dims, sequence_parallel=bool(sp), seed=SEED,
                                    cp_mode=layout.get("mode", "ring"), recompute=layout.get("recompute", "none"))
        params = list({id(p): p for c in chunks for p in c.parameters()}.values())
        main_grads = GradBuffer(params, device=dims.device)
        ids, labels = packed_batch(cfg, seq)
        rows = slice(dims.dp_rank * BATCH // dp, (dims.dp_rank + 1) * BATCH // dp)
        mbs = [shard_batch({"input_ids": ids[rows][i: i + MICRO], "labels": labels[rows][i: i + MICRO]}, dims,
                           bool(sp)) for i in range(0, BATCH // dp, MICRO)]
        with comm.count_collectives() as counter:
            out = forward_backward(chunks, mbs, dims, loss_scale=1.0 / int((labels != -100).sum()))
        finalize_grads(chunks, dims)
        main_grads.reduce(dims.grad_group)
        for p in params:
            p.grad = p.main_grad
        totals = torch.tensor([out["loss_sum"], out["tokens"]], dtype=torch.float64)
        comm.all_reduce(totals, dims.grad_group)  # the trainer's loss and token count: over dp x cp
        return {"loss_sum": float(totals[0]), "tokens": int(totals[1]), "grads": _gathered(chunks, cfg, grad=True),
                "a2a_calls": counter.get("all_to_all", "cp").calls, "micro_batches": len(mbs)}
    finally:
        tpzoo.destroy_parallel()


def run_layouts(model: str, layouts: list[dict]) -> list:
    return [[run_layout(model, layout, seq) for seq in SEQS] for layout in layouts]


@pytest.mark.parametrize("model,world", [("gpt", 2), ("gpt", 4), ("llama", 2), ("llama", 4), ("window", 2)])
def test_context_parallel_matches_one_process(model, world):
    cfg = MODELS[model]
    refs = [reference(cfg, seq) for seq in SEQS]
    tied = lambda n: "embed.weight" if cfg.tie_embeddings and n == "lm_head.weight" else n  # noqa: E731
    per_rank = run_on_ranks(world, run_layouts, model, LAYOUTS[world])
    for li, layout in enumerate(LAYOUTS[world]):
        for si, (seq, ref) in enumerate(zip(SEQS, refs)):
            what = f"{model} {layout} seq {seq}"
            merged = set()
            for r in per_rank:
                res = r[li][si]
                assert res["tokens"] == int((packed_batch(cfg, seq)[1] != -100).sum()), what
                assert abs(res["loss_sum"] - ref["loss_sum"]) <= 1e-5 * abs(ref["loss_sum"]), (what, res["loss_sum"])
                for name, g in res["grads"].items():
                    assert_close(g, ref["grads"][tied(name)], f"{what} grad {name}")
                    merged.add(tied(name))
            assert merged == set(ref["grads"]), f"{what}: no rank holds {set(ref['grads']) - merged}"
            if layout.get("mode") == "a2a" and layout.get("recompute", "none") == "none":
                # per layer: q, k, v and the output exchanged forward, and their gradients backward
                assert all(r[li][si]["a2a_calls"] == 8 * cfg.num_layers * r[li][si]["micro_batches"]
                           for r in per_rank), what


# -- the trainer: --cp end to end --------------------------------------------------------------------------------

def test_trainer_at_cp_equals_cp1(store, tmp_path):
    """`tpzoo pretrain` at cp=2 (ZeRO-3 sharding weights and optimizer over the 2 cp ranks) and at cp=1: the same
    losses, global grad norms (AdamW steps) and held-out loss, on sequences of 30 tokens (padded to whole chunks);
    the cp=2 run's step-2 checkpoint resumed at cp=1 continues with cp=2's step-3 loss. (dp x cp reductions: the
    layouts above.)"""
    kw = dict(model="nano-llama", seq_len=30, steps=3, eval_fraction=0.2, eval_batches=2)
    ref = run_on_ranks(1, _train, tiny(store, **kw))[0]
    save = str(tmp_path / "run")
    results = run_on_ranks(2, _train, tiny(store, cp=2, zero=3, save=save, save_every=2, **kw))
    assert results[0]["losses"] == results[1]["losses"]
    r = results[0]
    assert r["losses"] == pytest.approx(ref["losses"], rel=1e-5)
    assert r["grad_norms"] == pytest.approx(ref["grad_norms"], rel=1e-5)
    assert r["eval_loss"] == pytest.approx(ref["eval_loss"], rel=1e-5)
    resumed = run_on_ranks(1, _train, tiny(store, save=save, resume=save + "/step_00000002", **kw))[0]
    assert resumed["steps"] == [3] and resumed["losses"] == pytest.approx(r["losses"][2:], rel=1e-5)


def live_activation_bytes_at(cp: int, seq: int) -> int:
    from tpzoo import kernels as K
    from tpzoo.plan.measure import live_activation_bytes

    dims = tpzoo.init_parallel(cp=cp)
    try:
        model = Transformer(MODELS["llama"], dims, seed=SEED)
        ids, labels = packed_batch(model.cfg, seq)
        batch = shard_batch({"input_ids": ids[:MICRO], "labels": labels[:MICRO]}, dims)
        with K.use_backend("torch"):
            with live_activation_bytes(list(model.parameters()) + list(batch.values())) as live:
                loss = model(Inputs(batch["input_ids"], labels=batch["labels"],
                                    positions=batch["position_ids"])).sum()
        del loss
        return live.total
    finally:
        tpzoo.destroy_parallel()


def test_activation_bytes_per_rank_equal_the_plan():
    """What a cp=2 rank's forward leaves for the backward (every live storage, measured) equals the plan's
    activation estimate at cp=2 (seq/cp tokens per rank; ring attention keeps what SDPA keeps), within 2%."""
    from tpzoo.plan import Layout, TrainingSpec, stage_memory

    seq = 64
    run = TrainingSpec(seq_len=seq, global_batch_size=MICRO, dtype="fp32", kernels="reference")
    want = stage_memory(MODELS["llama"], Layout(cp=2, micro_batch_size=MICRO), run, 0).activations
    for got in run_on_ranks(2, live_activation_bytes_at, 2, seq):
        assert got == pytest.approx(want, rel=0.02)
