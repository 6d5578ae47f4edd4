"""Multi-token prediction through the CLI, the way users type it (defaults untouched: tp 2, dp inferred), on a tiny
DeepSeek-V3 Hugging Face directory with two MTP depths (tests/mtp_models.py, the byte tokenizer's vocabulary), in
one call of 2 pooled ranks (torchrun's environment):

- `finetune --base HF` trains the depths with the family's weight (0.1): `mtp_loss` on the step line, in
  metrics.jsonl and TensorBoard, `eval_mtp_loss` beside the held-out loss; the exported model's depths moved;
- `finetune --lora-rank 4` puts adapters on the depths' blocks and projection too, trained at tp 2 as at tp 1 (dp 2:
  both steps' loss and mtp_loss, 1e-5); `convert to-hf` writes them to the PEFT adapter under their HF names (model.layers.{n+j}.*; PEFT, asked about the main model's keys, loads those)
  and `--lora-from` that adapter reads every one back;
- `tpzoo eval` reports `mtp_loss`, equal to tpzoo.evaluation's in one process;
- `tpzoo generate --greedy --draft mtp` prints the continuation plain greedy decoding gives, the acceptance rate and
  both speeds;
- `pretrain --model nano-llama --mtp-layers 1` trains a depth on a family whose checkpoints hold none (checkpoints
  keep it); `convert to-hf` and `convert to-megatron` refuse it in one line, writing nothing;
- bad settings (ZeRO-3 with trained depths, --mtp-layers over a checkpoint's own, a weight without depths, a draft
  under sequence parallelism) are refused in one line before any rank starts.
"""
import json
from pathlib import Path

import pytest
import torch
from mtp_models import DEPTHS, MAIN_LAYERS, write_checkpoint
from preflight_helpers import cli, one_error_line
from test_cli_new_families import _cli_on_rank, metrics
from test_mtp_convert import _tensors

from tpzoo.testing import run_on_ranks

SHAPE = ["--seq-len", "48", "--global-batch-size", "4", "--micro-batch-size", "2", "--sample-prompt", "",
         "--log-interval", "1", "--warmup-steps", "1", "--lr", "1e-2"]
LORA_TARGETS = "q_a_proj,q_b_proj,kv_a_proj_with_mqa,kv_b_proj,o_proj,eh_proj"  # (PEFT reads DeepSeek's MLP names
# as the fused experts: tests/test_lora_peft.py)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    d = tmp_path_factory.mktemp("mtp_cli")
    write_checkpoint("deepseek_v3", d / "hf", vocab=259)
    sft = d / "sft.jsonl"
    sft.write_text("".join(json.dumps({"prompt": f"{w}?", "response": f"{w}!"}) + "\n"
                           for w in ("apple", "river", "stone", "cloud", "green", "tiger", "piano", "lemon") * 4))
    corpus = d / "corpus.txt"
    corpus.write_text(Path(json.__file__).read_text())
    tune = ["finetune", "--base", str(d / "hf"), "--data", str(sft), *SHAPE]
    step = str(d / "ft" / "step_00000002")
    argv = [[*tune, "--steps", "2", "--save", str(d / "ft"), "--eval-fraction", "0.25"],
            [*tune, "--steps", "2", "--save", str(d / "lora"), "--lora-rank", "4", "--lora-targets", LORA_TARGETS,
             "--eval-fraction", "0"],
            ["eval", step, "--text-file", str(sft), "--max-tokens", "200", "--seq-len", "16"],
            ["generate", step, "--prompt", "apple?", "--greedy", "--draft", "mtp", "--max-new-tokens", "8",
             "--ignore-eos", "--tp", "1"],
            ["generate", step, "--prompt", "apple?", "--greedy", "--draft", "mtp", "--max-new-tokens", "8",
             "--ignore-eos", "--tp", "1", "--json"],
            ["pretrain", "--model", "nano-llama", "--mtp-layers", "1", "--data", str(corpus), "--steps", "2",
             "--data-cache", str(d / "cache"), "--save", str(d / "llama"), *SHAPE, "--seq-len", "16"],
            [*tune, "--steps", "2", "--save", "", "--log-dir", str(d / "lora_tp1"), "--lora-rank", "4",
             "--lora-targets", LORA_TARGETS, "--eval-fraction", "0", "--tp", "1"]]
    return d, run_on_ranks(2, _cli_on_rank, argv)


def _rank0(runs, i):
    return runs[1][0][i]


def test_finetune_trains_the_depths_and_logs_mtp_loss(runs):
    d, ranks = runs
    rc, out = _rank0(runs, 0)
    assert rc == 0, out
    lines = [line for line in out.splitlines() if line.startswith("step ")]
    assert len(lines) == 2 and all("| mtp_loss " in line for line in lines), lines
    rows = [r for r in metrics(d / "ft") if "loss" in r]
    assert [r["step"] for r in rows] == [1, 2] and all(r["mtp_loss"] > 0 for r in rows)
    assert any(r.get("eval_mtp_loss", 0) > 0 for r in metrics(d / "ft")), metrics(d / "ft")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    tb = EventAccumulator(str(d / "ft")).Reload()
    assert [e.value for e in tb.Scalars("train/mtp_loss")] == pytest.approx([r["mtp_loss"] for r in rows], rel=1e-6)
    assert "eval/mtp_loss" in tb.Tags()["scalars"]
    # the exported model keeps both depths, moved by training
    from tpzoo.checkpoint import convert_to_hf

    convert_to_hf(str(d / "ft" / "step_00000002"), d / "ft_hf", progress=False)
    before, after = _tensors(d / "hf"), _tensors(d / "ft_hf")
    assert sorted(after) == sorted(before)
    n = MAIN_LAYERS["deepseek_v3"]
    for j in range(DEPTHS["deepseek_v3"]):
        name = f"model.layers.{n + j}.eh_proj.weight"
        assert not torch.equal(after[name], before[name]), name
    assert json.loads((d / "ft_hf" / "config.json").read_text())["num_nextn_predict_layers"] == 2


def test_lora_adapts_the_depths_and_exports_them_to_peft(runs):
    d, ranks = runs
    assert _rank0(runs, 1)[0] == 0, _rank0(runs, 1)
    assert _rank0(runs, 6)[0] == 0, _rank0(runs, 6)
    # tp 2 (the default) trains the adapters, the depths' included, as tp 1 (dp 2) does
    tp2, tp1 = ([r for r in metrics(d / name) if "loss" in r] for name in ("lora", "lora_tp1"))
    assert [r["step"] for r in tp2] == [1, 2] == [r["step"] for r in tp1]
    for key in ("loss", "mtp_loss"):
        assert [r[key] for r in tp2] == pytest.approx([r[key] for r in tp1], rel=1e-5), key
    from tpzoo.checkpoint import load_model
    from tpzoo.checkpoint.peft import export_peft, load_peft_adapters, read_peft_config
    from tpzoo.models.lora import add_lora

    ckpt = str(d / "lora" / "step_00000002")
    export_peft(ckpt, d / "peft")  # (what convert to-hf writes of a LoRA checkpoint, checked by PEFT)
    adapter = _tensors(d / "peft")
    n = MAIN_LAYERS["deepseek_v3"]
    for j in range(DEPTHS["deepseek_v3"]):
        for module in ("eh_proj", "self_attn.q_b_proj", "self_attn.o_proj"):
            key = f"base_model.model.model.layers.{n + j}.{module}.lora_B.weight"
            assert key in adapter and adapter[key].abs().max() > 0, key  # trained (B starts at zero)
    # read back: every adapter, the depths' included, equals the checkpoint's
    trained = load_model(ckpt)
    fresh = load_model(str(d / "hf"))
    add_lora([fresh], read_peft_config(d / "peft"))
    load_peft_adapters([fresh], d / "peft")
    ours = {k: p for k, p in trained.named_parameters() if ".lora." in k}
    back = {k: p for k, p in fresh.named_parameters() if ".lora." in k}
    assert sorted(ours) == sorted(back) and any(k.startswith("mtp.") for k in ours)
    for k, p in ours.items():
        assert torch.equal(p, back[k]), k


def test_eval_reports_mtp_loss(runs):
    from tpzoo.checkpoint import load_model
    from tpzoo.data.tokenizer import load_tokenizer
    from tpzoo.evaluation import evaluate

    d, ranks = runs
    rc, out = _rank0(runs, 2)
    assert rc == 0, out
    result = json.loads(out.strip().splitlines()[-1])
    step = str(d / "ft" / "step_00000002")
    tokens = torch.tensor(load_tokenizer(step).encode((d / "sft.jsonl").read_text())[:200])
    want = evaluate(load_model(step), tokens, 16)
    assert result["mtp_loss"] == pytest.approx(want["mtp_loss"], abs=1e-4)
    assert result["loss"] == pytest.approx(want["loss"], abs=1e-4)


def test_generate_with_the_mtp_draft_prints_plain_greedy_and_the_acceptance(runs):
    rc, out = _rank0(runs, 3)
    assert rc == 0, out
    assert out.startswith("apple?")
    line = out.strip().splitlines()[-1]
    assert line.startswith("draft mtp: ") and "drafts accepted" in line and "tokens/s" in line, line
    assert "output equals plain" in line, line
    rc, out = _rank0(runs, 4)
    report = json.loads(out.strip().splitlines()[-1])["draft"]
    assert report["same_as_plain"] is True and report["drafted"] > 0 and report["tokens_per_s"] > 0


def test_mtp_layers_on_a_family_without_an_hf_layout(runs, monkeypatch, capsys, tmp_path):
    d, ranks = runs
    rc, out = _rank0(runs, 5)
    assert rc == 0, out
    assert all(r["mtp_loss"] > 0 for r in metrics(d / "llama") if "loss" in r)
    line = one_error_line(*cli(monkeypatch, capsys, "convert", "to-hf", d / "llama" / "step_00000002",
                               tmp_path / "out"), "convert to-hf", "llama", "no multi-token-prediction layers")
    assert "--mtp-layers" in line and not (tmp_path / "out").exists()
    one_error_line(*cli(monkeypatch, capsys, "convert", "to-megatron", d / "llama" / "step_00000002",
                        tmp_path / "meg", "--tp", "1", "--pp", "1"), "convert to-megatron",
                   "1 multi-token-prediction depth", "does not write yet")
    assert not (tmp_path / "meg").exists()


def test_bad_mtp_settings_are_refused_in_one_line(runs, monkeypatch, capsys):
    """Before any rank starts, nothing written: ZeRO-3 with trained depths, a weight or a draft for a model without
    depths, --mtp-layers over a checkpoint's own depths."""
    d, _ = runs
    base = ["finetune", "--base", str(d / "hf"), "--data", str(d / "sft.jsonl")]
    one_error_line(*cli(monkeypatch, capsys, *base, "--zero", "3"), "finetune", "--zero 3 with multi-token prediction")
    one_error_line(*cli(monkeypatch, capsys, *base, "--mtp-layers", "1"), "finetune", "--mtp-layers 1",
                   "2 multi-token-prediction depths of its own")
    plain = ["pretrain", "--model", "nano-llama", "--data", str(d / "corpus.txt")]
    one_error_line(*cli(monkeypatch, capsys, *plain, "--mtp-loss-scale", "0.3"), "pretrain", "--mtp-loss-scale 0.3",
                   "no multi-token-prediction depths")
    one_error_line(*cli(monkeypatch, capsys, "generate", str(d / "lora" / "step_00000002"), "--prompt", "a",
                        "--draft", "mtp", "--sequence-parallel"), "generate", "--draft mtp", "--sequence-parallel")
