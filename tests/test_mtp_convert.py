"""Multi-token prediction's Hugging Face layouts (models/mtp_hf.py) through `convert from-hf` and `convert to-hf`, on
tiny checkpoints written by transformers with the MTP weights added as the published ones hold them
(tests/mtp_models.py), fp32:

- every family's layout round-trips bit for bit at tp 2 and pp 2 (the depths on the last stage): DeepSeek-V3's two
  depths model.layers.{n}, {n+1}.* with their copies of the embedding and head, GLM-4.5's, Qwen3.5's / Qwen3.5-MoE's
  mtp.* counted in mtp_num_hidden_layers, Qwen3-Next's mtp.* whose config has no count (the tensors say); the
  config's count comes back as it was;
- the converted checkpoint's (tp 1) evaluation loss and mtp_loss equal the reference's built on transformers' modules
  (1e-4), for every family;
- the depths are the model's own kinds (MLA + DeepSeekMoE, attention + MoE), built by the registry;
- a checkpoint whose config counts a depth it does not hold builds none, exports none and a count of 0.
"""
import json
from pathlib import Path

import pytest
import torch
from mtp_models import COUNT, DEPTHS, FAMILIES, MAIN_LAYERS, QWEN, write_checkpoint
from safetensors import safe_open

from tpzoo.checkpoint import convert_from_hf, convert_to_hf, load_model
from tpzoo.checkpoint.format import read_manifest
from tpzoo.evaluation import evaluate, token_windows

SEQ = 12

LAYOUT = {"deepseek_v3": dict(tp=2, pp=2), "glm4_moe": dict(tp=2), "qwen3_next": dict(pp=2),
          "qwen3_5": dict(tp=2), "qwen3_5_moe": dict(tp=2, pp=2)}
KINDS_OF_DEPTH = {"deepseek_v3": ("mla", "moe"), "glm4_moe": ("attention", "moe"), "qwen3_next": ("attention", "moe"),
                  "qwen3_5": ("attention", "mlp"), "qwen3_5_moe": ("attention", "moe")}


def _tensors(path) -> dict:
    out = {}
    for f in sorted(Path(path).glob("*.safetensors")):
        with safe_open(str(f), "pt") as st:
            out.update({k: st.get_tensor(k) for k in st.keys()})
    return out


def _mtp_names(kind, names):
    n = MAIN_LAYERS[kind]
    if kind in QWEN:
        return {k for k in names if k.startswith("mtp.")}
    return {k for k in names if k.startswith("model.layers.") and int(k.split(".")[2]) >= n}


@pytest.mark.parametrize("kind", FAMILIES)
def test_round_trip_keeps_the_depths_bit_exact(kind, tmp_path):
    ref = write_checkpoint(kind, tmp_path / "hf")
    original = _tensors(tmp_path / "hf")
    mtp = _mtp_names(kind, original)
    assert len(mtp) > 8 and any("eh_proj" in k or k == "mtp.fc.weight" for k in mtp)
    manifest = convert_from_hf(str(tmp_path / "hf"), tmp_path / "ckpt", progress=False, **LAYOUT[kind])
    cfg = manifest["model_config"]
    assert cfg["mtp"]["num_layers"] == DEPTHS[kind]
    assert "notes" not in manifest["metadata"] or not any("multi-token" in n for n in manifest["metadata"]["notes"])
    tokens = torch.randint(0, ref.big.config.vocab_size, (2 * SEQ + 1,), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        want = [float(x) for x in ref.losses([w[None] for w in token_windows(tokens, SEQ)])]
    got = evaluate(load_model(str(tmp_path / "ckpt")), tokens, SEQ)
    assert [got["loss"], got["mtp_loss"]] == pytest.approx(want, abs=1e-4)
    convert_to_hf(str(tmp_path / "ckpt"), tmp_path / "back", progress=False)
    back = _tensors(tmp_path / "back")
    assert sorted(back) == sorted(original)
    for name, t in original.items():
        assert back[name].dtype == t.dtype and torch.equal(back[name], t), name
    src = json.loads((tmp_path / "hf" / "config.json").read_text())
    out = json.loads((tmp_path / "back" / "config.json").read_text())
    if kind in COUNT:
        assert out[COUNT[kind]] == src[COUNT[kind]] == DEPTHS[kind]
    else:  # Qwen3-Next: no count field, in or out
        assert not any("mtp" in k for k in out)


@pytest.mark.parametrize("kind", ["deepseek_v3", "qwen3_next"])
def test_the_depths_are_the_models_kinds(kind, tmp_path):
    write_checkpoint(kind, tmp_path / "hf")
    model = load_model(str(tmp_path / "hf"))
    n = MAIN_LAYERS[kind]
    for j in range(DEPTHS[kind]):
        assert (model.cfg.token_mixer(n + j), model.cfg.channel_mixer(n + j)) == KINDS_OF_DEPTH[kind]
        block = model.mtp.layers[str(j)].block
        assert type(block) is type(model.layers[str(n - 1)])  # the registry's block, not a second model


@pytest.mark.parametrize("kind", ["deepseek_v3", "qwen3_5"])
def test_a_count_without_weights_builds_and_exports_none(kind, tmp_path):
    write_checkpoint(kind, tmp_path / "hf", with_mtp=False)  # the config still counts the depths
    assert not _mtp_names(kind, _tensors(tmp_path / "hf"))
    manifest = convert_from_hf(str(tmp_path / "hf"), tmp_path / "ckpt", tp=2, progress=False)
    assert manifest["model_config"].get("mtp") is None
    notes = manifest["metadata"].get("notes", [])
    assert len(notes) == 1 and "holds none" in notes[0], notes
    assert read_manifest(tmp_path / "ckpt")["model_config"].get("mtp") is None
    convert_to_hf(str(tmp_path / "ckpt"), tmp_path / "back", progress=False)
    assert not _mtp_names(kind, _tensors(tmp_path / "back"))
    assert json.loads((tmp_path / "back" / "config.json").read_text())[COUNT[kind]] == 0
