"""The fused linear cross-entropy (tpzoo.kernels.linear_cross_entropy; the LM head's default loss path) against
the unfused head (logits, then the vocab-parallel cross-entropy), fp32 on CPU.

1. The op alone at tp = 1, 2, 4 (gloo ranks), with and without sequence parallelism: loss, hidden-state and
   head-weight gradients equal the dense single-process expression on the full weight (F.cross_entropy on the
   real vocabulary, + the z-loss) to 1e-5; label smoothing, ignore_index, z-loss, soft-capping, a padded
   vocabulary (a shard of padding only at tp = 4), several chunks, a uniform incoming gradient (the training
   loss: no recomputation) and per-token weights (the weight gradient recomputed).
2. Whole models, fused vs unfused, one training step through the executor into GradBuffer main grads: the loss
   and every parameter's main grad to 1e-5, at tp 1/2/4 (+SP), pp = 2 (1F1B, zero-bubble, GPipe), tied
   embeddings (nano-gpt) and Gemma 2's final soft-capping (a nano-llama with final_softcap), label smoothing,
   z-loss and SFT loss masks; the eval loss; LoRA (a frozen head: no weight gradient computed). The fused runs
   must never recompute.
3. Memory: the largest tensor and the peak of live bytes in a fused forward + backward are bounded by the chunk
   and do not grow with the number of tokens (the unfused path's grow with tokens x vocab).
The Triton per-chunk kernels are checked under Triton's interpreter in tests/test_kernels.py.
"""
import pytest
import torch
import torch.nn.functional as F

import tpzoo
from tpzoo import kernels as K
from tpzoo.kernels import fused_linear_cross_entropy as fused_module
from tpzoo.models import LossOptions, get_config
from tpzoo.parallel import GradBuffer, comm, padded_vocab_size
from tpzoo.pipeline import build_model_chunks, finalize_grads, forward_backward
from tpzoo.plan.measure import peak_live_bytes
from tpzoo.testing import run_on_ranks

from test_train import store  # noqa: F401 (the token-store fixture)

VOCAB, HIDDEN, B, S = 37, 16, 2, 8
CASES = [  # smoothing, z_loss, softcap, weighted (per-token gradient weights), chunk rows
    (0.0, 0.0, None, False, None),
    (0.1, 0.0, None, True, 5),
    (0.0, 1e-2, 4.0, False, 3),
    (0.1, 1e-2, 4.0, True, 7),
]


class _Recomputes:
    """Counts the recomputations of the weight gradient (the per-token-weights path)."""

    def __init__(self):
        self.calls, self.original = 0, fused_module._recomputed_weight_grad

    def __call__(self, *args):
        self.calls += 1
        return self.original(*args)


def _dense(h, w, t, smoothing, z_loss, softcap):
    z = F.linear(h, w[:VOCAB])
    if softcap:
        z = torch.tanh(z / softcap) * softcap
    loss = F.cross_entropy(z.reshape(-1, VOCAB), t.reshape(-1), label_smoothing=smoothing,
                           reduction="none").view(t.shape)
    return loss + z_loss * torch.logsumexp(z, -1).square() * (t != -100)


def _op_cases(tp: int, sp: bool) -> int:
    """On every rank: each CASE, fused over this rank's vocab (and sequence) shard vs the dense expression."""
    dims = tpzoo.init_parallel(tp=tp)
    vpad = padded_vocab_size(VOCAB, tp, 3)  # 37 -> 39, 42, 48: at tp=4 the last rank holds only padding
    counter = _Recomputes()
    fused_module._recomputed_weight_grad = counter
    try:
        for i, (smoothing, z_loss, softcap, weighted, rows) in enumerate(CASES):
            g = torch.Generator().manual_seed(i)
            h = (torch.randn(B, S, HIDDEN, generator=g)).requires_grad_()
            w = (torch.randn(vpad, HIDDEN, generator=g) * 0.5).requires_grad_()  # padded rows too: must not count
            t = torch.randint(0, VOCAB, (B, S), generator=g)
            t[0, :3] = -100  # an SFT prompt, and ignored tokens elsewhere
            t[1, 5] = -100
            t[1, 0], t[1, 1] = 0, VOCAB - 1
            weights = torch.rand(B, S, generator=g) if weighted else None
            ref = _dense(h, w, t, smoothing, z_loss, softcap)
            (ref * weights if weighted else ref * 0.37).sum().backward()

            x = h.detach().chunk(tp, dim=1)[dims.tp_rank] if sp else h.detach()
            x.requires_grad_()
            shard = w.detach().chunk(tp, dim=0)[dims.tp_rank].clone().requires_grad_()
            before = counter.calls
            loss = K.linear_cross_entropy(x, shard, t, label_smoothing=smoothing, z_loss=z_loss, softcap=softcap,
                                          vocab_size=VOCAB, sequence_dim=1 if sp else None, chunk_rows=rows)
            (loss * weights if weighted else loss.sum() * 0.37).sum().backward()
            assert counter.calls - before == int(weighted), (i, counter.calls - before)

            what = f"tp={tp} sp={sp} case {i}"
            torch.testing.assert_close(loss, ref.detach(), rtol=1e-5, atol=1e-5, msg=lambda m: f"{what} loss: {m}")
            grad_h = comm.all_gather(x.grad, dims.tp_group, dim=1) if sp else x.grad
            grad_w = comm.all_gather(shard.grad, dims.tp_group, dim=0)
            for got, want, name in ((grad_h, h.grad, "hidden"), (grad_w, w.grad, "weight")):
                torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5 * float(want.abs().max()),
                                           msg=lambda m: f"{what} grad {name}: {m}")
            assert torch.count_nonzero(grad_w[VOCAB:]) == 0
    finally:
        fused_module._recomputed_weight_grad = counter.original
        tpzoo.destroy_parallel()
    return tp


@pytest.mark.parametrize("tp,sp", [(1, False), (2, False), (2, True), (4, False), (4, True)])
def test_op_matches_dense_cross_entropy(tp, sp):
    assert run_on_ranks(4, _op_cases, tp, sp) == [tp] * 4


def test_no_grad_and_frozen_weight_compute_no_gradients():
    """Eval (no grad) and a frozen head (LoRA) skip the gradient work: no weight-sized fp32 buffer appears."""
    g = torch.Generator().manual_seed(0)
    h = torch.randn(4, 64, HIDDEN, generator=g, requires_grad=True)
    w = torch.randn(VOCAB, HIDDEN, generator=g)
    t = torch.randint(0, VOCAB, (4, 64), generator=g)
    with torch.no_grad(), peak_live_bytes() as r:
        K.linear_cross_entropy(h, w.requires_grad_(), t, chunk_rows=32)
    assert r.largest == 32 * VOCAB * 4  # one chunk's logits, nothing else that large
    w.requires_grad_(False)
    ref = K.cross_entropy(F.linear(h, w), t)
    (want,) = torch.autograd.grad(ref.sum(), h)
    (got,) = torch.autograd.grad(K.linear_cross_entropy(h, w, t, chunk_rows=32).sum(), h)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_bad_arguments_fail_early():
    h, w, t = torch.zeros(2, 3, 8), torch.zeros(10, 8), torch.zeros(2, 3, dtype=torch.long)
    with pytest.raises(ValueError, match="do not match"):
        K.linear_cross_entropy(h, w, t[:, :2])
    with pytest.raises(ValueError, match="does not take hidden states of size 8"):
        K.linear_cross_entropy(h, torch.zeros(10, 4), t)
    with pytest.raises(ValueError, match="softcap must be > 0"):
        K.linear_cross_entropy(h, w, t, softcap=0.0)
    with pytest.raises(ValueError, match="z_loss must be >= 0"):
        K.linear_cross_entropy(h, w, t, z_loss=-1.0)
    with pytest.raises(ValueError, match="label_smoothing"):
        K.linear_cross_entropy(h, w, t, label_smoothing=1.0)


def test_gradient_accumulation_fusion_adds_the_head_gradient_into_the_main_grad(monkeypatch):
    """With a GradBuffer that fuses (tpzoo.parallel.wgrad) the op hands autograd no weight gradient and adds its
    fp32 one into the main gradient: over two accumulated micro-batches, the uniform (training loss) and the
    per-token-weighted path, equal to the unfused main gradient bit for bit in fp32 (the same product and sum),
    to bf16's rounding in bf16 (unfused rounds the gradient to bf16 first). A retained graph's second backward
    adds the same gradient again (the saved fp32 gradient is not scaled in place). Small blocks: the scaled add
    runs in several (fused_linear_cross_entropy._add_scaled)."""
    monkeypatch.setattr(fused_module, "_ADD_BLOCK", 5 * HIDDEN)
    for dtype in (torch.float32, torch.bfloat16):
        for weighted in (False, True):
            g = torch.Generator().manual_seed(7)
            hs = [torch.randn(B, S, HIDDEN, generator=g).to(dtype) for _ in range(2)]
            w0 = (torch.randn(VOCAB, HIDDEN, generator=g) * 0.5).to(dtype)
            ts = [torch.randint(0, VOCAB, (B, S), generator=g) for _ in range(2)]
            weights = torch.rand(B, S, generator=g) if weighted else None
            main, handed = {}, {}
            for fuse in (True, False):
                w = w0.clone().requires_grad_()
                buf = GradBuffer([w], device=torch.device("cpu"), fuse=fuse)
                assert buf.fuse == fuse
                handed[fuse] = 0
                w.register_hook(lambda grad, f=fuse: handed.__setitem__(f, handed[f] + (grad is not None)))
                for h, t in zip(hs, ts):
                    loss = K.linear_cross_entropy(h.requires_grad_(), w, t, label_smoothing=0.1, chunk_rows=5)
                    (loss * weights if weighted else loss * 0.37).sum().backward()
                main[fuse] = w.main_grad.clone()
            what = (dtype, weighted)
            assert handed == {True: 0, False: 2}, what
            if dtype == torch.float32:
                assert torch.equal(main[True], main[False]), (what, (main[True] - main[False]).abs().max())
            else:
                torch.testing.assert_close(main[True], main[False], rtol=1e-2,
                                           atol=1e-2 * float(main[False].abs().max()))
    w = w0.float().clone().requires_grad_()
    buf = GradBuffer([w], device=torch.device("cpu"))  # noqa: F841 - kept: a dropped buffer lets w go
    loss = K.linear_cross_entropy(hs[0].float(), w, ts[0], chunk_rows=5).sum()
    loss.backward(retain_graph=True)
    once = w.main_grad.clone()
    loss.backward()
    assert torch.equal(w.main_grad, 2 * once)


# -- whole models, fused vs unfused ------------------------------------------------------------------------------

MODELS = {
    "gpt": get_config("nano-gpt"),  # tied embeddings (the head's gradient lands on the embedding), learned positions
    "softcap": get_config("nano-llama").replace(final_softcap=3.0, name="nano-llama-softcap"),  # untied, Gemma 2 cap
}
LAYOUTS = [dict(tp=1), dict(tp=2), dict(tp=2, sp=True), dict(tp=4), dict(tp=4, sp=True),
           dict(tp=2, pp=2, schedule="1f1b"), dict(tp=2, pp=2, sp=True, schedule="zb"),
           dict(tp=1, pp=2, schedule="gpipe"), dict(tp=2, lora=True)]
LOSS = dict(label_smoothing=0.1, z_loss=1e-3)


def _batches(cfg, dp_rank: int) -> list[dict]:
    """Two micro-batches of SFT-like data: a masked prompt of random length per sequence, some ignored tokens."""
    g = torch.Generator().manual_seed(10 + dp_rank)
    out = []
    for _ in range(2):
        ids = torch.randint(0, cfg.vocab_size, (B, S), generator=g)
        labels = torch.cat([ids[:, 1:], torch.full((B, 1), -100)], dim=1)
        for row in range(B):
            labels[row, : int(torch.randint(0, S // 2, (1,), generator=g))] = -100
        out.append({"input_ids": ids, "labels": labels})
    return out


def _one_step(model: str, layout: dict, dims, fused: bool) -> dict:
    from test_lora import LORA, randomize_b
    from tpzoo.models.lora import add_lora, init_lora

    cfg = MODELS[model]
    chunks = build_model_chunks(cfg, dims, sequence_parallel=layout.get("sp", False), seed=3)
    if layout.get("lora"):
        add_lora(chunks, LORA["all"])
        init_lora(chunks, 3)
        randomize_b(chunks)
    for c in chunks:
        if c.post_process:
            c.lm_head.chunk_rows = 5  # several chunks per micro-batch
    params = list({id(p): p for c in chunks for p in c.parameters() if p.requires_grad}.values())
    main_grads = GradBuffer(params, device=dims.device)
    batches = _batches(cfg, dims.dp_rank)
    tokens = sum(int((b["labels"] != -100).sum()) for b in batches)
    out = forward_backward(chunks, batches, dims, schedule=layout.get("schedule", "1f1b"), loss_scale=1.0 / tokens,
                           loss=LossOptions(**LOSS, fused=fused))
    finalize_grads(chunks, dims)
    evaluated = forward_backward(chunks, batches, dims, forward_only=True, loss=LossOptions(fused=fused))["loss_sum"]
    grads = {n: p.main_grad.clone() for c in chunks for n, p in c.named_parameters() if p.requires_grad}
    return {"loss": out["loss_sum"], "eval": evaluated, "grads": grads}


def _fused_vs_unfused(model: str, layout: dict) -> dict:
    dims = tpzoo.init_parallel(tp=layout["tp"], pp=layout.get("pp", 1))
    original = fused_module._recomputed_weight_grad

    def never(*args):
        raise AssertionError("the training loss recomputed the head's weight gradient")

    fused_module._recomputed_weight_grad = never
    try:
        return {"fused": _one_step(model, layout, dims, True), "unfused": _one_step(model, layout, dims, False)}
    finally:
        fused_module._recomputed_weight_grad = original
        tpzoo.destroy_parallel()


def _all_layouts(model: str) -> list:
    return [_fused_vs_unfused(model, layout) for layout in LAYOUTS]


@pytest.mark.parametrize("model", sorted(MODELS))
def test_training_step_matches_unfused_head(model):
    per_rank = run_on_ranks(4, _all_layouts, model)
    for rank, results in enumerate(per_rank):
        for layout, r in zip(LAYOUTS, results):
            what = f"{model} {layout} rank {rank}"
            f, u = r["fused"], r["unfused"]
            assert abs(f["loss"] - u["loss"]) <= 1e-5 * abs(u["loss"]), (what, f["loss"], u["loss"])
            assert abs(f["eval"] - u["eval"]) <= 1e-5 * abs(u["eval"]), (what, f["eval"], u["eval"])
            assert f["grads"].keys() == u["grads"].keys() and f["grads"], what
            for name, want in u["grads"].items():
                torch.testing.assert_close(f["grads"][name], want, rtol=1e-5, atol=1e-5 * float(want.abs().max()),
                                           msg=lambda m: f"{what} {name}: {m}")


# -- memory ------------------------------------------------------------------------------------------------------

def _peak(tokens: int, fused: bool, vocab: int = 2048, hidden: int = 32, rows: int = 64):
    g = torch.Generator().manual_seed(0)
    h = torch.randn(tokens, hidden, generator=g, requires_grad=True)
    w = torch.randn(vocab, hidden, generator=g, requires_grad=True)
    t = torch.randint(0, vocab, (tokens,), generator=g)
    with peak_live_bytes() as r:
        if fused:
            loss = K.linear_cross_entropy(h, w, t, label_smoothing=0.1, chunk_rows=rows)
        else:
            loss = K.cross_entropy(F.linear(h, w), t, label_smoothing=0.1)
        loss.sum().backward()
    return r


def test_memory_is_bounded_by_the_chunk():
    vocab, hidden, rows = 2048, 32, 64
    chunk_fp32 = rows * vocab * 4  # one chunk's logits in fp32 (the torch path's largest working tensor)
    small, large = _peak(256, True), _peak(1024, True)
    for r in (small, large):
        assert r.largest <= chunk_fp32, r.largest
    # 4x the tokens: the fused peak grows only by token-sized tensors ([tokens, h] and per-token vectors),
    # far less than one chunk of logits; the unfused one by the logits and their gradient (tokens x vocab)
    growth = large.peak - small.peak
    assert growth <= 768 * (4 * hidden * 4 + 64), growth
    unfused_small, unfused_large = _peak(256, False), _peak(1024, False)
    assert unfused_large.largest == 1024 * vocab * 4
    assert unfused_large.peak - unfused_small.peak >= 2 * 768 * vocab * 4
    assert large.peak < unfused_small.peak


# -- the training config ---------------------------------------------------------------------------------------

def _train_counting_fused_calls(cfg) -> tuple:
    from tpzoo.train import train

    calls, original = [], K.linear_cross_entropy
    K.linear_cross_entropy = lambda *a, **kw: calls.append(kw["z_loss"]) or original(*a, **kw)
    try:
        return train(cfg), len(calls), set(calls)
    finally:
        K.linear_cross_entropy = original


def test_config_keys_reach_the_run(store):
    """`fused_linear_cross_entropy` picks the head's path in a real run and `z_loss` reaches the loss of both
    paths (the fused one is called with it; the unfused run's losses equal the fused run's)."""
    from test_train import tiny

    runs = {}
    for fused in (True, False):
        cfg = tiny(store, steps=2, tp=2, sequence_parallel=True, fused_linear_cross_entropy=fused, z_loss=1e-3)
        result, calls, z_seen = run_on_ranks(2, _train_counting_fused_calls, cfg)[0]
        assert calls == (2 * 4 if fused else 0) and z_seen <= {1e-3}, (fused, calls, z_seen)  # 4 micro-batches
        runs[fused] = result
    assert runs[True]["losses"] == pytest.approx(runs[False]["losses"], rel=1e-5)
    assert runs[True]["grad_norms"] == pytest.approx(runs[False]["grad_norms"], rel=1e-4)
