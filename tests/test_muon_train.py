"""--optimizer muon through the trainer (tpzoo.train.train): checkpoints hold Muon's momentum (in exp_avg, beside
AdamW's moments of the other parameters); a run resumes bit for bit, and at another dp / ZeRO level with exactly
the saved state (tp and LoRA in the slow tier); MuonClip logs max_attn_logit; bad input ends in one line before any
rank starts; every tensor on the runtime's device."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from preflight_helpers import cli, one_error_line
from test_device_placement import _under_meta
from test_train import _train, _train_capturing_state, store, tiny  # noqa: F401 (store: the fixture)
from tpzoo.testing import run_on_ranks

MUON = dict(model="nano-llama", optimizer="muon", qk_clip=0.03, dtype="bf16", grad_bucket_elems=4096, clip_grad=0.5)


def test_muon_checkpoint_resumes_exactly_and_at_another_dp_and_zero_level(store, tmp_path):
    """Saved at dp 2 ZeRO-1 (bf16, MuonClip on): the same layout resumes on the same losses bit for bit; dp 1
    ZeRO-0 loads exactly the saved weights, master, momentum and moments and continues on the curve."""
    save = str(tmp_path / "run")
    (straight, saved), _ = run_on_ranks(2, _train_capturing_state,
                                        tiny(store, steps=6, dp=2, zero=1, save=save, save_every=3, **MUON), 3)
    kinds = json.loads((Path(save) / "step_00000003" / "train_state.json").read_text())["optimizer_state"]
    assert kinds == ["exp_avg", "exp_avg_sq", "master"]  # exp_avg: Muon's momentum for its matrices
    rows = [json.loads(line) for line in (Path(save) / "metrics.jsonl").read_text().splitlines()]
    assert all(r["max_attn_logit"] > 0 for r in rows)
    # every tensor Muon and MuonClip create is on the runtime's device: under a meta default device (which holds
    # no data) the same run gives the same losses (tests/test_device_placement.py's proof)
    meta = run_on_ranks(2, _under_meta, True, _train, tiny(store, steps=3, dp=2, zero=1, **MUON))[0]
    assert meta["losses"] == straight["losses"][:3]
    resumed = run_on_ranks(2, _train, tiny(store, steps=6, dp=2, zero=1, save=save, resume=f"{save}/step_00000003",
                                           **MUON))[0]
    assert resumed["start_step"] == 3 and resumed["losses"] == straight["losses"][3:]
    (other, loaded), = run_on_ranks(1, _train_capturing_state, tiny(store, steps=6, dp=1, zero=0, save=save,
                                                                    resume=f"{save}/step_00000003", **MUON), 0)
    assert loaded.keys() == saved.keys()
    for name, t in saved.items():
        assert (loaded[name] == t).all(), name
    assert other["losses"] == pytest.approx(straight["losses"][3:], abs=2e-3)


@pytest.mark.slow
def test_muon_resumes_at_another_tp_and_trains_lora(store, tmp_path):
    """Saved at pp 2 (fp32), resumed at tp 2 with SP: momentum and moments resharded, the same curve; then LoRA
    with Muon on that checkpoint at tp 1 and tp 2: the same losses, only the adapters' momentum saved."""
    save = str(tmp_path / "run")
    kw = dict(model="nano-llama", optimizer="muon")
    straight = run_on_ranks(2, _train, tiny(store, steps=6, pp=2, save=save, save_every=3, **kw))[0]
    resumed = run_on_ranks(2, _train, tiny(store, steps=6, tp=2, sequence_parallel=True, save=save,
                                           resume=f"{save}/step_00000003", **kw))[0]
    assert resumed["losses"] == pytest.approx(straight["losses"][3:], abs=2e-3)
    lora = dict(kw, base=f"{save}/step_00000006", lora_rank=4, lora_alpha=8.0, steps=4)
    one = run_on_ranks(1, _train, tiny(store, save=str(tmp_path / "lora1"), **lora))[0]
    two = run_on_ranks(2, _train, tiny(store, tp=2, save=str(tmp_path / "lora2"), **lora))[0]
    assert two["losses"] == pytest.approx(one["losses"], abs=2e-3)
    state = json.loads((tmp_path / "lora2" / "step_00000004" / "train_state.json").read_text())
    assert state["optimizer_state"] == ["exp_avg"]  # the adapters are Muon's: no second moment


@pytest.mark.parametrize("flags,says", [
    (["--optimizer", "sgd"], "argument --optimizer: invalid choice: 'sgd' (choose from 'adamw', 'muon')"),
    (["--optimizer", "muon", "--qk-clip", "-1"], "qk_clip must be >= 0, got -1.0"),
    (["--qk-clip", "10"], "--qk-clip 10 is MuonClip: it needs --optimizer muon"),
    (["--optimizer", "muon", "--qk-clip", "10", "--model", "nano-qwen3.5"],
     "layer 3 normalizes q and k after their projections"),
    (["--optimizer", "muon", "--replicas", "2", "--dp", "2"], "--optimizer muon with --replicas 2"),
])
def test_bad_muon_input_is_one_line_before_any_rank(monkeypatch, capsys, tmp_path, flags, says):
    monkeypatch.chdir(tmp_path)
    one_error_line(*cli(monkeypatch, capsys, "pretrain", *flags), "pretrain", says)


def test_a_matrix_muon_cannot_place_is_one_line():
    """A kind's raw 2-D parameter in a hidden layer (neither a linear layer's weight nor an expert's nor marked
    for AdamW): refused, naming it."""
    import torch
    from torch import nn

    from tpzoo.errors import ConfigError
    from tpzoo.train.muon_matrices import place

    chunk = nn.Module()
    chunk.layers = nn.ModuleDict({"0": nn.Module()})
    chunk.layers["0"].mix = nn.Module()
    chunk.layers["0"].mix.table = nn.Parameter(torch.zeros(4, 4))
    with pytest.raises(ConfigError, match=r"cannot place layers\.0\.mix\.table \[4, 4\]") as e:
        place([chunk])
    assert "\n" not in str(e.value)
    chunk.layers["0"].mix.table.muon = False  # declared AdamW's: placed
    assert place([chunk]) == {}
