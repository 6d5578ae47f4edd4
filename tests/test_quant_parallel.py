"""Kept-quantized checkpoints at work across ranks (gloo, strict collectives), against transformers and against
the same model imported at fp32:

- evaluation of a kept checkpoint at tp 2 + SP and at ep 2 gives transformers' loss (1e-4): a block-FP8
  DeepSeek-V3 with ragged blocks (transformers on its block-by-block dequantized weights: its own CPU loader
  mis-scales ragged shapes), a block-FP8 Qwen3 (transformers' own FP8 loader) and an int4 DeepSeek-V3 with
  compressed-tensors experts (transformers on the package's dequantization), one spawned run for every layout;
- LoRA on a kept base: the losses of `finetune --base KEPT --lora-rank R` equal those on the fp32 import (1e-5) at
  tp 2 + SP (here), tp 1 and ep 2 (slow), the frozen projections holding fp8 weights; `--merge` of such a run
  writes the merged weights the fp32 import's run merges; a full fine-tune of KEPT is refused in one line.
"""
from __future__ import annotations

import json
import sysconfig
from pathlib import Path

import pytest
import torch
from checkpoint_helpers import safetensors_dir
from quant_models import (dequant_fp8_reference, dequant_int4_reference, evaluate_kept, hf_loss, write_fp8,
                          write_int4)

from tpzoo.checkpoint import convert_from_hf
from tpzoo.testing import run_on_ranks

pytest.importorskip("compressed_tensors")
def _dense_copy(src: Path, dst: Path, tensors: dict) -> Path:
    """`src` with its quantized weights replaced by the reference dequantization (fp32), unquantized."""
    from safetensors.torch import save_file

    dense = {}
    for name, t in tensors.items():
        if name.endswith("_scale_inv") or name.endswith(("weight_scale", "weight_shape")):
            continue
        if name + "_scale_inv" in tensors:
            dense[name] = dequant_fp8_reference(t, tensors[name + "_scale_inv"])
        elif name.endswith(".weight_packed"):
            m = name[: -len("_packed")]
            dense[m] = dequant_int4_reference(t, tensors[m + "_scale"], tensors[m + "_shape"].tolist())
        else:
            dense[name] = t.float()
    dst.mkdir()
    save_file(dense, str(dst / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((src / "config.json").read_text())
    del config["quantization_config"]
    (dst / "config.json").write_text(json.dumps({**config, "dtype": "float32"}))
    return dst


@pytest.fixture(scope="module")
def kept(tmp_path_factory):
    """kept(name) -> (kept checkpoint, transformers' loss), built on first use."""
    root, out = tmp_path_factory.mktemp("quant"), {}
    writers = {"deepseek_fp8": (lambda p: write_fp8("deepseek_v3", p), 2),
               "qwen3_fp8": (lambda p: write_fp8("qwen3", p), 1), "deepseek_int4": (write_int4, 2)}

    def get(name):
        if name not in out:
            writer, tp = writers[name]
            src = root / name
            tensors = writer(src)
            convert_from_hf(src, root / (name + "-kept"), tp=tp, keep_quantized=True, progress=False)
            oracle = src if name == "qwen3_fp8" else _dense_copy(src, root / (name + "-dense"), tensors)
            out[name] = (str(root / (name + "-kept")), hf_loss(oracle))
        return out[name]
    return get


SLOW = pytest.mark.slow


@pytest.mark.parametrize("cases", [
    [("deepseek_fp8", 2, 1, True), ("deepseek_fp8", 1, 2, False), ("deepseek_int4", 1, 2, False)],
    pytest.param([("qwen3_fp8", 2, 1, True), ("deepseek_int4", 2, 1, True)], marks=SLOW)])
def test_kept_checkpoints_evaluate_as_transformers_at_tp2_and_ep2(kept, cases):
    """(the Qwen3's oracle is transformers' own FP8 loader; the others', transformers on the reference
    dequantization)"""
    results = run_on_ranks(2, evaluate_kept, [(kept(n)[0], tp, ep, sp) for n, tp, ep, sp in cases])[0]
    for (name, tp, ep, _), (loss, stored) in zip(cases, results):
        assert stored == (["torch.float8_e4m3fn"] if name.endswith("fp8") else ["torch.int32"]), (name, stored)
        assert abs(loss - kept(name)[1]) < 1e-4, (name, tp, ep, loss, kept(name)[1])


# -- LoRA on a kept base --------------------------------------------------------------------------------------------

def _train(cfg):
    from tpzoo.train import train

    return train(cfg)


@pytest.fixture(scope="module")
def lora_bases(tmp_path_factory):
    """The FP8 DeepSeek-V3 kept (at tp 2) and imported at fp32, and a byte-tokenized store."""
    from tpzoo.data import iter_documents, preprocess

    root = tmp_path_factory.mktemp("lora")
    write_fp8("deepseek_v3", root / "hf")
    convert_from_hf(root / "hf", root / "kept", tp=2, keep_quantized=True, progress=False)
    convert_from_hf(root / "hf", root / "fp32", dtype="fp32", progress=False)
    lib = Path(sysconfig.get_paths()["stdlib"])
    store = str(preprocess(iter_documents([str(lib / "textwrap.py")]), "byte", root / "store").path)
    return root, store


def _lora_losses(root, store, base: str, tp: int, ep: int, sp: bool, steps: int = 3) -> tuple[list, str]:
    from tpzoo.train import load_config

    run = root / f"run-{base}-{tp}-{ep}"
    cfg = dict(base=str(root / base), data=[store], lora_rank=4, lora_alpha=8.0, lora_experts=True, seq_len=16, global_batch_size=4,
               micro_batch_size=2, steps=steps, lr=1e-2, warmup_steps=1, tp=tp, ep=ep, sequence_parallel=sp,
               save=str(run), sample_prompt="", quiet=True, eval_fraction=0.0, seed=0, prefetch=1, dtype="fp32",
               tokenizer="byte")
    result = run_on_ranks(max(tp, ep), _train, load_config(None, cfg))[0]
    return result["losses"], result["checkpoint"]


@pytest.mark.parametrize("tp,ep,sp", [(2, 1, True)] + [pytest.param(*x, marks=SLOW)
                                                       for x in ((1, 1, False), (1, 2, False))])
def test_lora_on_a_kept_base_equals_lora_on_the_fp32_import(lora_bases, tp, ep, sp, tmp_path):
    """all-linear and --lora-experts (each expert's adapters beside its dequantized weights) on the kept base."""
    root, store = lora_bases
    kept, kept_ckpt = _lora_losses(root, store, "kept", tp, ep, sp)
    full, full_ckpt = _lora_losses(root, store, "fp32", tp, ep, sp)
    assert max(abs(a - b) for a, b in zip(kept, full)) < 1e-5, (kept, full)
    assert kept[-1] < kept[0] - 0.1  # the adapters trained
    from tpzoo.checkpoint.peft import export_peft  # (what `convert to-hf` does with a LoRA checkpoint)

    a, b = (safetensors_dir(export_peft(c, tmp_path / n)) for c, n in ((kept_ckpt, "pk"), (full_ckpt, "pf")))
    assert a.keys() == b.keys() and all((a[k] - b[k]).abs().max() < 1e-5 for k in a)
    assert any(".mlp.experts.lora_A" in k for k in a) and any(".mlp.experts.base_layer.lora_B" in k for k in a)
    if tp == 1 and ep == 1:  # --merge onto the kept base: the merged weights at the run's dtype
        from tpzoo.cli import main as cli

        for ckpt, out in ((kept_ckpt, tmp_path / "kept"), (full_ckpt, tmp_path / "full")):
            assert cli(["convert", "to-hf", ckpt, str(out), "--merge", "--quiet"]) == 0
        a, b = safetensors_dir(tmp_path / "kept"), safetensors_dir(tmp_path / "full")
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
        assert a["model.layers.0.self_attn.o_proj.weight"].dtype == torch.float32


def test_full_finetune_of_a_kept_base_is_refused_in_one_line(lora_bases, capsys):
    from tpzoo.cli import main as cli

    root, store = lora_bases
    assert cli(["finetune", "--base", str(root / "kept"), "--data", store, "--steps", "1", "--tokenizer", "byte",
                "--save", str(root / "full-run")]) == 2
    err = capsys.readouterr().err.strip()
    assert "is kept quantized (fp8_block" in err and "--lora-rank" in err and len(err.splitlines()) == 1, err
    assert not (root / "full-run").exists()
