"""Checkpoints written before the model was restructured by layer kinds (issue 31) load and resume bit for bit.

tests/fixtures/pre_kinds/ holds, for nano-mixtral (attention + mixture of experts with the router loss) and
nano-gpt (learned positions, LayerNorm, biases, dense MLP), a step-2 training checkpoint written by the old code
(flat model_config in its manifest) and the old code's losses and grad norms of steps 3 and 4 of that run
(tests/fixtures/make_pre_kinds_checkpoints.py says how they were made). Resuming with today's code must give
exactly those numbers: the config, parameter names, optimizer state and the numerics are unchanged."""
import dataclasses
import json
import shutil
from pathlib import Path

import pytest

from tpzoo.models import ModelConfig, get_config

FIXTURE = Path(__file__).parent / "fixtures" / "pre_kinds"
EXPECTED = json.loads((FIXTURE / "expected.json").read_text())
_WRITTEN_AT = Path("/work/wt/kinds/tests/fixtures/pre_kinds")  # where make_pre_kinds_checkpoints.py ran


def _config(model: str, run: Path):
    import importlib.util

    spec = importlib.util.spec_from_file_location("make_pre_kinds", FIXTURE.parent / "make_pre_kinds_checkpoints.py")
    maker = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(maker)
    return maker.config(model, str(FIXTURE / "store"), str(run), resume=str(run / "step_00000002"))


@pytest.mark.parametrize("model", sorted(EXPECTED))
def test_an_old_checkpoint_resumes_bit_exact(tmp_path, model):
    from tpzoo.train import train

    run = tmp_path / model
    shutil.copytree(FIXTURE / model, run)
    # The fixture was written in another checkout: its run's data path names that checkout's store. Point it at
    # this one's (the same tokens), as a user who moved the run and its data together would.
    state = run / "step_00000002" / "train_state.json"
    state.write_text(state.read_text().replace(json.dumps(str(_WRITTEN_AT))[1:-1], str(FIXTURE)))
    manifest = json.loads((run / "step_00000002" / "manifest.json").read_text())
    old = manifest["model_config"]
    assert "num_heads" in old and "attention" not in old  # the flat format of before
    assert ModelConfig.from_dict(old) == get_config(model).replace(vocab_size=old["vocab_size"])
    result = train(_config(model, run))
    assert result["start_step"] == 2 and result["steps"] == [3, 4]
    assert result["losses"] == EXPECTED[model]["losses"]
    assert result["grad_norms"] == EXPECTED[model]["grad_norms"]


def test_flat_and_nested_configs_are_one_config():
    """Every named config reads back from its nested dict and from the flat one of before (the FLAT table), and
    its flat names read the nested fields; a flat field that contradicts the nested one, or an unknown one, is
    refused naming it."""
    from tpzoo.errors import ConfigError
    from tpzoo.models import list_configs
    from tpzoo.models.config import FLAT

    for cfg in list_configs().values():
        nested = cfg.to_dict()
        flat = {k: v for k, v in nested.items() if k not in ("attention", "mlp", "moe")}
        flat.update({name: nested[group][field] for name, (group, field) in FLAT.items()})
        assert ModelConfig.from_dict(nested) == ModelConfig.from_dict(json.loads(cfg.to_json())) == cfg
        # (configs using sub-config fields the flat format never had, the 2025 families', have no flat form)
        flat_fields = set(FLAT.values())
        if all(nested[group][f.name] == f.default for group in ("attention", "mlp", "moe") if nested[group]
               for f in dataclasses.fields(type(getattr(cfg, group))) if (group, f.name) not in flat_fields
               and f.default is not dataclasses.MISSING):
            assert ModelConfig.from_dict(flat) == cfg
        assert all(getattr(cfg, name) == nested[group][field] for name, (group, field) in FLAT.items())
    with pytest.raises(ConfigError, match=r"num_heads=8 contradicts attention.num_heads=4"):
        ModelConfig.from_dict({**get_config("nano-llama").to_dict(), "num_heads": 8})
    with pytest.raises(ConfigError, match=r"unknown ModelConfig.moe fields: \['experts'\]"):
        ModelConfig.from_dict({**get_config("nano-llama").to_dict(), "moe": {"experts": 4}})
