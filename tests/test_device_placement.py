"""A CPU proof of device placement: every tensor the runtime creates is on its device.

Each rank sets `torch.set_default_device("meta")` before running a command with the runtime's device `cpu`: a
tensor created without an explicit device then lands on meta, which has no data, so any such tensor on the
compute path fails the run or changes its numbers. Pretrain (with a held-out eval, a checkpoint and a sample),
fine-tune from that checkpoint, eval and generate must give exactly what a normal run gives, at tp=2, pp=2 and
tp=2 with sequence parallelism. On a GPU the same discipline is what puts everything on cuda:LOCAL_RANK.
"""
import argparse
import contextlib
import io
import json
import sysconfig
from pathlib import Path

import pytest
import torch

from tpzoo.testing import run_on_ranks
from tpzoo.train import load_config

LAYOUTS = {"tp2": dict(tp=2), "pp2": dict(pp=2), "tp2_sp": dict(tp=2, sequence_parallel=True)}


def _under_meta(meta: bool, fn, *args):
    if meta:
        torch.set_default_device("meta")
    try:
        return fn(*args)
    finally:
        torch.set_default_device(None)


def _train(cfg):
    from tpzoo.train import train

    r = train(cfg)
    return {k: r[k] for k in ("status", "losses", "grad_norms", "eval_loss", "sample", "checkpoint")}


def _command(name: str, argv: list[str]):
    """A command's rank worker (what `tpzoo <name>` runs on each rank), its stdout."""
    import importlib

    module = importlib.import_module(f"tpzoo.commands.{name}")
    parser = argparse.ArgumentParser()
    module.add_arguments(parser)
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        module._worker(parser.parse_args(argv))
    return out.getvalue()


def _both(fn, *args) -> list:
    """fn on 2 ranks, normally and under a meta default device: rank 0's results of both."""
    return [run_on_ranks(2, _under_meta, meta, fn, *args)[0] for meta in (False, True)]


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    root = tmp_path_factory.mktemp("placement")
    lib = Path(sysconfig.get_paths()["stdlib"])
    sft = root / "sft.jsonl"
    sft.write_text("".join(json.dumps({"prompt": f"Say {w}.", "response": w}) + "\n"
                           for w in ["apple", "river", "stone", "cloud", "green", "tiger", "piano", "lemon"] * 4))
    return root, str(lib / "textwrap.py"), str(sft)


def _cfg(root, **kw):
    base = dict(model="nano-gpt", seq_len=32, global_batch_size=4, micro_batch_size=2, steps=3, lr=3e-3,
                warmup_steps=1, tp=1, pp=1, dp=0, quiet=True, seed=0, prefetch=1, eval_fraction=0.1,
                eval_batches=1, sample_prompt="def ", sample_tokens=6, temperature=0.0, device="cpu",
                data_cache=str(root / "cache"))
    base.update(kw)
    return load_config(None, base)


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_every_command_places_every_tensor_on_the_runtime_device(files, layout):
    root, text, sft = files
    lay = LAYOUTS[layout]
    runs = {}
    for meta in (False, True):  # separate save directories: the runs must not see each other's checkpoints
        save = root / f"{layout}-{meta}"
        runs[meta] = run_on_ranks(2, _under_meta, meta, _train, _cfg(root, data=[text],
                                                                       save=str(save / "pretrain"), **lay))[0]
    normal, meta = runs[False], runs[True]
    assert normal["status"] == meta["status"] == "ok"
    for key in ("losses", "grad_norms", "eval_loss", "sample"):
        assert meta[key] == normal[key], (layout, key, meta[key], normal[key])
    assert normal["eval_loss"] is not None and normal["sample"]

    ckpt = normal["checkpoint"]
    # raw: "Say apple." + "apple" + EOS (the fallback's role headers alone would fill the 32-token sequence)
    tuned = _both(_train, _cfg(root, task="sft", base=ckpt, data=[sft], save="", template="raw", **lay))
    assert tuned[0] == tuned[1] and tuned[0]["status"] == "ok", tuned

    flags = [f"--{k.replace('_', '-')}" if v is True else f"--{k} {v}" for k, v in lay.items()]
    flags = [part for f in flags for part in f.split()] + ["--device", "cpu"]
    evals = _both(_command, "eval", [ckpt, "--text-file", text, "--seq-len", "32", "--max-tokens", "200"] + flags)
    assert evals[0] == evals[1] and json.loads(evals[0])["tokens"] == 199, evals
    gens = _both(_command, "generate", [ckpt, "--prompt", "import ", "--max-new-tokens", "5", "--json", "--ignore-eos"] + flags)
    assert gens[0] == gens[1] and len(json.loads(gens[0])["new_ids"]) == 5, gens
