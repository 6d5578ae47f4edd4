"""Self-speculative decoding with the multi-token-prediction depths as the draft (tpzoo.speculative), on the tiny
DeepSeek-V3 (two depths, MLA's latent cache cut back) and Qwen3-Next (one depth, a Gated DeltaNet state restored
and replayed) checkpoints of tests/mtp_models.py, fp32:

- greedy: the output equals plain greedy decoding token for token (stopping at an eos as it does), with the real
  depths drafting (random weights: rejections) and with an oracle draft that is right except where it is made wrong (acceptances of every length,
  so each cache is cut back after kept drafts too); each step's drafts equal the depths run from scratch over the
  committed tokens (no cache), whatever was kept before;
- at tp 2 and pp 2 (2 gloo ranks, one pool call) the same tokens as one process;
- sampling: speculative sampling's emitted tokens are distributed as the model's (accept_drafts against p, many
  draws); a fixed seed gives the same output twice; top_k 1 gives greedy's.
"""
import pytest
import torch
from mtp_models import KINDS, VOCAB, write_checkpoint

import tpzoo
from tpzoo import speculative
from tpzoo.checkpoint import load_model
from tpzoo.generation import generate
from tpzoo.models import Inputs, LossOptions
from tpzoo.speculative import accept_drafts, generate_with_mtp
from tpzoo.testing import run_on_ranks

NEW = 8


def _prompt(kind):  # (seeds whose greedy continuation does not settle into repeating one token)
    seed = {"deepseek_v3": 7, "qwen3_next": 4}[kind]
    return torch.randint(0, VOCAB[kind], (1, 5), generator=torch.Generator().manual_seed(seed))


@pytest.fixture(scope="module")
def paths(tmp_path_factory):
    out = {}
    for kind in KINDS:
        path = tmp_path_factory.mktemp(kind) / "hf"
        write_checkpoint(kind, path)
        out[kind] = str(path)
    return out


def _from_scratch(model, seq: list[int]) -> list[int]:
    """The depths' greedy drafts after the committed tokens `seq`, computed without any cache: the main model over
    seq[:-1] (its newest token is not in it yet), then each depth over every position."""
    n, depths = len(seq) - 1, model.cfg.mtp_depths
    ids = torch.tensor([seq[:-1]])
    _, hidden = model(Inputs(ids=ids), loss=LossOptions(hidden=True))
    drafts = []
    for k in range(1, depths + 1):
        tokens = [seq[i + k] if i + k <= n else drafts[i + k - n - 1] for i in range(n)]
        cache = model.mtp.new_caches(1, n + 1)[k - 1]
        hidden, last = model.mtp.draft(model, k - 1, hidden, torch.tensor([tokens]), cache)
        drafts.append(int(last[0].argmax()))
    return drafts


@pytest.mark.parametrize("kind", KINDS)
def test_greedy_drafts_equal_plain_greedy(paths, kind, monkeypatch):
    model = load_model(paths[kind])
    prompt = _prompt(kind)
    plain = generate(model, prompt, NEW)
    out, stats = generate_with_mtp(model, prompt, NEW)
    assert torch.equal(out, plain)
    assert stats["steps"] > 0 and stats["drafted"] == stats["steps"] * model.cfg.mtp_depths
    eos = int(plain[0, prompt.shape[1] + 3])  # a token greedy decoding produces: both stop after it
    stopped = generate(model, prompt, NEW, eos_token_id=eos)
    assert stopped.shape[1] < plain.shape[1] and torch.equal(generate_with_mtp(model, prompt, NEW,
                                                                               eos_token_id=eos)[0], stopped)

    # an oracle draft (plain's next tokens, one made wrong every third step) beside the real depths' own drafts,
    # which must equal the depths run from scratch
    real, calls = speculative._Drafter.draft, []

    def oracle(self, seq, hidden, first, pick):
        drafts, logits = real(self, seq, hidden, first, pick)
        with torch.no_grad():
            assert drafts == _from_scratch(self.model, seq), (len(seq), drafts)
        want = plain[0, len(seq):len(seq) + len(drafts)].tolist()
        want += [0] * (len(drafts) - len(want))
        calls.append(len(calls))
        if len(calls) % 3 == 0:
            want[-1] = (want[-1] + 1) % VOCAB[kind]
        return want, logits

    monkeypatch.setattr(speculative._Drafter, "draft", oracle)
    out, stats = generate_with_mtp(model, prompt, NEW)
    assert torch.equal(out, plain)
    assert 0 < stats["accepted"] < stats["drafted"] and stats["steps"] < NEW - 1


def _on_ranks(paths):
    out = []
    for layout in (dict(tp=2), dict(pp=2)):
        tpzoo.init_parallel(**layout)
        try:
            for kind, path in paths.items():
                out.append((layout, kind, generate_with_mtp(load_model(path), _prompt(kind), NEW)[0]))
        finally:
            tpzoo.destroy_parallel()
    return out


def test_tp2_and_pp2_draft_the_same_tokens(paths):
    want = {kind: generate(load_model(path), _prompt(kind), NEW) for kind, path in paths.items()}
    for rank in run_on_ranks(2, _on_ranks, paths):
        for layout, kind, got in rank:
            assert torch.equal(got, want[kind]), (layout, kind)


def test_speculative_sampling_keeps_the_distribution():
    g = torch.Generator().manual_seed(0)
    vocab, depths, n = 4, 2, 6000
    p = torch.softmax(torch.randn(depths + 1, vocab, generator=g) * 1.5, -1)
    q = torch.softmax(torch.randn(depths, vocab, generator=g) * 1.5, -1)
    first = torch.zeros(vocab)
    second = torch.zeros(vocab)  # the second token emitted, when the first draft was kept
    kept_first = 0
    for _ in range(n):
        drafts = torch.multinomial(q, 1, generator=g)[:, 0]
        kept, nxt = accept_drafts(drafts, q, p, g)
        emitted = drafts[:kept].tolist() + [nxt]
        first[emitted[0]] += 1
        if kept >= 1:
            kept_first += 1
            second[emitted[1]] += 1
    assert (first / n - p[0]).abs().max() < 0.025, (first / n, p[0])
    # given the first token, the second is a draw from p[1] (the model's next distribution)
    assert (second / kept_first - p[1]).abs().max() < 0.04, (second / kept_first, p[1])


def test_sampling_at_a_fixed_seed(paths):
    model = load_model(paths["deepseek_v3"])
    prompt = _prompt("deepseek_v3")
    a = generate_with_mtp(model, prompt, NEW, greedy=False, temperature=0.9, seed=7)[0]
    b = generate_with_mtp(model, prompt, NEW, greedy=False, temperature=0.9, seed=7)[0]
    assert torch.equal(a, b) and a.shape == (1, 5 + NEW)
    top1 = generate_with_mtp(model, prompt, NEW, greedy=False, temperature=0.9, top_k=1, seed=7)[0]
    assert torch.equal(top1, generate(model, prompt, NEW))
