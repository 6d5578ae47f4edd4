"""Quantized Hugging Face checkpoints in and out (tpzoo.quant; tests/quant_models.py builds them):

- block FP8 (a DeepSeek-V3 with ragged edge blocks whose index puts weights and their scales in different shards):
  `convert from-hf --dtype fp32` equals the block-by-block reference bit for bit, and the default (the checkpoint's
  bf16) that reference rounded once; compressed-tensors int4 equals its own unpacking x scales (fp32) and its
  `decompress` (bf16) bit for bit;
- `--keep-quantized --tp 2`: the stored bytes (<= 0.6x the bf16 import for FP8), `tpzoo inspect` names the
  quantized tensors, a reshard keeps them, and `convert to-hf` gives back every source tensor byte for byte with the
  source's config.json (quantization_config included);
- bad input: one line naming the tensor or field, nothing written;
- `convert to-hf --quantize fp8-block`: transformers' own FP8 loader reads it, every quantized weight within half an
  e4m3 step of the source and the embeddings, head, norms, routers untouched.
"""
from __future__ import annotations

import json
import os
import shutil

import pytest
import torch
from checkpoint_helpers import assert_bit_exact, safetensors_dir
from quant_models import dequant_fp8_reference, dequant_int4_reference, write_fp8, write_int4

from tpzoo.checkpoint import read_manifest
from tpzoo.cli import main as cli

pytest.importorskip("compressed_tensors")


@pytest.fixture(scope="module")
def fp8(tmp_path_factory):
    path = tmp_path_factory.mktemp("fp8") / "deepseek"
    return path, write_fp8("deepseek_v3", path)


@pytest.fixture(scope="module")
def int4(tmp_path_factory):
    path = tmp_path_factory.mktemp("int4") / "kimi"
    return path, write_int4(path)


def _convert(*args) -> None:
    assert cli(["convert", *map(str, args), "--quiet"]) == 0


def test_fp8_import_is_the_block_reference_bit_for_bit(fp8, tmp_path, capsys):
    src, tensors = fp8
    index = json.loads((src / "model.safetensors.index.json").read_text())["weight_map"]
    scales = [n for n in tensors if n.endswith("_scale_inv")]
    assert any(index[n] != index[n[: -len("_scale_inv")]] for n in scales)  # pairs across shards
    assert any(tensors[n].shape[-1] * 128 != tensors[n[: -len("_scale_inv")]].shape[-1] for n in scales)  # ragged
    for dtype, args in ((torch.float32, ["--dtype", "fp32"]), (torch.bfloat16, [])):  # default: the source's bf16
        _convert("from-hf", src, tmp_path / "ckpt", "--tp", "2", "--force", *args)
        assert "dequantized to" in capsys.readouterr().err
        _convert("to-hf", tmp_path / "ckpt", tmp_path / "hf", "--force")
        out = safetensors_dir(tmp_path / "hf")
        assert set(out) == {n for n in tensors if not n.endswith("_scale_inv")}
        for name, t in out.items():
            scale = tensors.get(name + "_scale_inv")
            want = tensors[name].to(dtype) if scale is None else dequant_fp8_reference(tensors[name], scale, dtype)
            assert t.dtype == dtype and torch.equal(t, want), name
        assert "quantization_config" not in json.loads((tmp_path / "hf" / "config.json").read_text())


def test_int4_import_equals_compressed_tensors(int4, tmp_path):
    from compressed_tensors.compressors import PackedQuantizationCompressor
    from compressed_tensors.config import CompressionFormat  # noqa: F401 (the package's formats register)
    from compressed_tensors.quantization import QuantizationConfig

    src, tensors = int4
    qcfg = QuantizationConfig.model_validate(json.loads((src / "config.json").read_text())["quantization_config"])
    scheme = qcfg.config_groups["group_0"]
    modules = sorted(n[: -len(".weight_packed")] for n in tensors if n.endswith(".weight_packed"))
    assert len(modules) == 12  # 4 experts x gate, up, down
    for dtype, args in ((torch.float32, ["--dtype", "fp32"]), (torch.bfloat16, [])):
        _convert("from-hf", src, tmp_path / "ckpt", "--force", *args)
        _convert("to-hf", tmp_path / "ckpt", tmp_path / "hf", "--force")
        out = safetensors_dir(tmp_path / "hf")
        for m in modules:
            packed, scale, shape = (tensors[f"{m}.weight_{k}"] for k in ("packed", "scale", "shape"))
            if dtype == torch.float32:
                want = dequant_int4_reference(packed, scale, shape.tolist())
            else:  # the package's own decompression, in the scales' dtype
                want = PackedQuantizationCompressor.decompress(
                    {"weight_packed": packed, "weight_scale": scale, "weight_shape": shape}, scheme)["weight"]
            assert out[m + ".weight"].dtype == dtype and torch.equal(out[m + ".weight"], want), m
        assert torch.equal(out["model.layers.0.self_attn.o_proj.weight"].to(torch.bfloat16),
                           tensors["model.layers.0.self_attn.o_proj.weight"])


def test_kept_checkpoints_hold_the_source_bytes_and_export_them_byte_identical(fp8, int4, tmp_path, capsys):
    for name, (src, _) in (("fp8", fp8), ("int4", int4)):
        kept = tmp_path / f"{name}-kept"
        _convert("from-hf", src, kept, "--keep-quantized", "--tp", "2")
        m = read_manifest(kept)
        record = m["model_config"]["quantization"]
        assert record["format"] == {"fp8": "fp8_block", "int4": "int4_pack"}[name]
        assert m["dtype"] == "bfloat16"  # the model's dtype, not its quantized tensors'
        dtypes = {n: t["dtype"] for n, t in m["tensors"].items()}
        if name == "fp8":
            assert len(record["tensors"]) == 16  # q_a, q_b, kv_a, kv_b, o x 2 layers, dense gate|up and down,
            #                                      the experts' gate|up and down, the shared expert's two
            assert dtypes["layers.1.mlp.gate_up"] == "F8_E4M3" and dtypes["layers.1.mlp.gate_up_scale_inv"] == "F32"
            assert dtypes["layers.1.mlp.router.weight"] == "BF16"
            _convert("from-hf", src, tmp_path / "bf16", "--dtype", "bf16")
            size = lambda d: sum(f["bytes"] for f in read_manifest(d)["files"])  # noqa: E731
            assert size(kept) <= 0.6 * size(tmp_path / "bf16"), (size(kept), size(tmp_path / "bf16"))
        else:
            assert record["tensors"] == ["layers.1.mlp.gate_up", "layers.1.mlp.down"]
            assert dtypes["layers.1.mlp.gate_up"] == "I32" and dtypes["layers.1.mlp.down_scale"] == "BF16"
        capsys.readouterr()
        assert cli(["inspect", str(kept)]) == 0
        text = capsys.readouterr().out
        assert f"quantized: {len(record['tensors'])} weights kept in {record['format']}" in text
        assert f"layers.1.mlp.down_scale{'_inv' if name == 'fp8' else ''}" in text
        # a reshard (asked for fp32) keeps the stored bytes; the export gives the source back
        assert cli(["reshard", str(kept), str(tmp_path / f"{name}-tp1"), "--tp", "1", "--dtype", "fp32",
                    "--quiet"]) == 0
        _convert("to-hf", tmp_path / f"{name}-tp1", tmp_path / f"{name}-hf", "--dtype", "bf16")
        assert_bit_exact(safetensors_dir(src), safetensors_dir(tmp_path / f"{name}-hf"))
        # the source's config.json verbatim, but for the multi-token-prediction count: transformers' DeepSeek-V3
        # config says 1 over a checkpoint without those weights, and an export counts the depths it holds (none)
        source, exported = (json.loads((d / "config.json").read_text()) for d in (src, tmp_path / f"{name}-hf"))
        assert source.pop("num_nextn_predict_layers") == 1 and exported.pop("num_nextn_predict_layers") == 0
        assert source == exported


def test_kept_fused_weights_with_ragged_parts_compute_as_the_fp32_import(tmp_path):
    """q|k|v (160, 80, 80 rows) and gate|up (200 each): every part ends in a partial block of its own, which the
    fused scales keep apart; the kept model's logits equal the fp32 import's exactly."""
    from tpzoo.checkpoint import convert_from_hf, load_model
    from tpzoo.models import Inputs

    write_fp8("qwen3_ragged", tmp_path / "hf")
    convert_from_hf(tmp_path / "hf", tmp_path / "kept", keep_quantized=True, progress=False)
    convert_from_hf(tmp_path / "hf", tmp_path / "fp32", dtype="fp32", progress=False)
    assert read_manifest(tmp_path / "kept")["tensors"]["layers.0.attn.qkv.weight_scale_inv"]["shape"] == [4, 2]
    ids = torch.randint(0, 259, (2, 9), generator=torch.Generator().manual_seed(0))
    kept, full = (load_model(tmp_path / n, dtype=torch.float32, device="cpu") for n in ("kept", "fp32"))
    with torch.no_grad():
        assert torch.equal(kept(Inputs(ids)), full(Inputs(ids)))


def _expect_error(args, match, capsys, parent):
    before = sorted(os.listdir(parent))
    assert cli(args) == 2
    err = capsys.readouterr().err
    assert match in err and len(err.strip().splitlines()) == 1, err
    assert sorted(os.listdir(parent)) == before  # nothing written, no temporary directory left


def _variant(src, dst, config=None, tensors=None, drop=()):
    """A copy of checkpoint `src` with config.json fields changed, tensors replaced, or index entries dropped."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst)
    if config:
        c = json.loads((dst / "config.json").read_text())
        c["quantization_config"].update(config)
        (dst / "config.json").write_text(json.dumps(c))
    if drop:
        index = json.loads((dst / "model.safetensors.index.json").read_text())
        for n in drop:
            del index["weight_map"][n]
        (dst / "model.safetensors.index.json").write_text(json.dumps(index))
    for f in dst.glob("*.safetensors") if tensors else ():
        t = load_file(str(f))
        if set(tensors) & set(t):
            t.update({k: v for k, v in tensors.items() if k in t})
            save_file(t, str(f), metadata={"format": "pt"})
    return dst


def test_bad_quantized_input_is_one_line_and_writes_nothing(fp8, int4, tmp_path, capsys):
    (src, _), (src4, t4) = fp8, int4
    out = tmp_path / "out"
    out.mkdir()
    dst = str(out / "ckpt")
    w = "model.layers.0.self_attn.o_proj.weight"
    e = "model.layers.1.mlp.experts.1.down_proj"
    cases = [
        (_variant(src, tmp_path / "a", config={"weight_block_size": [64, 64]}), "weight_block_size=[64, 64]"),
        (_variant(src, tmp_path / "b", config={"fmt": "e5m2"}), "quantization_config.fmt='e5m2'"),
        (_variant(src, tmp_path / "c", config={"quant_method": "gptq"}), "quant_method='gptq'"),
        (_variant(src, tmp_path / "d", drop=[w + "_scale_inv"]), f"{w} has no {w}_scale_inv"),
        (_variant(src, tmp_path / "e", tensors={w + "_scale_inv": torch.ones(1, 1)}), f"{w}_scale_inv has shape"),
        (_variant(src4, tmp_path / "f", config={"format": "float-quantized"}), "format='float-quantized'"),
        (_variant(src4, tmp_path / "g", tensors={e + ".weight_shape": torch.tensor([192, 512])}),
         f"{e}.weight_shape = [192, 512] disagrees"),
        (_variant(src4, tmp_path / "h", config={"ignore": ["re:.*experts.*"]}), "is in quantization_config.ignore"),
    ]
    for path, match in cases:
        _expect_error(["convert", "from-hf", str(path), dst, "--quiet"], match, capsys, out)
    # a tensor-parallel split that would cut a block: o_proj's 256 input columns over 4 ranks
    _expect_error(["convert", "from-hf", str(src), dst, "--keep-quantized", "--tp", "4", "--quiet"],
                  "layers.0.attn.o_proj.weight: tp=4 would cut its fp8_block blocks", capsys, out)
    assert t4  # (the fixture's tensors stay as written)


def test_quantize_fp8_block_export_loads_in_transformers(tmp_path):
    """A bf16 Qwen3 (every dim a multiple of 128: transformers' CPU loader dequantizes those right) imported, then
    exported with --quantize fp8-block: transformers reads it; each quantized weight is within half an e4m3 step
    of the source, the rest are the source's bytes; tpzoo reads the export back as transformers does."""
    from quant_models import hf_model
    from transformers import AutoModelForCausalLM

    src = tmp_path / "hf"
    hf_model("qwen3").to(torch.bfloat16).save_pretrained(src)
    source = safetensors_dir(src)
    _convert("from-hf", src, tmp_path / "ckpt")
    _convert("to-hf", tmp_path / "ckpt", tmp_path / "fp8", "--quantize", "fp8-block")
    out = safetensors_dir(tmp_path / "fp8")
    config = json.loads((tmp_path / "fp8" / "config.json").read_text())
    assert config["quantization_config"]["weight_block_size"] == [128, 128]
    quantized = sorted(n for n, t in out.items() if t.dtype == torch.float8_e4m3fn)
    assert len(quantized) == 14 and all(n + "_scale_inv" in out for n in quantized)  # 7 projections x 2 layers
    for name, t in source.items():
        if name not in quantized:
            assert torch.equal(out[name], t), name  # embeddings, head, norms untouched
            continue
        q, scale = out[name].float(), out[name + "_scale_inv"]
        assert torch.equal(scale, t.float().unflatten(0, (-1, 128)).unflatten(-1, (-1, 128)).abs().amax((1, 3)) / 448)
        step = torch.where(q.abs() < 2 ** -6, torch.full_like(q, 2 ** -9),
                           torch.exp2(torch.floor(torch.log2(q.abs().clamp(min=2 ** -6))) - 3))  # e4m3's ulp at q
        err = (q * scale.repeat_interleave(128, 0).repeat_interleave(128, 1) - t.float()).abs()
        # (ties land exactly on the half step; the fp32 division and product add a few ulps of fp32)
        assert (err <= 0.5 * step * scale.repeat_interleave(128, 0).repeat_interleave(128, 1) * (1 + 1e-5)).all()
    hf = AutoModelForCausalLM.from_pretrained(tmp_path / "fp8", dtype=torch.float32)
    theirs = dict(hf.named_parameters())
    _convert("from-hf", tmp_path / "fp8", tmp_path / "back", "--dtype", "fp32")
    _convert("to-hf", tmp_path / "back", tmp_path / "back-hf")
    back = safetensors_dir(tmp_path / "back-hf")
    for name in quantized:
        assert torch.equal(theirs[name], back[name]), name
