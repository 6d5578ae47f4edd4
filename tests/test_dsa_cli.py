"""DeepSeek Sparse Attention's training options through the CLI, as a user types them: `tpzoo pretrain --base <a
DeepSeek-V3.2 HF directory>` at tp 2 + SP (dp inferred), on 2 pooled ranks (one call for both runs):

- with `--dsa-indexer-loss-scale 0.5` every step logs `dsa_indexer_loss` (metrics.jsonl; `indexer_kl` in the log
  line), positive, and the saved indexers moved away from the checkpoint's;
- without it (the default) nothing is logged for the indexers and the saved indexers are the checkpoint's, bit for
  bit, while the rest of the model trained;
- the scale on a model without sparse attention, or with LoRA, is refused in one line before any rank starts."""
import pytest
import torch

from dsa_models import make_hf_model
from preflight_helpers import cli, one_error_line
from test_cli_new_families import SHAPE, TEXT, _cli_on_rank, metrics
from tpzoo.testing import run_on_ranks


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    d = tmp_path_factory.mktemp("dsa_cli")
    make_hf_model("deepseek_v32", vocab=259).save_pretrained(d / "hf")  # the byte tokenizer's 259 tokens
    (d / "corpus.txt").write_text(TEXT.read_text())
    common = ["pretrain", "--base", str(d / "hf"), "--tp", "2", "--sequence-parallel", "--data",
              str(d / "corpus.txt"), "--steps", "2", "--lr", "1e-2", "--warmup-steps", "1",
              "--data-cache", str(d / "cache"), *SHAPE]
    argv = [[*common, "--dsa-indexer-loss-scale", "0.5", "--save", str(d / "trained")],
            [*common, "--save", str(d / "frozen")]]
    return d, run_on_ranks(2, _cli_on_rank, argv)


def _weights(path) -> dict:
    from tpzoo.checkpoint import load_model

    return {n: p.detach().clone() for n, p in load_model(str(path)).named_parameters()}


def test_indexer_loss_is_logged_and_trains_the_indexers_only_when_asked(runs):
    d, ranks = runs
    assert [rc for rc, _ in ranks[0]] == [0, 0], ranks[0]
    trained, frozen = metrics(d / "trained"), metrics(d / "frozen")
    assert [r["step"] for r in trained] == [1, 2]
    assert all(r["dsa_indexer_loss"] > 0 for r in trained), trained
    assert not any("dsa_indexer_loss" in r for r in frozen), frozen
    hf = _weights(d / "hf")
    indexer = [n for n in hf if ".indexer." in n]
    assert len(indexer) == 3 * 5  # every layer's wq_b, wk, k_norm (2), weights_proj
    moved = _weights(d / "trained" / "step_00000002")
    kept = _weights(d / "frozen" / "step_00000002")
    assert all(not torch.equal(moved[n], hf[n]) for n in indexer)
    out = "".join(o for r in ranks for _, o in r[:1])
    assert out.count("indexer_kl ") == 2, out  # the log line too
    assert all(torch.equal(kept[n], hf[n]) for n in indexer)
    assert not torch.equal(kept["layers.1.attn.q_b_proj.weight"], hf["layers.1.attn.q_b_proj.weight"])


def test_indexer_loss_scale_is_refused_where_it_cannot_act(runs, monkeypatch, capsys):
    d, _ = runs
    one_error_line(*cli(monkeypatch, capsys, "pretrain", "--model", "tiny-deepseek-v3", "--data", d / "corpus.txt",
                        "--dsa-indexer-loss-scale", "0.5"), "pretrain", "--dsa-indexer-loss-scale 0.5",
                   "no DeepSeek Sparse Attention layer")
    one_error_line(*cli(monkeypatch, capsys, "finetune", "--base", d / "hf", "--data", d / "corpus.txt",
                        "--lora-rank", "4", "--dsa-indexer-loss-scale", "0.5"), "finetune",
                   "--dsa-indexer-loss-scale 0.5 with LoRA")

