"""Pretraining on a weighted mixture (--data 0.6 A 0.3 B 0.1 C): a tpzoo token store, a text corpus tokenized by
the run and a Megatron indexed dataset, blended so that every logged step holds each source within one sample of
its weight; tokens seen and held-out loss per source in metrics.jsonl; resume at step 77 bit-exact; tp 2 x dp 2
trains on the same samples as one process."""
import sysconfig
from pathlib import Path

import pytest

from tpzoo.testing import run_on_ranks
from tpzoo.train import load_config
from tpzoo.train.metrics import read_metrics

LIB = Path(sysconfig.get_paths()["stdlib"])
WEIGHTS = {"web": 0.6, "code": 0.3, "math": 0.1}
SEQ, GBS = 16, 4


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    """web: a tpzoo token store; code: text files the run tokenizes (cached); math: a Megatron dataset."""
    from tpzoo.data import iter_documents, preprocess

    root = tmp_path_factory.mktemp("mixture")
    preprocess(iter_documents([str(LIB / f) for f in ("textwrap.py", "shlex.py")]), "byte", root / "web")
    (root / "code").mkdir()
    for f in ("fnmatch.py", "colorsys.py"):
        (root / "code" / f).write_text((LIB / f).read_text())
    preprocess(iter_documents([str(LIB / "bisect.py")]), "byte", root / "math", format="megatron")
    return root


def mix(root: Path, **kw):
    base = dict(model="nano-gpt", data=["0.6", str(root / "web"), "0.3", str(root / "code"), "0.1", str(root / "math")],
                seq_len=SEQ, global_batch_size=GBS, micro_batch_size=2, lr=3e-3, min_lr=3e-4, warmup_steps=2,
                tp=1, pp=1, dp=0, save="", sample_prompt="", quiet=True, log_interval=100, eval_fraction=0.02,
                eval_batches=1, seed=0, prefetch=1, data_cache=str(root / "cache"))
    base.update(kw)
    return load_config(None, base)


def _train(cfg):
    from tpzoo.train import train

    return train(cfg)


def test_mixture_proportions_per_source_metrics_resume_and_layouts(sources, tmp_path):
    save = str(tmp_path / "run")
    straight = run_on_ranks(1, _train, mix(sources, steps=200, save=save, save_every=77, keep_last=0))[0]
    rows = read_metrics(save)
    assert [r["step"] for r in rows] == list(range(1, 201))
    for r in rows:  # every logged step: each source's samples so far within one sample of its share
        n = r["step"] * GBS
        for name, w in WEIGHTS.items():
            assert abs(r[f"tokens_seen/{name}"] / SEQ - w * n) <= 1, (r["step"], name)
    last = rows[-1]
    for name, w in WEIGHTS.items():
        assert abs(last[f"tokens_seen/{name}"] / SEQ / (200 * GBS) - w) <= 0.01
    per_source = {name: last[f"eval_loss/{name}"] for name in WEIGHTS}
    assert all(2 < v < 6 for v in per_source.values())
    assert last["eval_loss"] == pytest.approx(sum(WEIGHTS[n] * v for n, v in per_source.items()), rel=1e-9)
    assert straight["losses"][-1] < straight["losses"][0]

    # resumed from the step-77 checkpoint: steps 78..200 bit for bit, the per-source counts continuing
    resumed = run_on_ranks(1, _train, mix(sources, steps=200, save=save, resume=f"{save}/step_00000077"))[0]
    assert resumed["start_step"] == 77 and resumed["losses"] == straight["losses"][77:]
    assert {k: v for k, v in read_metrics(save)[-1].items() if k.startswith(("tokens_seen/", "eval_loss"))} == \
        {k: v for k, v in last.items() if k.startswith(("tokens_seen/", "eval_loss"))}

    # tp 2 x dp 2 (4 ranks) against one process, over the same 6 steps: the same samples, so the same losses
    one = run_on_ranks(1, _train, mix(sources, steps=6, eval_fraction=0, log_dir=str(tmp_path / "one")))[0]
    four = run_on_ranks(4, _train, mix(sources, steps=6, eval_fraction=0, tp=2, dp=2, sequence_parallel=True,
                                       log_dir=str(tmp_path / "four")))[0]
    assert four["losses"] == pytest.approx(one["losses"], abs=1e-4)
    seen = [{k: v for k, v in r.items() if k.startswith("tokens_seen/")} for r in read_metrics(str(tmp_path / "one"))]
    assert seen == [{k: v for k, v in r.items() if k.startswith("tokens_seen/")}
                    for r in read_metrics(str(tmp_path / "four"))]
