"""`--lora-experts` as users run it (the trainer's config, `tpzoo convert to-hf`, `--lora-from`, `--resume`), on a
tiny Qwen3-MoE transformers wrote (byte vocabulary; layer 0 dense, layer 1 8 experts top-2):
- a run at ep 2 (dp 2) resumed at ep 2 continues bit for bit; its step-2 checkpoint resumed at ep 1 (dp 2, each
  expert's adapters and their optimizer state read whole by every rank) and at tp 2 + SP (each rank its tp slice
  of every expert's) continues to the same losses and adapters (1e-5: the gradients are summed in another order),
  the adapters it reads there being the checkpoint's bit for bit;
- the checkpoint holds the adapters and their optimizer state only: under a quarter of the base's bytes;
- exported with `tpzoo convert to-hf` (PEFT's target_parameters form), continued with `--lora-from` at tp 2 + SP
  and lr 0: the adapters come back as trained (the model's logits equal the checkpoint's);
- bad settings get one line before any rank starts, nothing written: --lora-experts without --lora-rank, on a
  dense model, with --lora-dropout; dropout on the dense MLP that PEFT would read as the experts."""
import json
import sysconfig
from pathlib import Path

import pytest
import torch
from preflight_helpers import cli, one_error_line
from test_finetune import _tiny_hf_llama

from tpzoo.testing import run_on_ranks

VOCAB = 259  # the byte tokenizer's


def _train(cfg):
    from tpzoo.train import train

    return train(cfg)


def _cfg(**kw):
    from tpzoo.train import load_config

    base = dict(lora_rank=2, lora_alpha=4.0, lora_experts=True, seq_len=16, global_batch_size=4, micro_batch_size=1,
                steps=4, lr=1e-2, warmup_steps=1, min_lr=1e-3, sample_prompt="", quiet=True, eval_fraction=0.0,
                seed=0, prefetch=1, dtype="fp32", tokenizer="byte", log_interval=100, tp=1, pp=1)
    return load_config(None, {**base, **kw})


@pytest.fixture(scope="module")
def moe(tmp_path_factory):
    """(root, HF base dir, token store)."""
    import transformers as tf

    from tpzoo.data import iter_documents, preprocess

    root = tmp_path_factory.mktemp("lora_experts")
    torch.manual_seed(0)
    hf = tf.Qwen3MoeForCausalLM(tf.Qwen3MoeConfig(
        vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        head_dim=16, intermediate_size=128, moe_intermediate_size=256, num_experts=8, num_experts_per_tok=2,
        mlp_only_layers=[0], max_position_embeddings=64, bos_token_id=None, eos_token_id=None, pad_token_id=None))
    hf.save_pretrained(root / "base")
    lib = Path(sysconfig.get_paths()["stdlib"])
    store = str(preprocess(iter_documents([str(lib / "textwrap.py")]), "byte", root / "store").path)
    return root, str(root / "base"), store


def _adapters(ckpt) -> dict:
    from tpzoo.checkpoint import load_model

    return {n: p.detach().clone() for n, p in load_model(str(ckpt)).named_parameters() if ".lora." in n}


def _logits(ckpt) -> torch.Tensor:
    from tpzoo.checkpoint import load_model
    from tpzoo.models import Inputs

    model = load_model(str(ckpt))
    with torch.no_grad():
        return model.full_logits(model(Inputs(torch.arange(40, 56)[None])))


def test_resume_reshard_export_and_continue(moe, tmp_path):
    root, base, store = moe
    run = dict(base=base, data=[store])
    straight = run_on_ranks(2, _train, _cfg(**run, ep=2, dp=2, save=str(tmp_path / "a")))[0]
    half = run_on_ranks(2, _train, _cfg(**run, ep=2, dp=2, steps=2, save=str(tmp_path / "b"), save_every=2))[0]
    assert half["losses"] == straight["losses"][:2]
    resumed = run_on_ranks(2, _train, _cfg(**run, ep=2, dp=2, save=str(tmp_path / "b"), resume="auto"))[0]
    assert resumed["losses"] == straight["losses"][2:]  # bit for bit
    other_ep = run_on_ranks(2, _train, _cfg(**run, ep=1, dp=2, save=str(tmp_path / "c"),
                                            resume=str(tmp_path / "b" / "step_00000002")))[0]
    other_tp = run_on_ranks(2, _train, _cfg(**run, tp=2, dp=1, sequence_parallel=True, save=str(tmp_path / "d"),
                                            resume=str(tmp_path / "b" / "step_00000002")))[0]
    a = _adapters(straight["checkpoint"])
    assert any(".mlp.lora.A.gate_up" in k for k in a)
    for other in (other_ep, other_tp):
        assert other["losses"] == pytest.approx(straight["losses"][2:], rel=1e-5, abs=0)
        c = _adapters(other["checkpoint"])
        assert a.keys() == c.keys()
        for k in a:
            torch.testing.assert_close(c[k], a[k], rtol=0, atol=1e-5 * float(a[k].abs().max()))

    # the reshard itself is exact: the adapters read at ep 2 and at tp 2 are the checkpoint's, bit for bit
    saved = str(tmp_path / "b" / "step_00000002")
    whole = _adapters(saved)
    for layout in (dict(dp=2, ep=2), dict(tp=2)):
        for rank in run_on_ranks(2, _adapters_at, base, saved, layout):
            assert rank.keys() == whole.keys() and all(torch.equal(rank[k], whole[k]) for k in whole), layout

    ckpt = Path(straight["checkpoint"])
    manifest = json.loads((ckpt / "manifest.json").read_text())
    assert manifest["tensors"] and all(".lora." in n for n in manifest["tensors"])
    stored = sum(f.stat().st_size for f in ckpt.rglob("*") if f.is_file())  # adapters and optimizer state
    base_bytes = sum(f.stat().st_size for f in Path(base).glob("*.safetensors"))
    assert stored < 0.25 * base_bytes, (stored, base_bytes)  # (rank 2: about a sixth, a third of it JSON)

    assert cli_status(["convert", "to-hf", str(ckpt), str(tmp_path / "peft")]) == 0
    config = json.loads((tmp_path / "peft" / "adapter_config.json").read_text())
    assert {"mlp.experts.gate_up_proj", "mlp.experts.down_proj"} <= set(config["target_parameters"])
    cont = run_on_ranks(2, _train, _cfg(base=base, data=[store], lora_rank=0, lora_experts=False,
                                        lora_from=str(tmp_path / "peft"), steps=1, tp=2, dp=1, sequence_parallel=True,
                                        lr=0.0, min_lr=0.0, save=str(tmp_path / "e")))[0]
    torch.testing.assert_close(_logits(cont["checkpoint"]), _logits(ckpt), rtol=1e-5, atol=1e-5)


def _adapters_at(base: str, ckpt: str, layout: dict) -> dict:
    """This rank's adapters of `ckpt` read at `layout` (a pool rank), each gathered to its full tensor."""
    import tpzoo
    from test_moe_training import _full

    from tpzoo.checkpoint import load_weights_into
    from tpzoo.checkpoint.lora_io import lora_config_of, lora_info
    from tpzoo.models import from_hf_config
    from tpzoo.models.lora import add_lora
    from tpzoo.parallel.lora import is_lora_param
    from tpzoo.pipeline import build_model_chunks

    dims = tpzoo.init_parallel(**layout)
    try:
        chunks = build_model_chunks(from_hf_config(base), dims, sequence_parallel=dims.tp > 1)
        add_lora(chunks, lora_config_of(lora_info(ckpt)))
        load_weights_into(chunks, ckpt, select=is_lora_param)
        return {n: _full(p, p.detach(), dims) for c in chunks for n, p in c.named_parameters() if p.requires_grad}
    finally:
        tpzoo.destroy_parallel()


def cli_status(args) -> int:
    from tpzoo.cli import main

    return main(args + ["--quiet"])


def test_bad_expert_lora_settings_get_one_line(moe, tmp_path, monkeypatch, capsys):
    root, base, store = moe
    dense = tmp_path / "dense"
    _tiny_hf_llama(dense)
    out = tmp_path / "out"
    common = ["--data", store, "--tokenizer", "byte", "--steps", "1", "--save", str(out)]
    cases = [
        (["--base", base, "--lora-experts"], "--lora-experts adapts the routed experts in a LoRA run: give "
                                             "--lora-rank"),
        (["--base", str(dense), "--lora-rank", "4", "--lora-experts"], "has no routed experts (a dense model)"),
        (["--base", base, "--lora-rank", "4", "--lora-experts", "--lora-dropout", "0.1"],
         "the experts' adapters take no dropout"),
        (["--base", base, "--lora-rank", "4", "--lora-dropout", "0.1"],
         "PEFT reads those names of this model as its routed experts"),
    ]
    for flags, needle in cases:
        one_error_line(*cli(monkeypatch, capsys, "finetune", *flags, *common), "finetune", needle)
        assert not out.exists()
