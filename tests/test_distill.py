"""Top-K distillation (tpzoo.post.distill) against a dense reference written from the formulas on transformers'
models, restricted to the same top K: the loss (1e-6) and every gradient (float64, 1e-6) at tp 2 + SP (the
vocabulary split: only the K ids and their log-probabilities cross ranks), pp 2 and cp 2, with a teacher of another
family (Qwen2 teaching Llama); the vocabulary-parallel top K and log-softmax at ids alone at tp 2; a cache written by
`tpzoo distill-cache` gives the live teacher's loss; bad input is one line with nothing written."""
import json
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from tpzoo.data.sft import PackedSFTDataset
from tpzoo.post.distill import LiveTeacher, distill_pass
from tpzoo.testing import run_on_ranks

from hf_models import VOCAB, save_hf_model
from post_helpers import (assert_grads, at_layout, backward_and_gather, cli_on_rank, grads_in_tpzoo_names, hf_model,
                          load, rank_batches)
from preflight_helpers import cli, one_error_line

SEQ, K, T, ALPHA = 24, 5, 2.0, 0.7
LAYOUTS = [dict(tp=2, sp=True), dict(pp=2), dict(cp=2)]
SETTINGS = SimpleNamespace(distill_topk=K, distill_temperature=T, distill_alpha=ALPHA, label_smoothing=0.0,
                           z_loss=0.0, schedule="1f1b")


def make_examples(rows: int = 4, seed: int = 4) -> list:
    """SFT examples of random ids, a prompt (untrained) and a response (trained), as many as fill `rows` packed
    sequences (whole micro-batches at every layout)."""
    g = torch.Generator().manual_seed(seed)
    out = []
    while len(out) < 2 or len(PackedSFTDataset(out, SEQ, pad_id=0)) % rows:
        p, r = (int(torch.randint(lo, hi, (1,), generator=g)) for lo, hi in ((2, 6), (2, 7)))
        ids = torch.randint(0, VOCAB, (p + r,), generator=g).tolist()
        out.append((ids, [False] * p + [True] * r))
    return out


def hf_distill(student, teacher, examples) -> float:
    """The loss written from the formulas, dense: the teacher's top K of its full softmax, renormalized at T; the
    student's log-softmax over its whole vocabulary at T; T^2-scaled KL and the next-token loss, mixed by alpha,
    averaged over the trained tokens. Backward into `student`."""
    total, n = 0.0, 0
    for ids, mask in examples:
        ids, mask = torch.tensor(ids), torch.tensor(mask[1:])
        z = student(ids[None]).logits[0, :-1].double()
        with torch.no_grad():
            top = torch.log_softmax(teacher(ids[None]).logits[0, :-1].double(), -1).topk(K, -1)
        log_p = torch.log_softmax(top.values / T, -1)
        log_q = torch.log_softmax(z / T, -1).gather(-1, top.indices)
        kl = (log_p.exp() * (log_p - log_q)).sum(-1)
        ce = F.cross_entropy(z, ids[1:], reduction="none")
        total = total + ((ALPHA * T * T * kl + (1 - ALPHA) * ce) * mask).sum()
        n += int(mask.sum())
    loss = total / n
    loss.backward()
    return loss.item()


def _distill_layouts(dirs, examples, layouts) -> list:
    dataset = PackedSFTDataset(examples, SEQ, pad_id=0)
    tokens = sum(int(sum(m[1:])) for _, m in examples)

    def run(dims, lay):
        teacher = LiveTeacher(load(dirs["teacher"], dims, lay, frozen=True), dims, K)
        chunks = load(dirs["student"], dims, lay)
        batches = rank_batches(dataset, dims, lay.get("sp", False))

        def step():
            teacher.run(batches)
            return distill_pass(chunks, batches, dims, SETTINGS, teacher, scale=1 / tokens)[0]

        loss, grads = backward_and_gather(chunks, dims, step, main_grads=False)
        return [{"layout": lay, "rank": dims.rank, "loss": loss / tokens, "grads": grads}]
    return [r for lay in layouts for r in at_layout(lay, run)]


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("distill")
    save_hf_model("llama", root / "student")
    save_hf_model("qwen2", root / "teacher")
    return {"student": root / "student", "teacher": root / "teacher"}


def test_sparse_kl_and_gradients_match_a_dense_top_k_reference(models, tmp_path):
    examples = make_examples()
    results = run_on_ranks(2, _distill_layouts, models, examples, LAYOUTS)
    student = hf_model(models["student"])
    want = hf_distill(student, hf_model(models["teacher"]), examples)
    want_grads = grads_in_tpzoo_names(student, tmp_path / "grads")
    for lay in LAYOUTS:
        ranks = [r for per_rank in results for r in per_rank if r["layout"] == lay]
        for r in ranks:
            assert r["loss"] == pytest.approx(want, rel=1e-6), lay
        assert_grads(ranks, want_grads, f"distill at {lay}", rtol=1e-6)


def _vocab_ops(z_full, ids):
    """At tp 2, each rank its half of the vocabulary (102 = 101 real + 1 padding): top K and log-softmax at ids."""
    import tpzoo
    from tpzoo.parallel.vocab_topk import vocab_parallel_log_softmax_at, vocab_parallel_topk

    dims = tpzoo.init_parallel(tp=2)
    try:
        shard = torch.cat([z_full, torch.zeros(*z_full.shape[:-1], 1, dtype=z_full.dtype)], -1).chunk(2, -1)
        shard = shard[dims.tp_rank].clone().requires_grad_()
        top_ids, top_lp = vocab_parallel_topk(shard, K, VOCAB)
        logq = vocab_parallel_log_softmax_at(shard, ids, T, VOCAB)
        logq.mul(torch.arange(1.0, K + 1, dtype=logq.dtype)).sum().backward()
        return {"ids": top_ids, "lp": top_lp, "logq": logq.detach(), "grad": shard.grad}
    finally:
        tpzoo.destroy_parallel()


def test_vocab_parallel_top_k_and_log_softmax_at_ids():
    g = torch.Generator().manual_seed(0)
    z = torch.randn(3, 4, VOCAB, generator=g, dtype=torch.float64)
    ids = torch.randint(0, VOCAB, (3, 4, K), generator=g)
    a, b = run_on_ranks(2, _vocab_ops, z, ids)
    lp = torch.log_softmax(z, -1)
    top = lp.topk(K, -1)
    zz = z.clone().requires_grad_()
    logq = torch.log_softmax(zz / T, -1).gather(-1, ids)
    logq.mul(torch.arange(1.0, K + 1, dtype=logq.dtype)).sum().backward()
    for r in (a, b):
        assert torch.equal(r["ids"], top.indices)
        torch.testing.assert_close(r["lp"], top.values.float(), rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(r["logq"], logq.detach(), rtol=1e-12, atol=1e-12)
    grad = torch.cat([a["grad"], b["grad"]], -1)
    torch.testing.assert_close(grad[..., :VOCAB], zz.grad, rtol=1e-12, atol=1e-12)
    assert not grad[..., VOCAB:].any()  # the padded entry gets nothing


# -- the cache, end to end; bad input -------------------------------------------------------------------------------

WORDS = "the quick brown fox jumps over the lazy dog".split()


@pytest.fixture(scope="module")
def tokenized(tmp_path_factory):
    """A student and a teacher (another family) sharing one tokenizer, and an SFT file in its words."""
    from checkpoint_helpers import write_hf

    root = tmp_path_factory.mktemp("cached")
    write_hf("llama", root / "student", tokenizer=True)
    save_hf_model("qwen2", root / "teacher")  # no tokenizer of its own: the student's is given where it matters
    sft = root / "sft.jsonl"
    sft.write_text("".join(json.dumps({"prompt": f"{WORDS[i % 9]} {WORDS[(i + 4) % 9]}",
                                       "response": f"{WORDS[(2 * i) % 9]} the {WORDS[(i + 1) % 9]} dog"}) + "\n"
                           for i in range(20)))
    return root


def _step_losses(cfgs) -> list:
    from tpzoo.train import train

    return [train(cfg)["losses"][0] for cfg in cfgs]


def test_the_cached_teacher_gives_the_live_teachers_loss(tokenized, tmp_path):
    from tpzoo.train import load_config

    cache = tmp_path / "top8"
    argv = ["distill-cache", "--teacher", tokenized / "teacher", "--data", tokenized / "sft.jsonl", "--out", cache,
            "--distill-topk", 8, "--seq-len", 40, "--tokenizer", tokenized / "student", "--tp", 2]
    (rc, out), _ = run_on_ranks(2, cli_on_rank, argv)  # the teacher's vocabulary split over 2 ranks
    assert rc == 0 and json.loads(out)["positions"] > 0
    meta = json.loads((cache / "index.json").read_text())
    assert meta["bytes_per_position"] == 64 and meta["records"] == 20
    import numpy as np

    ids, lp = (np.load(cache / f, mmap_mode="r") for f in ("ids.npy", "logprobs.npy"))
    assert ids.shape == lp.shape == (meta["positions"], 8) and ids.dtype == np.int32 and lp.dtype == np.float32

    def cfg(teacher, **kw):
        return load_config(None, dict(task="sft", objective="distill", teacher=str(teacher), base=str(tokenized /
                           "student"), data=[str(tokenized / "sft.jsonl")], seq_len=32, global_batch_size=4,
                           micro_batch_size=2, lr=0.0, steps=1, save="", sample_prompt="", quiet=True,
                           eval_fraction=0.0, prefetch=1, distill_topk=6, **kw))

    live, cached = run_on_ranks(2, _step_losses, [cfg(tokenized / "teacher", tp=1, pp=2),
                                                  cfg(cache, tp=2, sequence_parallel=True)])[0]
    assert cached == pytest.approx(live, rel=1e-6)


def test_bad_input_is_one_line_and_writes_nothing(tokenized, tmp_path, monkeypatch, capsys):
    from transformers import LlamaConfig, LlamaForCausalLM

    save = tmp_path / "run"
    prefs = tmp_path / "prefs.jsonl"
    prefs.write_text(json.dumps({"prompt": "the", "chosen": "fox", "rejected": "dog"}) + "\n"
                     + json.dumps({"prompt": "the", "chosen": "fox"}) + "\n")
    base = ["finetune", "--base", tokenized / "student", "--save", save, "--tp", "1"]
    rc, err = cli(monkeypatch, capsys, *base, "--data", prefs, "--objective", "dpo")
    one_error_line(rc, err, "finetune", "prefs.jsonl:2", "'rejected'")

    other = tmp_path / "other-vocab"
    LlamaForCausalLM(LlamaConfig(vocab_size=VOCAB + 20, hidden_size=32, intermediate_size=48, num_hidden_layers=1,
                                 num_attention_heads=2)).save_pretrained(other)
    sft = tokenized / "sft.jsonl"
    rc, err = cli(monkeypatch, capsys, *base, "--data", sft, "--objective", "distill", "--teacher", other)
    one_error_line(rc, err, "finetune", "vocabulary of 121", "the student 101")
    rc, err = cli(monkeypatch, capsys, *base, "--data", sft, "--objective", "distill", "--teacher",
                  tokenized / "teacher", "--distill-topk", "500")
    one_error_line(rc, err, "finetune", "--distill-topk 500", "(101)")
    assert not save.exists()

    out = tmp_path / "cache"
    rc, err = cli(monkeypatch, capsys, "distill-cache", "--teacher", tokenized / "teacher", "--data", sft, "--out",
                  out, "--distill-topk", "500")
    one_error_line(rc, err, "distill-cache", "--distill-topk 500", "101")
    assert not out.exists()
