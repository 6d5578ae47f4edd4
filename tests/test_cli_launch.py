"""The CLI launched the way a new user launches it (issue 37), one case per bug found that way.

1. `torchrun --nproc-per-node 2 -m tpzoo pretrain --model nano-mixtral --tp 1 --ep 2` with dp left to be inferred
   trains (it was refused: `train()` checked the config at dp 1 before the process groups existed); the world
   size decides dp in one function (tpzoo.parallel.dims.check_layout) for the preflight, `train()` and
   `init_parallel`, so ep dividing dp x cp (the ranks' rule) passes at cp 2, dp 1 too.
2. `--lr 0` with min_lr left at its default runs, for pretrain (in the same torchrun launch) and finetune: the
   default min_lr follows lr.
3. `tpzoo finetune --base HF_LLAMA` names the base in its header (family and path), not the default --model.
4. Resuming with a changed --seq-len is refused before any rank starts, naming the field and both values;
   a changed layout or micro-batch size still resumes.
5. The held-out loss of one checkpoint (the torchrun run's, trained at lr 0) is the same (1e-6) at dp 1, dp 2,
   dp 2 with ep 2, tp 2, pp 2 and cp 2 (+ ep 2), each a `tpzoo pretrain --base CKPT --lr 0 --steps 1` on the same
   eval settings: 6 held-out sequences in micro-batches of 2, so at dp 2 (3 each) a filler sequence whose labels
   are ignored completes each rank's second micro-batch.
6. TQDM_DISABLE=1 hides the bars of `convert to-hf --merge` and `preprocess` (their --quiet flags passed an
   explicit disable=False, which tqdm's own reading of TQDM_DISABLE does not override); without it they draw.

The layouts of case 5 run `tpzoo.cli.main` on pooled gloo ranks (tpzoo.testing.run_on_ranks), which carry
torchrun's environment (RANK, WORLD_SIZE): the command's own torchrun path, without starting processes per run.
"""
import json
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

from preflight_helpers import cli, one_error_line
from tpzoo.testing import run_on_ranks

TEXT = Path(sysconfig.get_paths()["stdlib"]) / "textwrap.py"
# 16-token sequences, 2 per micro-batch; 6 held-out ones per evaluation: at dp 2, 3 per rank, whose second
# micro-batch is completed by a filler sequence (labels ignored)
SHAPE = ["--seq-len", "16", "--global-batch-size", "4", "--micro-batch-size", "2", "--eval-fraction", "0.02",
         "--eval-batches", "3", "--sample-prompt", "", "--log-interval", "1"]


def metrics(log_dir) -> list[dict]:
    return [json.loads(line) for line in (Path(log_dir) / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def moe_run(tmp_path_factory):
    """Cases 1 and 2 in one real torchrun launch: a mixture of experts at ep 2, dp inferred (2), --lr 0 with the
    default min_lr; its step-2 checkpoint has the initial weights (lr 0)."""
    d = tmp_path_factory.mktemp("moe")
    corpus = d / "corpus.txt"
    corpus.write_text(TEXT.read_text())
    argv = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "-m", "tpzoo",
            "pretrain", "--model", "nano-mixtral", "--tp", "1", "--ep", "2", "--data", str(corpus), "--steps", "2",
            "--lr", "0", "--save", str(d / "run"), "--data-cache", str(d / "cache"), *SHAPE]
    proc = subprocess.run(argv, capture_output=True, text=True, cwd=d, timeout=300)
    return {"proc": proc, "dir": d, "corpus": str(corpus), "ckpt": str(d / "run" / "step_00000002")}


def test_torchrun_with_ep_and_dp_inferred_trains_at_lr_0(moe_run):
    proc = moe_run["proc"]
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    assert "tp=1 cp=1 pp=1 dp=2 ep=2" in proc.stdout, proc.stdout  # dp inferred from the world size
    rows = metrics(moe_run["dir"] / "run")
    assert [r["step"] for r in rows] == [1, 2] and all(r["lr"] == 0 for r in rows)
    assert rows[-1]["eval_loss"] > 0
    assert Path(moe_run["ckpt"], "train_state.json").is_file()


def _cli_on_rank(runs: list[list[str]]) -> list[int]:
    """`tpzoo ARGS` on this pooled rank, as under torchrun (RANK and WORLD_SIZE are set), for each ARGS."""
    from tpzoo.cli import main

    return [main(argv) for argv in runs]


def test_the_heldout_loss_of_a_checkpoint_is_the_same_at_every_layout(moe_run, tmp_path):
    assert moe_run["proc"].returncode == 0, moe_run["proc"].stderr[-4000:]
    common = ["pretrain", "--base", moe_run["ckpt"], "--lr", "0", "--steps", "1", "--data", moe_run["corpus"],
              "--data-cache", str(moe_run["dir"] / "cache"), "--save", "", *SHAPE]
    layouts = {"dp1": ["--tp", "1"], "dp2": ["--tp", "1"], "tp2": ["--tp", "2"], "pp2": ["--tp", "1", "--pp", "2", "--pp-boundaries", "0,1,2"],
               "cp2_ep2": ["--tp", "1", "--cp", "2", "--ep", "2"]}
    runs = {name: [*common, *flags, "--log-dir", str(tmp_path / name)] for name, flags in layouts.items()}
    assert run_on_ranks(1, _cli_on_rank, [runs["dp1"]]) == [[0]]
    assert run_on_ranks(2, _cli_on_rank, [runs[k] for k in ("dp2", "tp2", "pp2", "cp2_ep2")]) == [[0] * 4] * 2
    losses = {name: metrics(tmp_path / name)[-1]["eval_loss"] for name in layouts}
    losses["dp2_ep2"] = metrics(moe_run["dir"] / "run")[-1]["eval_loss"]  # the checkpoint's own run, lr 0
    print("held-out loss by layout:", json.dumps(losses))
    for name, loss in losses.items():
        assert loss == pytest.approx(losses["dp1"], abs=1e-6), losses


def test_resuming_with_another_seq_len_names_it_before_any_rank(moe_run, monkeypatch, capsys):
    assert moe_run["proc"].returncode == 0, moe_run["proc"].stderr[-4000:]
    run = str(moe_run["dir"] / "run")
    resume = ["pretrain", "--model", "nano-mixtral", "--tp", "1", "--ep", "2", "--dp", "2", "--data",
              moe_run["corpus"], "--steps", "3", "--lr", "0", "--save", run, "--resume", *SHAPE]
    one_error_line(*cli(monkeypatch, capsys, *resume, "--seq-len", "8"), "pretrain",
                   f"cannot resume from {moe_run['ckpt']} with seq_len 8 (the checkpoint's run: 16)",
                   "a resumed run keeps task, data, text_field, seq_len")
    import tpzoo.commands.launch as launch

    started = []
    monkeypatch.setattr(launch, "run_multirank", lambda fn, args, nproc, cmd: started.append(nproc) or 0)
    from tpzoo.cli import main

    # another layout and micro-batch size (the run's global batch and data kept) pass the preflight
    assert main([*resume, "--ep", "1", "--micro-batch-size", "1"]) == 0 and started == [2]


@pytest.fixture
def sft_files(tmp_path):
    """A tiny HF Llama (vocabulary 300: the byte tokenizer fits) and 20 prompt/response records."""
    import torch
    import transformers as tf

    torch.manual_seed(0)
    hf = tmp_path / "hf_llama"
    cfg = tf.LlamaConfig(vocab_size=300, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
    tf.LlamaForCausalLM(cfg).save_pretrained(hf)
    data = tmp_path / "sft.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"Say {i}.", "response": f"{i}!"}) + "\n" for i in range(20)))
    return hf, data


def test_finetune_names_its_base_runs_at_lr_0_and_bars_follow_tqdm_disable(sft_files, tmp_path, monkeypatch,
                                                                               capsys):
    from tpzoo.cli import main

    hf, data = sft_files
    save = tmp_path / "ft"
    assert main(["finetune", "--base", str(hf), "--data", str(data), "--tp", "1", "--lr", "0", "--steps", "1",
                 "--lora-rank", "2", "--seq-len", "32", "--global-batch-size", "2", "--micro-batch-size", "2",
                 "--save", str(save)]) == 0
    out = capsys.readouterr().out
    header = next(line for line in out.splitlines() if line.startswith("tpzoo sft: "))
    assert header.startswith(f"tpzoo sft: model llama from --base {hf} ("), header
    assert "tiny-gpt" not in out
    assert [r["lr"] for r in metrics(save)] == [0]

    # Case 6: every bar follows TQDM_DISABLE; the same commands without it draw theirs (the check can fail).
    lora = str(save / "step_00000001")
    for disabled in (True, False):
        if disabled:
            monkeypatch.setenv("TQDM_DISABLE", "1")
        else:
            monkeypatch.delenv("TQDM_DISABLE")
        assert main(["convert", "to-hf", "--merge", lora, str(tmp_path / f"merged-{disabled}")]) == 0
        assert main(["preprocess", "--data", str(TEXT), "--tokenizer", "byte",
                     "--out", str(tmp_path / f"store-{disabled}")]) == 0
        err = capsys.readouterr().err
        for bar in ("writing HF", "tok/s]"):
            assert (bar in err) != disabled, (disabled, err)
