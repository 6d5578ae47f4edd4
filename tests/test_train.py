"""tpzoo.train: config, LR schedule, layout parity of whole training runs, global grad norm vs a dense model,
ZeRO-1, NaN skipping, exact resume (same and other layout), a SIGKILL during a save, metrics and plot."""
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tpzoo.testing import run_on_ranks
from tpzoo.train import TrainConfig, describe_config, load_config
from tpzoo.train.lr import lr_at

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="session")
def store(tmp_path_factory):
    """A small byte-level token store (a few stdlib modules): every run below reads it."""
    import sysconfig

    from tpzoo.data import iter_documents, preprocess

    lib = Path(sysconfig.get_paths()["stdlib"])
    files = [str(lib / f) for f in ("textwrap.py", "shlex.py", "fnmatch.py", "colorsys.py")]
    return str(preprocess(iter_documents(files), "byte", tmp_path_factory.mktemp("data") / "store").path)


def tiny(store, **kw) -> TrainConfig:
    base = dict(model="nano-gpt", data=[store], seq_len=32, global_batch_size=8, micro_batch_size=2, steps=5,
                lr=3e-3, min_lr=3e-4, warmup_steps=2, tp=1, pp=1, dp=0, save="", sample_prompt="", quiet=True,
                log_interval=100, eval_fraction=0.0, seed=0, prefetch=1)
    base.update(kw)
    return load_config(None, base)


def _train(cfg):
    from tpzoo.train import train

    return train(cfg)


# -- config and schedule (no ranks) ---------------------------------------------------------------------------------

def test_the_preflight_and_the_trainer_resolve_one_model(store):
    """tpzoo/train/run_model.py, the one function both call: a cut DeepSeek-V3 gets the run's router settings in
    both; the trainer's vocabulary is its tokenizer's, which the preflight does not load (the rest is equal)."""
    from tpzoo.train.run_model import resolve_run_model

    cfg = tiny(store, model="tiny-deepseek-v3", router_bias_update_rate=0.05, router_aux_loss_coef=0.01)
    preflight, trainer = resolve_run_model(cfg, load_tokenizer=False), resolve_run_model(cfg)
    for run in (preflight, trainer):
        assert (run.config.moe.bias_update_rate, run.config.moe.router_aux_loss_coef) == (0.05, 0.01)
        assert run.resume is None and run.state is None and run.label == "model tiny-deepseek-v3"
    assert preflight.tokenizer is None and trainer.config.vocab_size == trainer.tokenizer.vocab_size
    assert preflight.config.replace(vocab_size=trainer.config.vocab_size) == trainer.config


def test_config_toml_sections_flat_keys_and_flags(tmp_path):
    toml = tmp_path / "run.toml"
    toml.write_text('seed = 7\n[optim]\nlr = 1e-3\n[parallel]\ntp = 4\nsequence_parallel = true\n'
                    '[data]\ndata = ["a.txt", "b.txt"]\n')
    cfg = load_config(str(toml), {"lr": 5e-4, "resume": "latest"}, defaults={"steps": 9, "lr": 2.0})
    assert (cfg.seed, cfg.lr, cfg.tp, cfg.sequence_parallel, cfg.steps) == (7, 5e-4, 4, True, 9)
    assert cfg.data == ["a.txt", "b.txt"] and cfg.resume == "latest"
    assert TrainConfig.from_dict(cfg.to_dict()) == cfg
    import pickle
    import tomllib

    assert pickle.loads(pickle.dumps(cfg)) == cfg
    assert TrainConfig.from_dict(tomllib.loads(cfg.to_toml())) == cfg
    with pytest.raises(ValueError, match="unknown config key"):
        load_config(None, {"learning_rate": 1})
    with pytest.raises(ValueError, match="dtype must be one of"):
        load_config(None, {"dtype": "fp8"})
    bad = tmp_path / "bad.toml"
    bad.write_text("[optim]\ntp = 2\n")
    with pytest.raises(ValueError, match=r"\[optim\] has no key 'tp'"):
        load_config(str(bad))
    table = describe_config()
    assert "`--global-batch-size`" in table and "`--zero`" in table and "`--zero1`" in table
    assert table in (ROOT / "docs" / "training.md").read_text(), "regenerate the table in docs/training.md"
    for example in sorted((ROOT / "scripts" / "configs").glob("*.toml")):
        load_config(str(example))  # every example config is valid


def test_cli_flags_reach_the_config(tmp_path):
    import argparse

    from tpzoo.commands import finetune
    from tpzoo.train.config import config_from_args

    p = argparse.ArgumentParser()
    finetune.add_arguments(p)
    args = p.parse_args(["--tp", "1", "--no-packing", "--data", "x.jsonl", "--resume", "--base", "ckpt",
                         "--inject-nan-steps", "2", "3", "--pp-boundaries", "0,3,8"])
    cfg = config_from_args(args, finetune.DEFAULTS)
    assert (cfg.task, cfg.tp, cfg.packing, cfg.resume, cfg.base, cfg.lr) == ("sft", 1, False, "auto", "ckpt", 1e-4)
    assert cfg.inject_nan_steps == [2, 3] and cfg.data == ["x.jsonl"] and cfg.pp_boundaries == [0, 3, 8]
    out = subprocess.run([sys.executable, "-m", "tpzoo", "pretrain", "--print-config", "--lr", "0.5"],
                         capture_output=True, text=True, cwd=tmp_path, check=True).stdout
    assert "lr = 0.5" in out and "[parallel]" in out


def test_lr_warmup_then_cosine_to_min():
    kw = dict(lr=1.0, min_lr=0.1, warmup_steps=4, total_steps=20)
    lrs = [lr_at(s, **kw) for s in range(20)]
    assert lrs[:4] == [0.25, 0.5, 0.75, 1.0]
    assert lrs[4] == 1.0 and math.isclose(lrs[-1], 0.1)
    assert all(a >= b for a, b in zip(lrs[4:], lrs[5:]))


# -- whole runs on several ranks ------------------------------------------------------------------------------------

LAYOUTS = [(1, 1, 1), (2, 1, 1), (1, 2, 1), (1, 1, 2), (2, 2, 1)]


def test_same_losses_at_every_layout(store):
    """5 steps at (tp, pp, dp) in LAYOUTS (sequence parallel where tp > 1, tied embeddings split over the
    pipeline at pp > 1, ZeRO-1 at dp > 1): the same per-step losses and global grad norms to 1e-4."""
    runs = {}
    for tp, pp, dp in LAYOUTS:
        cfg = tiny(store, tp=tp, pp=pp, sequence_parallel=tp > 1, zero1=dp > 1)
        results = run_on_ranks(tp * pp * dp, _train, cfg)
        assert all(r["losses"] == results[0]["losses"] for r in results)  # every rank reports the global loss
        runs[(tp, pp, dp)] = results[0]
    ref = runs[(1, 1, 1)]
    assert ref["losses"][-1] < ref["losses"][0]
    for layout, r in runs.items():
        assert r["losses"] == pytest.approx(ref["losses"], abs=1e-4), layout
        assert r["grad_norms"] == pytest.approx(ref["grad_norms"], abs=1e-4), layout


def _dense_first_grad_norm(cfg) -> float:
    """The reference: one process, a plain Transformer, the first global batch, torch's norm of every gradient."""
    from tpzoo.data import ResumableLoader
    from tpzoo.models import Inputs, Transformer
    from tpzoo.train.data import build_datasets
    from tpzoo.train.run_model import resolve_run_model

    run = resolve_run_model(cfg, resume=None)
    tok, model = run.tokenizer, Transformer(run.config, seed=cfg.seed)
    train_ds, _, _ = build_datasets(cfg, tok)
    batch = next(ResumableLoader(train_ds, cfg.global_batch_size, seed=cfg.seed, prefetch=0))
    loss = model(Inputs(batch["input_ids"], labels=batch["labels"]))
    (loss.sum() / (batch["labels"] != -100).sum()).backward()
    return float(torch.nn.utils.get_total_norm([p.grad for p in model.parameters()]))


@pytest.mark.parametrize("model,layout", [("nano-gpt", (2, 2, 1)), ("nano-llama", (4, 1, 1)),
                                          ("nano-llama", (2, 1, 2))])
def test_global_grad_norm_equals_dense_norm(store, model, layout):
    """Replicated parameters (norms, biases, kv heads copied over TP ranks, the tied head on the last stage,
    dp replicas) are counted once: the first step's norm equals a dense single-process model's."""
    tp, pp, dp = layout
    cfg = tiny(store, model=model, tp=tp, pp=pp, steps=1, sequence_parallel=tp > 1, zero1=dp > 1)
    got = run_on_ranks(tp * pp * dp, _train, cfg)[0]["grad_norms"][0]
    assert got == pytest.approx(_dense_first_grad_norm(cfg), rel=1e-5)


def _train_and_params(cfg):
    from tpzoo.train.loop import Trainer, train

    captured = {}
    original = Trainer.close

    def close(self):  # grab the final weights before the trainer goes away
        captured.update({n: p.detach().float().clone() for c in self.chunks for n, p in c.named_parameters()})
        original(self)

    Trainer.close = close
    try:
        return train(cfg), captured
    finally:
        Trainer.close = original


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_zero1_same_losses_and_weights(store, dtype):
    off, on = (run_on_ranks(2, _train_and_params, tiny(store, dp=2, zero1=z, dtype=dtype, clip_grad=0.05))
               for z in (False, True))
    assert on[0][0]["losses"] == pytest.approx(off[0][0]["losses"], abs=1e-6)
    assert on[0][0]["grad_norms"] == pytest.approx(off[0][0]["grad_norms"], rel=1e-6)
    for name, w in off[0][1].items():
        torch.testing.assert_close(on[0][1][name], w, rtol=0, atol=1e-6)
        torch.testing.assert_close(on[1][1][name], w, rtol=0, atol=1e-6)  # both dp ranks hold the result


def test_nan_steps_are_skipped_then_the_run_stops(store, tmp_path):
    r = run_on_ranks(1, _train, tiny(store, steps=4, inject_nan_steps=[2]))[0]
    assert r["status"] == "ok" and math.isnan(r["grad_norms"][1]) and all(math.isfinite(x) for x in r["losses"])
    save = str(tmp_path / "ck")
    r = run_on_ranks(1, _train, tiny(store, steps=8, save=save, save_every=2, max_skips=2,
                                     inject_nan_steps=[3, 4]))[0]
    assert r["status"] == "diverged" and r["steps"] == [1, 2, 3, 4]
    assert sorted(p.name for p in Path(save).glob("step_*")) == ["step_00000002"]  # the last good one


def test_fp16_scales_the_loss_and_skips_overflows_without_diverging(store, tmp_path):
    """fp16 weights: the loss curve follows fp32's; injected overflows (NaN gradients with a finite loss) skip
    the update and, after hysteresis 2, halve the loss scale, without counting as divergence; the scale
    travels in the checkpoint."""
    import json

    from tpzoo.train.metrics import read_metrics

    fp32 = run_on_ranks(2, _train, tiny(store, tp=2, steps=5))[0]
    save = tmp_path / "fp16"
    r = run_on_ranks(2, _train, tiny(store, tp=2, steps=5, dtype="fp16", max_skips=1, inject_nan_steps=[2, 3],
                                     save=str(save)))[0]
    assert r["status"] == "ok"
    assert r["losses"][0] == pytest.approx(fp32["losses"][0], abs=1e-2)  # same weights, rounded to fp16
    rows = read_metrics(str(save))
    assert [row["loss_scale"] for row in rows] == [2.0 ** 16] * 3 + [2.0 ** 15] * 2
    assert [row["skipped"] for row in rows] == [0] * 5 and math.isnan(float(rows[1]["grad_norm"]))
    assert r["losses"][-1] < r["losses"][0]
    state = json.loads((save / "step_00000005" / "train_state.json").read_text())
    assert state["loss_scaler"]["scale"] == 2.0 ** 15 and state["loss_scaler"]["clean_steps"] == 2


# -- checkpoints and resume -------------------------------------------------------------------------------------------

@pytest.mark.parametrize("kw", [dict(tp=2, sequence_parallel=True), dict(dp=2, zero1=True, dtype="bf16")],
                         ids=["tp2_sp", "dp2_zero1_bf16"])
def test_resume_is_exact(store, tmp_path, kw):
    """20 steps straight == 10 steps, save, a new trainer resumes, 10 more: identical per-step losses."""
    save = str(tmp_path / "run")
    straight = run_on_ranks(2, _train, tiny(store, steps=20, save=save, save_every=10, **kw))[0]
    # Interrupt after step 10: resume from its checkpoint (not from the final one).
    second = run_on_ranks(2, _train, tiny(store, steps=20, save=save, resume=save + "/step_00000010", **kw))[0]
    assert second["start_step"] == 10 and second["steps"] == list(range(11, 21))
    assert second["losses"] == straight["losses"][10:]


def _named_state(trainer) -> dict:
    """Weights and every optimizer state tensor, per parameter name, full over dp (collective over dp)."""
    opt = trainer.optimizer
    names = {id(p): n for c in trainer.chunks for n, p in c.named_parameters()}
    out = {}
    for kind in ["weights"] + opt.state_kinds():
        full = opt.full_weights().float() if kind == "weights" else opt.full_state(kind)
        for p, o in zip(opt.params, opt.offsets):
            out[f"{kind}:{names[id(p)]}"] = full[o:o + p.numel()].view(p.shape).clone()
    return out


def _train_capturing_state(cfg, at_step: int, state=None):
    """Train; capture the named state (`state(trainer)`, default _named_state) once step `at_step` is saved (0:
    when the run starts, e.g. resumed)."""
    from tpzoo.train.loop import Trainer, train

    state = state or _named_state
    captured, originals = {}, (Trainer.save, Trainer.train_step)

    def save(self, step):
        path = originals[0](self, step)
        if step == at_step:
            captured.update(state(self))
        return path

    def train_step(self, step):
        if at_step == 0 and not captured:
            captured.update(state(self))
        return originals[1](self, step)

    Trainer.save, Trainer.train_step = save, train_step
    try:
        return train(cfg), captured
    finally:
        Trainer.save, Trainer.train_step = originals


def _assert_resumes_exactly(store, save, straight, saved, steps, at, layouts, **kw):
    """Resume `save`'s step `at` at each (dp, zero) of `layouts`: the optimizer loads exactly the `saved` weights,
    master and moments, and the run continues on `straight`'s curve (to the layout-parity tolerance)."""
    for dp, zero in layouts:
        (resumed, loaded), *_ = run_on_ranks(dp, _train_capturing_state,
                                             tiny(store, steps=steps, dp=dp, zero=zero, save=save,
                                                  resume=f"{save}/step_{at:08d}", **kw), 0)
        assert resumed["start_step"] == at and loaded.keys() == saved.keys()
        for name, t in saved.items():
            assert torch.equal(loaded[name], t), (dp, zero, name)
        assert resumed["losses"] == pytest.approx(straight["losses"][at:], abs=1e-4), (dp, zero)


def test_resume_from_zero2_at_another_dp_and_zero_level(store, tmp_path):
    """Saved at dp=2 ZeRO-2 (bf16, several gradient buckets per rank), resumed at dp=4 ZeRO-1 and dp=1 ZeRO-0:
    the weights, fp32 master and AdamW moments the resumed optimizer holds equal the saved ones exactly, and the
    runs continue on the saved run's curve (to the layout-parity tolerance: dp changes the summation order)."""
    save = str(tmp_path / "run")
    kw = dict(dtype="bf16", grad_bucket_elems=4096)
    (straight, saved), _ = run_on_ranks(2, _train_capturing_state,
                                        tiny(store, steps=8, dp=2, zero=2, save=save, save_every=4, **kw), 4)
    assert len(saved) == 4 * 28  # weights, master, exp_avg, exp_avg_sq of nano-gpt's 28 parameter tensors
    _assert_resumes_exactly(store, save, straight, saved, 8, 4, ((4, 1), (1, 0)), **kw)


def test_resume_from_zero3_at_another_dp_and_zero_level(store, tmp_path):
    """Saved at dp=2 ZeRO-3 (bf16, weights sharded, layers gathered when used; evaluation and a sample generated
    by the run's layers gathered one by one), resumed at dp=4 ZeRO-1 and at dp=1 ZeRO-3: weights, fp32 master
    and moments equal the saved ones exactly, and the runs continue on the saved run's curve."""
    save = str(tmp_path / "run")
    kw = dict(dtype="bf16", grad_bucket_elems=4096, eval_fraction=0.1)
    (straight, saved), _ = run_on_ranks(2, _train_capturing_state,
                                        tiny(store, steps=6, dp=2, zero=3, save=save, save_every=3,
                                             eval_every=3, sample_prompt="de",
                                             sample_tokens=4, **kw), 3)
    assert len(saved) == 4 * 28 and straight["sample"].startswith("de") and len(straight["sample"]) > 2
    assert straight["eval_loss"] is not None and abs(straight["eval_loss"] - straight["losses"][-1]) < 1.0
    _assert_resumes_exactly(store, save, straight, saved, 6, 3, ((4, 1), (1, 3)), **kw)


def test_resume_at_another_layout_reshards_weights_and_optimizer(store, tmp_path):
    """Saved at pp=2, resumed at tp=2 with sequence parallelism: weights and AdamW state are resharded, and
    the run continues on the same curve (equal to the layout-parity tolerance)."""
    save = str(tmp_path / "run")
    straight = run_on_ranks(2, _train, tiny(store, steps=12, pp=2, save=save, save_every=3, keep_last=2))[0]
    assert sorted(p.name for p in Path(save).glob("step_*")) == ["step_00000009", "step_00000012"]
    resumed = run_on_ranks(2, _train, tiny(store, steps=12, tp=2, sequence_parallel=True, save=save,
                                           resume=save + "/step_00000009"))[0]
    assert resumed["start_step"] == 9
    assert resumed["losses"] == pytest.approx(straight["losses"][9:], abs=1e-4)


def _cli(args, cwd, env=None):
    e = dict(os.environ, **(env or {}))
    e.pop("WORLD_SIZE", None)
    e.pop("RANK", None)
    return subprocess.run([sys.executable, "-m", "tpzoo", "pretrain", *args], cwd=cwd, env=e, capture_output=True,
                          text=True, timeout=300)


def test_sigkill_during_a_save_leaves_the_previous_checkpoint(store, tmp_path):
    """A CLI run killed (SIGKILL) midway through writing its second checkpoint: the first stays intact, the
    half-written one never appears under its final name, and --resume continues from the first exactly."""
    save = tmp_path / "run"
    args = ["--model", "nano-gpt", "--tp", "1", "--data", store, "--seq-len", "32", "--global-batch-size", "8",
            "--micro-batch-size", "2", "--steps", "6", "--warmup-steps", "2", "--seed", "0", "--eval-fraction", "0",
            "--save", str(save), "--save-every", "2", "--sample-prompt", "", "--log-interval", "1"]
    killed = _cli(args, tmp_path, {"TPZOO_TEST_KILL_DURING_SAVE": "2"})
    assert killed.returncode == -9, killed.stderr[-2000:]
    assert [p.name for p in save.glob("step_*")] == ["step_00000002"]
    assert any(p.name.startswith(".step_00000004.tmp-") for p in save.iterdir())  # the half-written save
    resumed = _cli(args + ["--resume"], tmp_path)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resumed from" in resumed.stdout and "step_00000002 at step 2" in resumed.stdout
    assert not any(".tmp-" in p.name for p in save.iterdir())  # cleaned up
    straight = run_on_ranks(1, _train, tiny(store, steps=6))[0]
    from tpzoo.train.metrics import read_metrics

    rows = read_metrics(str(save))  # the resumed run appended; the later row of a step wins
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5, 6]
    assert [r["loss"] for r in rows] == pytest.approx(straight["losses"], abs=1e-6)
    for key in ("step", "loss", "lr", "grad_norm", "tokens_per_s", "mfu", "peak_mem_gb", "data_wait"):
        assert key in rows[-1]


def test_plot_writes_a_png(tmp_path):
    pytest.importorskip("matplotlib")
    from tpzoo.train.metrics import MetricsLogger

    log = MetricsLogger(True, str(tmp_path), total_steps=3, start_step=0, progress=False, quiet=True)
    for step in (1, 2, 3):
        log.step({"step": step, "loss": 5.0 - step, "lr": 1e-3 * step, "grad_norm": 1.0, "tokens_per_s": 1.0,
                  "eval_loss": 4.0 if step == 3 else None})
    log.close()
    png = tmp_path / "curves.png"
    out = subprocess.run([sys.executable, "-m", "tpzoo", "plot", str(tmp_path), "--out", str(png)],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
