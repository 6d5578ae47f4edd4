"""Document masking: packed training equals unpacked training.

SFT: the same random examples (prompt-masked, some truncated) packed by PackedSFTDataset (whole examples, doc ids,
restarting positions) and padded one per row by PaddedSFTDataset. Each optimizer step takes 4 packed rows, and the
reference one process takes exactly the examples in those rows, one per padded row: the same trained tokens, so
the trainer's normalization (loss summed over the step's trained tokens, divided by their number) is the same on
both sides. Loss of every step, every gradient of the first step (lr 0: the weights untouched) and every weight
after 3 SGD-with-momentum steps equal the reference (1e-5 of each tensor's largest entry, as
tests/test_3d_parity.py) for a GPT-2 (learned positions, tied embeddings), a LLaMA (GQA, RoPE) and a Gemma 2-like
LLaMA (sliding window 3 on every other layer, soft-capped scores) at tp 1, tp 2 + SP, pp 2 (full recompute), cp 2
ring and cp 2 a2a (selective recompute; the soft-capped model runs a2a only: ring refuses soft-capping), and a
Mixtral (experts; tp 1 and tp 2 + SP). Proofs that the comparison can fail: packing without the mask differs, and
for GPT-2 so does masking with positions that continue across documents (rotary attention only sees relative
positions, so LLaMA cannot tell).

Pretraining: `tpzoo.train` with --document-masking at lr 0 gives, step by step, the loss and gradient norm of a
single process training each window's pieces of documents alone (one per padded row), at tp 1, tp 2 + SP and
cp 2. Ring attention with documents equals masked attention over the whole sequence (fp64); the exact path equals
per-document attention; FlexAttention's mask (the CUDA path) equals the exact path on CPU (forward: FlexAttention
has no CPU backward). Batches without documents keep the plain causal path (training, eval and generation)."""
import warnings

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import tpzoo
from tpzoo.data import PackedSFTDataset, PaddedSFTDataset, collate_long, preprocess
from tpzoo.models import Inputs, Transformer, get_config
from tpzoo.models.documents import Documents, document_positions
from tpzoo.models.kinds.document_attention import document_attention
from tpzoo.models.kinds.attention_extras import softcapped_attention
from tpzoo.parallel import GradBuffer, comm
from tpzoo.parallel.context_parallel import shard_batch
from tpzoo.parallel.ring_attention import local_positions, ring_attention
from tpzoo.pipeline import build_model_chunks, finalize_grads, forward_backward
from tpzoo.testing import run_on_ranks

from test_3d_parity import SEED, _full, _gathered, assert_close, make_optimizer
from test_train import _train, tiny

SEQ, ROWS, MICRO, STEPS = 16, 4, 2, 3
# Weights drawn 10x wider than the default: at the default init a tiny model's outputs hardly depend on the
# context (~1e-4), too little for the proofs below to tell packing with and without the mask apart (here ~1e-2).
WIDE = dict(initializer_range=0.2)
MODELS = {"gpt": get_config("nano-gpt").replace(**WIDE), "llama": get_config("nano-llama").replace(**WIDE),
          "gemma2": get_config("nano-llama").replace(sliding_window=3, attn_softcap=1.0, **WIDE,
                                                     layer_types=["sliding_attention", "full_attention"]),
          # experts route each token alone: packing changes nothing there. (Without the router loss: it is one
          # per forward, and the reference runs all examples in one forward where the layouts run micro-batches;
          # for the same examples packed and padded it is equal: tests/test_moe_padding.py.)
          "mixtral": get_config("nano-mixtral").replace(output_router_logits=False, **WIDE)}
LAYOUTS = {  # world size -> layouts
    1: [{}],
    2: [dict(tp=2, sp=True), dict(pp=2, recompute="full"), dict(cp=2), dict(cp=2, mode="a2a", recompute="selective")],
}
PROOFS = [dict(unmasked=True), dict(positions="continued")]  # tp 1; each must differ from the reference


# -- the SFT data: one set of examples, packed and padded -----------------------------------------------------------

def _examples(cfg) -> list:
    g = np.random.default_rng(5)
    out = []
    for n in [*g.integers(2, 11, 45), SEQ + 4, SEQ + 2]:  # two longer than SEQ + 1: truncated on both sides
        prompt = int(g.integers(0, n - 1))
        out.append((g.integers(0, cfg.vocab_size, n).tolist(), [i > prompt and g.random() > 0.2 for i in range(n)]))
    return out


def step_batches(cfg, step: int) -> tuple[dict, dict]:
    """(4 packed rows, the same examples one per padded row) of optimizer step `step`."""
    with warnings.catch_warnings():  # examples without a trained token are dropped (the same on both sides)
        warnings.simplefilter("ignore")
        packed, padded = PackedSFTDataset(_examples(cfg), SEQ, 0), PaddedSFTDataset(_examples(cfg), SEQ, 0)
    assert len(packed) >= STEPS * ROWS
    rows = np.random.default_rng(0).permutation(len(packed))[step * ROWS: (step + 1) * ROWS]  # as a loader would
    return (collate_long([packed[i] for i in rows]),
            collate_long([padded[j] for i in rows for j in packed.rows[i]]))


def reference(model: str) -> dict:
    cfg = MODELS[model]
    net = Transformer(cfg, seed=SEED)
    opt = make_optimizer(net.parameters())
    losses, grads = [], {}
    for step in range(STEPS):
        _, batch = step_batches(cfg, step)
        opt.zero_grad(set_to_none=True)
        per_token = net(Inputs(batch["input_ids"], labels=batch["labels"]))
        (per_token.sum() / (batch["labels"] != -100).sum()).backward()
        losses.append(per_token.sum().item())
        if step == 0:
            grads = {n: _full(n, p.grad.clone(), cfg) for n, p in net.named_parameters()}
        opt.step()
    params = {n: _full(n, p.detach(), cfg) for n, p in net.named_parameters()}
    return {"loss_sum": losses, "grads": grads, "params": params}


def run_layout(model: str, layout: dict) -> dict:
    cfg = MODELS[model]
    tp, cp, pp, sp = (layout.get(k, 1) for k in ("tp", "cp", "pp", "sp"))
    dims = tpzoo.init_parallel(tp=tp, cp=cp, pp=pp)
    try:
        chunks = build_model_chunks(cfg, dims, sequence_parallel=bool(sp), seed=SEED,
                                    cp_mode=layout.get("mode", "ring"), recompute=layout.get("recompute", "none"))
        params = list({id(p): p for c in chunks for p in c.parameters()}.values())
        opt, main_grads = make_optimizer(params), GradBuffer(params, device=dims.device)
        losses, grads = [], {}
        for step in range(STEPS):
            batch, _ = step_batches(cfg, step)
            if layout.get("unmasked"):  # packing as it was: attention and positions span the examples
                batch = {k: batch[k] for k in ("input_ids", "labels")}
            if layout.get("positions") == "continued":
                batch["position_ids"] = torch.arange(SEQ).expand(ROWS, SEQ)
            tokens = int((batch["labels"] != -100).sum())
            mbs = [shard_batch({k: v[i: i + MICRO] for k, v in batch.items()}, dims, bool(sp))
                   for i in range(0, ROWS, MICRO)]
            main_grads.zero()
            out = forward_backward(chunks, mbs, dims, loss_scale=1.0 / tokens)
            finalize_grads(chunks, dims)
            main_grads.reduce(dims.grad_group)
            for p in params:
                p.grad = p.main_grad
            total = torch.tensor([out["loss_sum"]], dtype=torch.float64)
            comm.all_reduce(total, dims.grad_group)  # cp ranks hold parts of every sequence
            losses.append(float(total))
            if step == 0:
                grads = _gathered(chunks, cfg, grad=True)
            opt.step()
        return {"loss_sum": losses, "grads": grads, "params": _gathered(chunks, cfg, grad=False)}
    finally:
        tpzoo.destroy_parallel()


def run_layouts(model: str, layouts: list[dict]) -> list:
    return [run_layout(model, layout) for layout in layouts]


def _assert_equal_training(ref: dict, per_rank: list, cfg, what: str) -> None:
    tied = lambda n: "embed.weight" if cfg.tie_embeddings and n == "lm_head.weight" else n  # noqa: E731
    merged = set()
    for res in per_rank:
        assert res["loss_sum"] == pytest.approx(ref["loss_sum"], rel=1e-5), what
        for name in res["grads"]:
            assert_close(res["grads"][name], ref["grads"][tied(name)], f"{what} grad {name}")
            assert_close(res["params"][name], ref["params"][tied(name)], f"{what} after {STEPS} steps: {name}")
            merged.add(tied(name))
    assert merged == set(ref["grads"]), f"{what}: no rank holds {set(ref['grads']) - merged}"


@pytest.mark.parametrize("model", list(MODELS))
def test_packed_sft_equals_unpacked_training(model):
    cfg = MODELS[model]
    ref = reference(model)
    proofs = PROOFS if model == "gpt" else PROOFS[:1]
    for world, layouts in LAYOUTS.items():
        if cfg.attn_softcap:  # ring attention refuses soft-capping
            layouts = [lay for lay in layouts if not (lay.get("cp") and lay.get("mode") != "a2a")]
        if cfg.num_experts:  # the expert layer's own parallelism is tp (etp = tp)
            layouts = [lay for lay in layouts if set(lay) <= {"tp", "sp"}]
        per_rank = run_on_ranks(world, run_layouts, model, layouts + (proofs if world == 1 else []))
        for i, layout in enumerate(layouts):
            _assert_equal_training(ref, [r[i] for r in per_rank], cfg, f"{model} {layout or 'tp 1'}")
        for i, proof in enumerate(proofs if world == 1 else [], start=len(layouts)):
            got = per_rank[0][i]["loss_sum"][0]
            assert abs(got - ref["loss_sum"][0]) > 1e-3 * abs(ref["loss_sum"][0]), (model, proof, got)


# -- pretraining with --document-masking ----------------------------------------------------------------------------

@pytest.fixture(scope="module")
def short_docs(tmp_path_factory):
    """A token store of many short documents (1..40 bytes): most 32-token windows hold several."""
    g = np.random.default_rng(0)
    docs = ["".join(chr(97 + c) for c in g.integers(0, 26, n)) for n in g.integers(1, 40, 120)]
    return str(preprocess(docs, "byte", tmp_path_factory.mktemp("docs") / "store").path)


def _per_document_reference(cfg, steps: int) -> tuple[list, list]:
    """Losses and gradient norms of one process training each window's document pieces alone (lr 0)."""
    from tpzoo.data import ResumableLoader
    from tpzoo.train.data import build_datasets
    from tpzoo.train.run_model import resolve_run_model

    run = resolve_run_model(cfg, resume=None)
    tok, net = run.tokenizer, Transformer(run.config, seed=cfg.seed)
    train_ds, _, _ = build_datasets(cfg, tok)
    loader = ResumableLoader(train_ds, cfg.global_batch_size, seed=cfg.seed, prefetch=0)
    losses, norms, pieces = [], [], 0
    for _ in range(steps):
        batch = next(loader)
        ids, labels = [], []
        for row in range(batch["input_ids"].shape[0]):
            for d in batch["doc_ids"][row].unique():
                at = batch["doc_ids"][row] == d
                n = int(at.sum())
                ids.append(F.pad(batch["input_ids"][row][at], (0, cfg.seq_len - n)))
                labels.append(F.pad(batch["labels"][row][at], (0, cfg.seq_len - n), value=-100))
        pieces += len(ids) - batch["input_ids"].shape[0]
        labels = torch.stack(labels)
        net.zero_grad(set_to_none=True)
        per_token = net(Inputs(torch.stack(ids), labels=labels))
        loss = per_token.sum() / (labels != -100).sum()
        loss.backward()
        losses.append(loss.item())
        norms.append(float(torch.nn.utils.get_total_norm([p.grad for p in net.parameters()])))
    assert pieces > steps * 4  # the windows really hold several documents
    return losses, norms


def test_pretrain_document_masking_equals_per_document_training(short_docs):
    kw = dict(seq_len=32, global_batch_size=4, micro_batch_size=2, steps=2, lr=0.0, min_lr=0.0,
              document_masking=True)
    losses, norms = _per_document_reference(tiny(short_docs, **kw), 2)
    for world, layout in [(1, {}), (2, dict(tp=2, sequence_parallel=True)), (2, dict(tp=1, cp=2))]:
        got = run_on_ranks(world, _train, tiny(short_docs, **kw, **layout))[0]
        assert got["losses"] == pytest.approx(losses, rel=1e-5), layout
        assert got["grad_norms"] == pytest.approx(norms, rel=1e-5), layout
    plain = run_on_ranks(1, _train, tiny(short_docs, **dict(kw, document_masking=False)))[0]
    # the mask is what makes them equal (at nano-gpt's default init the context moves the loss by ~6e-4 only)
    assert abs(plain["losses"][0] - losses[0]) > 1e-4 * losses[0]


def test_document_masking_is_a_pretraining_option():
    from tpzoo.errors import ConfigError
    from tpzoo.train import load_config

    with pytest.raises(ConfigError, match="SFT packing always keeps attention within each example"):
        load_config(None, dict(task="sft", data=["x.jsonl"], document_masking=True)).validate()


# -- the attention paths --------------------------------------------------------------------------------------------

def _doc_ids(b: int, s: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.rand(b, s, generator=g) < 0.25).long().cumsum(1)  # runs of random lengths, ids from 0


def _per_document(q, k, v, ids, window, softcap):
    """Each document's attention on its own (its positions 0..n-1): what the mask must reproduce."""
    out = torch.zeros_like(q)
    for row in range(q.shape[0]):
        for d in ids[row].unique():
            at = (ids[row] == d).nonzero().flatten()
            n = len(at)
            pos = torch.arange(n)
            mask = pos[None] <= pos[:, None]
            if window is not None:
                mask &= pos[:, None] - pos[None] < window
            qd, kd, vd = (t[row: row + 1, :, at] for t in (q, k, v))
            out[row, :, at] = (softcapped_attention(qd, kd, vd, mask, None, softcap) if softcap else
                               F.scaled_dot_product_attention(qd, kd, vd, attn_mask=mask, enable_gqa=True))[0]
    return out


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
@pytest.mark.parametrize("window,softcap", [(None, None), (3, None), (None, 2.0), (4, 2.0)])
def test_document_attention_is_per_document_attention(window, softcap):
    g = torch.Generator().manual_seed(1)
    b, s = 3, 20
    q, k, v = (torch.randn(b, h, s, 8, generator=g) for h in (4, 2, 2))
    ids = _doc_ids(b, s, 2)
    want = _per_document(q, k, v, ids, window, softcap)
    docs = Documents(ids)
    torch.testing.assert_close(document_attention(q, k, v, docs, window=window, softcap=softcap), want,
                               rtol=1e-5, atol=1e-6)
    assert docs.additive(window, q.dtype) is docs.additive(window, q.dtype)  # one mask for every layer
    flex = document_attention(q, k, v, docs, window=window, softcap=softcap, impl="flex")  # eager: forward only
    torch.testing.assert_close(flex, want, rtol=1e-5, atol=1e-6)
    starts = torch.ones_like(ids, dtype=torch.bool)
    starts[:, 1:] = ids[:, 1:] != ids[:, :-1]
    pos = document_positions(ids)
    assert (pos[starts] == 0).all() and (pos[:, 1:][~starts[:, 1:]] == pos[:, :-1][~starts[:, 1:]] + 1).all()


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
def test_a_flex_path_that_cannot_run_falls_back_to_the_exact_path(monkeypatch):
    """The fused path is tried once per kind of call before it is taken. The CPU stands in for a GPU whose
    FlexAttention kernel does not compile: it has FlexAttention's forward but not its backward, so in training the
    trial fails (one warning, the exact path, the same gradients) and in inference it passes (flex taken)."""
    from tpzoo.models.kinds import document_attention as documents

    monkeypatch.setattr(documents, "flex_available", lambda q: True)
    monkeypatch.setattr(documents, "_FLEX_WORKS", {})
    tried = []
    real = documents._flex_attention
    monkeypatch.setattr(documents, "_flex_attention", lambda *a: tried.append(a[0].requires_grad) or real(*a))
    g = torch.Generator().manual_seed(2)
    q, k, v = (torch.randn(2, h, 16, 8, generator=g) for h in (4, 2, 2))
    ids = _doc_ids(2, 16, 2)
    want = _per_document(q, k, v, ids, None, None)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    with pytest.warns(UserWarning, match="FlexAttention cannot run document masking.*head dim 8, training"):
        out = document_attention(*leaves, Documents(ids))
    torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-6)
    out.backward(torch.ones_like(out))  # the exact path's backward
    assert all(t.grad is not None for t in leaves) and tried == [True]
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        document_attention(*leaves, Documents(ids))  # decided: no second trial, no second warning
        assert tried == [True]
        with torch.no_grad():  # inference: the trial passes, then the call itself runs flex
            torch.testing.assert_close(document_attention(q, k, v, Documents(ids)), want, rtol=1e-5, atol=1e-6)
    assert tried == [True, False, False]
    assert not [w for w in seen if "FlexAttention cannot run" in str(w.message)]
    # under activation checkpointing (the trial runs inside the checkpointed forward, its own saved tensors kept
    # from the checkpoint's hooks): the same fallback, and recomputation in backward takes the exact path again
    monkeypatch.setattr(documents, "_FLEX_WORKS", {})
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    with pytest.warns(UserWarning, match="FlexAttention cannot run document masking"):
        out = torch.utils.checkpoint.checkpoint(lambda *a: document_attention(*a, Documents(ids)), *leaves,
                                                use_reentrant=False)
    out.backward(torch.ones_like(out))
    reference = [t.clone().requires_grad_() for t in (q, k, v)]
    document_attention(*reference, Documents(ids), impl="exact").backward(torch.ones_like(out))
    for got, want_grad in zip(leaves, reference):
        torch.testing.assert_close(got.grad, want_grad.grad, rtol=1e-5, atol=1e-6)


RING = [(12, None), (13, 3)]  # (sequence, window): 13 pads to 16, the padding a document of its own


def ring_cases() -> list:
    dims = tpzoo.init_parallel(cp=2)
    try:
        results = []
        for i, (s, window) in enumerate(RING):
            q, k, v, grad, ids = _ring_data(s, i)
            local = shard_batch({"input_ids": torch.zeros_like(ids), "doc_ids": ids}, dims)
            idx = local_positions(local["input_ids"].shape[1] // 2, 2, dims.cp_rank, "cpu")
            pad = lambda t: F.pad(t, (0, 0, 0, local["doc_ids"].shape[1] - s))  # noqa: E731
            mine = [pad(t).index_select(2, idx).clone().requires_grad_() for t in (q, k, v)]
            out = ring_attention(*mine, dims.cp_group, dims.ranks("cp"), dims.cp_rank, window=window,
                                 doc_ids=local["doc_ids"])
            out.backward(pad(grad).index_select(2, idx))
            results.append({"idx": idx, "out": out.detach(), "grads": [t.grad for t in mine]})
        return results
    finally:
        tpzoo.destroy_parallel()


def _ring_data(s: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    q, k, v, grad = (torch.randn(2, h, s, 8, generator=g, dtype=torch.float64) for h in (4, 2, 2, 4))
    return q, k, v, grad, _doc_ids(2, s, seed)


def test_ring_attention_within_documents():
    """Documents spanning the chunk boundaries: every cp rank's output and q/k/v gradients equal masked
    attention over the whole sequence (fp64)."""
    per_rank = run_on_ranks(2, ring_cases)
    for i, (s, window) in enumerate(RING):
        q, k, v, grad, ids = _ring_data(s, i)
        q, k, v = (t.clone().requires_grad_() for t in (q, k, v))
        want = document_attention(q, k, v, Documents(ids), window=window)
        want.backward(grad)
        for r in per_rank:
            real = r[i]["idx"] < s
            for got, ref in zip([r[i]["out"], *r[i]["grads"]], [want.detach(), q.grad, k.grad, v.grad]):
                torch.testing.assert_close(got[:, :, real], ref[:, :, r[i]["idx"][real]], rtol=1e-9, atol=1e-9)


def test_batches_without_documents_keep_the_causal_path(monkeypatch):
    """Training, eval and generation batches without doc_ids never reach the document path; a batch of one
    document per row gives what the plain path gives; decoding with a KV cache refuses doc_ids."""
    from tpzoo.generation import generate
    from tpzoo.models.kinds import attention_core

    net = Transformer(MODELS["llama"], seed=SEED)
    ids = torch.randint(0, 97, (2, SEQ), generator=torch.Generator().manual_seed(0))
    with_docs = net(Inputs(ids, doc_ids=torch.zeros_like(ids)))
    monkeypatch.setattr(attention_core, "document_attention", lambda *a, **k: pytest.fail("document path taken"))
    torch.testing.assert_close(net(ids), with_docs, rtol=1e-5, atol=1e-6)
    net(Inputs(ids, labels=ids)).sum().backward()
    generate(net, ids[:1, :4], 3)
    with pytest.raises(ValueError, match="KV cache"):
        net(Inputs(ids, doc_ids=torch.zeros_like(ids)), net.new_cache(2, SEQ))


def test_one_mask_per_micro_batch_is_all_the_memory_masking_adds():
    """On CPU the exact path keeps one [b, 1, S, S] mask per micro-batch (saved by every layer, built once), and
    the rotary tables are per row (positions restart per document): nothing per layer; the rest of what the
    forward leaves for the backward is what an unpacked batch leaves."""
    from tpzoo import kernels as K
    from tpzoo.plan.measure import live_activation_bytes

    net = Transformer(MODELS["llama"].replace(num_layers=3), seed=SEED)
    ids = torch.randint(0, 97, (2, SEQ), generator=torch.Generator().manual_seed(0))
    docs = _doc_ids(2, SEQ, 3)
    live = {}
    with K.use_backend("torch"):
        for name, kw in (("plain", {}), ("docs", {"doc_ids": docs})):
            with live_activation_bytes(list(net.parameters()) + [ids, docs]) as live[name]:
                loss = net(Inputs(ids, labels=ids, **kw)).sum()
            del loss
    mask = 2 * SEQ * SEQ * 4  # one fp32 [b, 1, S, S] mask for every layer
    rotary = 2 * (2 - 1) * SEQ * net.cfg.attention.rotary_dim // 2 * 4  # cos, sin per row ([b, S, .]) instead of one row
    assert live["docs"].total - live["plain"].total == mask + rotary
