"""The new families through the CLI, the way a new user runs them (issue 48), one case per bug found that way.

2. LoRA on DeepSeek-V3 (`finetune --base HF --lora-rank 4`, defaults otherwise) stopped at step 2 and resumed gives
   step 3's loss bit for bit: the selection biases stay the base's under LoRA (a LoRA checkpoint holds only the
   adapters; they moved before, so the resumed run routed with other biases). The tiny model's router scores are
   near ties, as at initialization, so a bias moved by the default 1e-3 changes the experts chosen. A rate given
   with LoRA is refused in one line.
3. `pretrain --model tiny-deepseek-v3 --replicas 2 --sync-every 1` trains, equal to the flat run (1e-6): the
   selection biases' loads are summed over the world; DiLoCo (`--sync-every 2`) with the bias update is refused.
7. gpt-oss (no selection bias) refuses `--router-bias-update-rate`; `--data 1e400 A 1 B` is refused; `--model`
   naming another model than the run being resumed is refused; `tpzoo eval --ep 2` reports its ep; converting a
   Qwen3-Next model does not import torch._dynamo (seconds: a torch.cat on meta tensors did).
Several commands share one call of the pooled ranks (tpzoo.testing.run_on_ranks, torchrun's environment)."""
import json
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest
import torch

from preflight_helpers import cli, one_error_line
from tpzoo.testing import run_on_ranks

TEXT = Path(sysconfig.get_paths()["stdlib"]) / "textwrap.py"
SHAPE = ["--seq-len", "16", "--global-batch-size", "4", "--micro-batch-size", "2", "--sample-prompt", "",
         "--log-interval", "1", "--eval-fraction", "0"]


def metrics(log_dir) -> list[dict]:
    return [json.loads(line) for line in (Path(log_dir) / "metrics.jsonl").read_text().splitlines()]


def _cli_on_rank(runs: list[list[str]]) -> list:
    """`tpzoo ARGS` on this pooled rank, as under torchrun, for each ARGS: (status, this rank's stdout)."""
    import contextlib
    import io

    from tpzoo.cli import main

    out = []
    for argv in runs:
        buf = io.StringIO()
        with contextlib.redirect_stdout(buf):
            rc = main(argv)
        out.append((rc, buf.getvalue()))
    return out


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """A tiny DeepSeek-V3 transformers wrote (the byte tokenizer's 259 tokens) whose router scores are near ties
    and selection biases zero, SFT records, and a text corpus."""
    from frontier_models import make_hf_model

    d = tmp_path_factory.mktemp("families")
    model = make_hf_model("deepseek_v3", vocab=259)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("mlp.gate.weight"):
                p.normal_(std=1e-3)  # near ties, as at initialization: the biases decide the choices
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.zero_()
    model.save_pretrained(d / "deepseek")
    sft = d / "sft.jsonl"
    sft.write_text("".join(json.dumps({"prompt": f"{w}?", "response": f"{w}!"}) + "\n"
                           for w in ("apple", "river", "stone", "cloud", "green", "tiger", "piano", "lemon") * 3))
    corpus = d / "corpus.txt"
    corpus.write_text(TEXT.read_text())
    return {"dir": d, "deepseek": str(d / "deepseek"), "sft": str(sft), "corpus": str(corpus)}


@pytest.fixture(scope="module")
def runs(files):
    """Cases 2 and 3 in one call of 2 pooled ranks: LoRA straight to step 3, to step 2 then resumed to 3; the
    tiny DeepSeek-V3 flat (dp 2) and as 2 synchronous replicas; then `eval --ep 2` of the flat run."""
    d = files["dir"]
    lora = ["finetune", "--base", files["deepseek"], "--data", files["sft"], "--lora-rank", "4", "--lr", "1e-2",
            "--warmup-steps", "1", *SHAPE, "--seq-len", "48"]
    moe = ["pretrain", "--model", "tiny-deepseek-v3", "--tp", "1", "--data", files["corpus"], "--steps", "2",
           "--data-cache", str(d / "cache"), *SHAPE]
    argv = [[*lora, "--steps", "3", "--save", str(d / "straight")],
            [*lora, "--steps", "2", "--save", str(d / "resumed")],
            [*lora, "--steps", "3", "--save", str(d / "resumed"), "--resume", "auto"],
            [*moe, "--save", str(d / "flat")],
            [*moe, "--save", "", "--log-dir", str(d / "replicas"), "--replicas", "2", "--sync-every", "1"],
            ["eval", str(d / "flat" / "step_00000002"), "--text-file", files["corpus"], "--tp", "1", "--ep", "2",
             "--max-tokens", "200", "--seq-len", "16"]]
    return run_on_ranks(2, _cli_on_rank, argv)


def test_lora_on_deepseek_resumes_exactly_with_its_selection_biases_frozen(files, runs, monkeypatch, capsys):
    assert [rc for rc, _ in runs[0][:3]] == [0, 0, 0], runs[0][:3]
    d = files["dir"]
    straight, resumed = metrics(d / "straight"), metrics(d / "resumed")
    assert [r["step"] for r in resumed] == [1, 2, 3]
    assert [r["loss"] for r in resumed] == [r["loss"] for r in straight]  # bit for bit, step 3 included
    line = one_error_line(*cli(monkeypatch, capsys, "finetune", "--base", files["deepseek"], "--data", files["sft"],
                               "--lora-rank", "4", "--router-bias-update-rate", "0.001"), "finetune",
                          "--router-bias-update-rate 0.001 with LoRA", "selection biases included")
    assert "leave the rate unset" in line


def test_deepseek_trains_as_synchronous_replicas_and_refuses_diloco_with_the_bias_update(files, runs, monkeypatch,
                                                                                         capsys):
    assert [rc for rc, _ in runs[0][3:5]] == [0, 0], runs[0][3:5]
    flat, replicas = metrics(files["dir"] / "flat"), metrics(files["dir"] / "replicas")
    assert [r["loss"] for r in replicas] == pytest.approx([r["loss"] for r in flat], abs=1e-6, rel=0)
    assert flat[-1]["loss"] != flat[0]["loss"]
    one_error_line(*cli(monkeypatch, capsys, "pretrain", "--model", "tiny-deepseek-v3", "--tp", "1", "--dp", "2",
                        "--replicas", "2", "--sync-every", "2", "--data", files["corpus"]), "pretrain",
                   "--replicas 2 --sync-every 2 (DiLoCo) with --router-bias-update-rate 0.001",
                   "--sync-every 1")


def test_eval_reports_its_expert_parallel_size(runs):
    (rc, out), = {runs[r][5] for r in range(2) if runs[r][5][1]}  # rank 0 prints the result
    result = json.loads(out.strip().splitlines()[-1])
    assert rc == 0 and (result["tp"], result["ep"], result["dp"]) == (1, 2, 2), out


def test_bad_router_data_and_model_flags_are_refused_in_one_line(files, runs, monkeypatch, capsys):
    one_error_line(*cli(monkeypatch, capsys, "pretrain", "--model", "tiny-gpt-oss", "--router-bias-update-rate",
                        "0.001"), "pretrain", "--router-bias-update-rate 0.001", "this model's router has none")
    other = files["dir"] / "other.txt"
    other.write_text("more text\n")
    one_error_line(*cli(monkeypatch, capsys, "pretrain", "--data", "1e400", files["corpus"], "1", other), "pretrain",
                   "the weight '1e400' of", "not a finite positive number")
    one_error_line(*cli(monkeypatch, capsys, "pretrain", "--data", "1e300", files["corpus"], "1e-300", other),
                   "pretrain", "the weight '1e-300' of", "too small next to the others'")
    assert runs[0][3][0] == 0
    one_error_line(*cli(monkeypatch, capsys, "pretrain", "--model", "tiny-gpt", "--tp", "1", "--data",
                        files["corpus"], "--steps", "3", "--save", files["dir"] / "flat", "--resume", *SHAPE),
                   "pretrain", "--model tiny-gpt", "trains tiny-deepseek-v3")


def test_converting_qwen3_next_does_not_import_dynamo(tmp_path):
    from hf_models import save_hf_model

    save_hf_model("qwen3_next", tmp_path / "hf")
    code = ("import sys; from tpzoo.cli import main; rc = main(sys.argv[1:]); "
            "print(rc, 'torch._dynamo' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code, "convert", "from-hf", str(tmp_path / "hf"), str(tmp_path / "c"),
                          "--quiet"], capture_output=True, text=True, timeout=300)
    assert out.stdout.split()[-2:] == ["0", "False"], out.stdout + out.stderr
