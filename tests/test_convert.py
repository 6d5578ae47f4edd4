"""HF <-> tpzoo conversion and resharding: bit-exact round trips, configs and tokenizer files that travel,
transformers loading the output, and clear errors that leave nothing half-written."""
import json
import os

import pytest
import torch

from tpzoo.checkpoint import convert_from_hf, convert_to_hf, read_manifest, reshard
from tpzoo.checkpoint import sources
from tpzoo.cli import main as cli

from checkpoint_helpers import KINDS, assert_bit_exact, ids, safetensors_dir, write_hf

LAYOUTS = {"gpt2": (2, 2), "llama": (4, 2), "llama31-tied": (2, 2), "mistral": (4, 1), "qwen2": (2, 2)}


@pytest.fixture(scope="module")
def hf(tmp_path_factory):
    root = tmp_path_factory.mktemp("hf")
    models = {kind: write_hf(kind, root / kind, tokenizer=kind == "llama") for kind in KINDS}
    return root, models


def _config(path):
    d = json.loads((path / "config.json").read_text())
    d.pop("transformers_version", None)
    return d


@pytest.mark.parametrize("kind", KINDS)
def test_round_trip_is_bit_exact(hf, tmp_path, kind):
    root, _ = hf
    tp, pp = LAYOUTS[kind]
    m = convert_from_hf(root / kind, tmp_path / "ckpt", tp=tp, pp=pp, progress=False)
    assert (m["tp"], m["pp"], len(m["files"])) == (tp, pp, tp * pp)
    assert sorted(m["layer_to_stage"]) == m["layer_to_stage"] and len(m["layer_to_stage"]) == 2
    convert_to_hf(tmp_path / "ckpt", tmp_path / "back", progress=False)
    assert_bit_exact(safetensors_dir(root / kind), safetensors_dir(tmp_path / "back"))
    assert _config(root / kind) == _config(tmp_path / "back")
    for name in os.listdir(root / kind):  # tokenizer and generation files travel there and back
        if name not in ("config.json", "model.safetensors"):
            assert (root / kind / name).read_bytes() == (tmp_path / "back" / name).read_bytes(), name


def test_reshard_chain_and_small_pieces(hf, tmp_path, monkeypatch):
    """tp2pp1 -> tp4pp2 -> tp1pp1 -> HF, bit-exact; tiny pieces force every slicing path (rows, columns,
    replicated kv heads, vocab padding rows) to be streamed in many parts."""
    root, _ = hf
    monkeypatch.setattr(sources, "PIECE_BYTES", 200)
    for kind in ("llama", "llama31-tied"):  # GQA (kv heads replicated at tp=4), and a tied head split over pp
        d = tmp_path / kind
        convert_from_hf(root / kind, d / "t2p1", tp=2, pp=1, progress=False)
        assert cli(["reshard", str(d / "t2p1"), str(d / "t4p2"), "--tp", "4", "--pp", "2", "--quiet",
                    "--checksum", "sha256"]) == 0
        assert read_manifest(d / "t4p2")["files"][0]["checksum"].startswith("sha256:")
        reshard(d / "t4p2", d / "t1p1", tp=1, pp=1, progress=False)
        assert read_manifest(d / "t1p1")["tp"] == 1
        assert cli(["convert", "to-hf", str(d / "t1p1"), str(d / "hf"), "--quiet"]) == 0
        assert_bit_exact(safetensors_dir(root / kind), safetensors_dir(d / "hf"))
        assert _config(root / kind) == _config(d / "hf")


def test_sharded_and_bin_inputs_and_sharded_output_load_in_transformers(hf, tmp_path):
    import transformers

    root, models = hf
    ref = models["qwen2"](input_ids=ids()).logits
    write_hf("qwen2", tmp_path / "sharded", max_shard_size="40KB")
    assert (tmp_path / "sharded" / "model.safetensors.index.json").exists()
    convert_from_hf(tmp_path / "sharded", tmp_path / "ckpt", tp=2, pp=1, progress=False)
    convert_to_hf(tmp_path / "ckpt", tmp_path / "out", max_shard_size="50KB", progress=False)
    index = json.loads((tmp_path / "out" / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1
    assert_bit_exact(safetensors_dir(tmp_path / "sharded"), safetensors_dir(tmp_path / "out"))
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()
    with torch.no_grad():
        assert torch.equal(loaded(input_ids=ids()).logits, ref)
    # pytorch_model.bin fallback (weights_only load)
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    torch.save(models["qwen2"].state_dict(), bin_dir / "pytorch_model.bin")
    (bin_dir / "config.json").write_text((root / "qwen2" / "config.json").read_text())
    convert_from_hf(bin_dir, tmp_path / "ckpt-bin", tp=1, pp=1, progress=False)
    convert_to_hf(tmp_path / "ckpt-bin", tmp_path / "out-bin", progress=False)
    assert_bit_exact(safetensors_dir(root / "qwen2"), safetensors_dir(tmp_path / "out-bin"))


def test_dtype_conversion(hf, tmp_path):
    root, _ = hf
    m = convert_from_hf(root / "gpt2", tmp_path / "bf16", tp=2, pp=1, dtype="bf16", progress=False)
    assert m["dtype"] == "bfloat16"
    convert_to_hf(tmp_path / "bf16", tmp_path / "out", progress=False)
    src, out = safetensors_dir(root / "gpt2"), safetensors_dir(tmp_path / "out")
    assert all(torch.equal(src[k].bfloat16(), out[k]) for k in src)
    assert json.loads((tmp_path / "out" / "config.json").read_text())["dtype"] == "bfloat16"
    convert_to_hf(tmp_path / "bf16", tmp_path / "fp32", dtype="fp32", progress=False)  # and back up, exactly
    back = safetensors_dir(tmp_path / "fp32")
    assert all(back[k].dtype == torch.float32 and torch.equal(back[k], out[k].float()) for k in src)


def _expect_error(args, match, capsys, parent):
    before = sorted(os.listdir(parent))
    assert cli(args) == 2
    assert match in capsys.readouterr().err
    assert sorted(os.listdir(parent)) == before  # nothing half-written (no DST, no temporary directory)


def test_clear_errors_leave_nothing_behind(hf, tmp_path, capsys):
    from safetensors.torch import load_file, save_file

    root, _ = hf
    out = tmp_path / "out"
    out.mkdir()
    dst = str(out / "ckpt")
    _expect_error(["convert", "from-hf", str(root / "llama"), dst, "--tp", "3"], "tp=3 does not divide", capsys, out)
    bad = tmp_path / "bert"
    bad.mkdir()
    (bad / "config.json").write_text(json.dumps({"model_type": "bert", "architectures": ["BertModel"]}))
    (bad / "model.safetensors").write_bytes((root / "llama" / "model.safetensors").read_bytes())
    _expect_error(["convert", "from-hf", str(bad), dst], "unsupported architecture", capsys, out)
    missing = tmp_path / "missing"
    missing.mkdir()
    (missing / "config.json").write_text((root / "llama" / "config.json").read_text())
    weights = load_file(root / "llama" / "model.safetensors")
    save_file({k: v for k, v in weights.items() if "layers.1.mlp.up_proj" not in k}, missing / "model.safetensors",
              metadata={"format": "pt"})
    _expect_error(["convert", "from-hf", str(missing), dst], "model.layers.1.mlp.up_proj.weight", capsys, out)
    wrong = tmp_path / "wrong"
    wrong.mkdir()
    cfg = json.loads((root / "llama" / "config.json").read_text())
    (wrong / "config.json").write_text(json.dumps({**cfg, "intermediate_size": 64}))
    (wrong / "model.safetensors").write_bytes((root / "llama" / "model.safetensors").read_bytes())
    _expect_error(["convert", "from-hf", str(wrong), dst], "shape mismatch", capsys, out)
    _expect_error(["convert", "from-hf", str(tmp_path / "nope"), dst], "no such file", capsys, out)
    _expect_error(["convert", "from-hf", "no-such-org/no-such-model", dst], "hub", capsys, out)
    assert cli(["convert", "from-hf", str(root / "llama"), dst, "--quiet"]) == 0
    capsys.readouterr()
    stamp = os.path.getmtime(out / "ckpt" / "manifest.json")
    _expect_error(["convert", "from-hf", str(root / "llama"), dst], "already exists", capsys, out)
    _expect_error(["reshard", dst, dst, "--tp", "2"], "already exists", capsys, out)
    _expect_error(["convert", "to-hf", dst, dst], "already exists", capsys, out)
    # --force with a failing conversion keeps the old checkpoint
    _expect_error(["convert", "from-hf", str(root / "llama"), dst, "--tp", "3", "--force"], "tp=3", capsys, out)
    assert os.path.getmtime(out / "ckpt" / "manifest.json") == stamp
    assert cli(["convert", "from-hf", str(root / "llama"), dst, "--tp", "2", "--force", "--quiet"]) == 0
    assert read_manifest(dst)["tp"] == 2 and sorted(os.listdir(out)) == ["ckpt"]


def test_models_and_inspect_commands(hf, tmp_path, capsys):
    from tpzoo.models import get_config

    assert cli(["models"]) == 0
    listing = capsys.readouterr().out
    assert "llama-3-8b" in listing and "meta-llama/Meta-Llama-3-8B" in listing
    assert f"{get_config('llama-3-8b').num_parameters() / 1e9:.2f}B" in listing
    # every column in line, past the longest names (moonlight-16b-a3b-4l, qwen3-next-80b-a3b, deepseek_v3)
    head, *rows = listing.splitlines()
    assert "moonlight-16b-a3b-4l" in listing
    for row in rows:
        name, family = row.split()[:2]
        assert row.index(family, len(name)) == head.index("family"), (head, row)
        assert row[head.index("hf source") - 3] != " " and row[head.index("hf source") - 2] == " ", (head, row)
    root, _ = hf
    convert_from_hf(root / "llama", tmp_path / "c", tp=2, pp=2, progress=False)
    assert cli(["inspect", str(tmp_path / "c"), "--verify"]) == 0
    text = capsys.readouterr().out
    assert "tp=2 pp=2" in text and "layers.1.attn.qkv.weight" in text and "4 of 4 files ok" in text
    tensors = [line for line in text.splitlines() if line.endswith(("pp 0", "pp 1"))]
    assert len({line.index("(") for line in tensors}) == 1, tensors  # the shapes in one column
    assert "tokenizer.json" in text
