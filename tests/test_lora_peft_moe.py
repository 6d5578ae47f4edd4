"""LoRA adapters of every mixture-of-experts family exported to Hugging Face PEFT (issue 48, item 1), in one process.

PEFT with transformers 5 reads the MLP projection names of an adapter (`gate_proj`, `up_proj`, `down_proj`) as the
fused routed experts for the Qwen2-MoE-style model types, so an adapter on a dense layer's MLP (Qwen3-MoE's
mlp_only_layers, the dense first layers of DeepSeek-V3 and GLM-4.5) or on the shared experts (Qwen3-Next) was
dropped with a warning: PEFT ran the base weights there. Per family (MiniMax-M2 too), on a tiny model transformers wrote, adapters on
every layer tpzoo can adapt (`all-linear`, or every valid name where all-linear is refused), random B:
- `convert to-hf` (export_peft) either writes an adapter that peft.PeftModel.from_pretrained loads with tpzoo's
  logits and loss, or refuses in one line (naming the projections and --merge) with nothing written; a refusal is
  proven needed (the same adapter written without the check loads in PEFT to other logits), and the targets it
  suggests export and load with tpzoo's logits;
- `convert to-hf --merge` gives transformers tpzoo's logits either way.
The command as typed (`tpzoo convert to-hf CKPT OUT`) refuses in one line, before writing anything."""
import json

import pytest
import torch

from preflight_helpers import cli, one_error_line
from tpzoo.checkpoint import load_model, save_model_shards
from tpzoo.checkpoint.format import CheckpointError
from tpzoo.checkpoint.lora_io import lora_metadata
from tpzoo.checkpoint.peft import export_merged, export_peft
from tpzoo.errors import ConfigError
from tpzoo.models.lora import LoRAConfig, add_lora, init_lora, valid_targets
from tpzoo.parallel.lora import is_lora_param

peft = pytest.importorskip("peft")
IDS = torch.tensor([[3, 14, 15, 9, 6, 35, 8, 7, 32, 38, 46, 26]])


def _olmoe():
    import transformers as tf

    torch.manual_seed(0)
    return tf.OlmoeForCausalLM(tf.OlmoeConfig(vocab_size=61, hidden_size=32, intermediate_size=24,
                                              num_hidden_layers=2, num_attention_heads=4, num_experts=8,
                                              num_experts_per_tok=2, eos_token_id=None, pad_token_id=None))


def _hf_model(kind: str):
    """The tiny transformers model of each MoE family tpzoo has (the tests' own builders)."""
    import frontier_models
    import hf_models
    from test_moe_hf_parity import make_hf_moe

    if kind in ("mixtral", "qwen3_moe"):  # qwen3_moe: layer 0 dense (mlp_only_layers=[0])
        return make_hf_moe(kind)
    if kind in ("qwen3_next", "qwen3_5_moe"):  # qwen3_next: shared experts, and layer 1 dense
        return hf_models.make_hf_model(kind)
    if kind == "olmoe":
        return _olmoe()
    if kind == "minimax_m2":  # (Mixtral-style experts to PEFT: w1 / w3 / w2)
        from quant_models import hf_model

        return hf_model("minimax_m2")
    return frontier_models.make_hf_model(kind)  # deepseek_v3 (+ _noq), glm4_moe: a dense first layer; gpt_oss


KINDS = ("qwen3_moe", "qwen3_next", "olmoe", "mixtral", "deepseek_v3", "deepseek_v3_noq", "glm4_moe", "gpt_oss",
         "qwen3_5_moe", "minimax_m2")  # (about 0.3 s each)


def _lora_checkpoint(base, path, targets=None):
    """A tpzoo LoRA checkpoint on `base` (adapters on `targets`, default every layer tpzoo adapts, random B) and
    tpzoo's logits with it."""
    model = load_model(str(base))
    if targets is None:
        try:
            add_lora([model], LoRAConfig(rank=4, alpha=8))  # all-linear
        except ConfigError:  # (Qwen3-Next's in_proj_qkvz / in_proj_ba: every other name instead)
            targets = valid_targets(model)
    if targets is not None:
        add_lora([model], LoRAConfig(rank=4, alpha=8, targets=list(targets)))
    init_lora([model], 0)
    g = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if ".lora.B." in n:
                p.copy_(torch.randn(p.shape, generator=g) * 0.05)
        logits = model.full_logits(model(IDS))
    path.mkdir()
    save_model_shards(model, path, model.cfg, select=is_lora_param,
                      metadata=lora_metadata(model.lora_config, str(base)))
    return logits


def _loss(logits):
    return float(torch.nn.functional.cross_entropy(logits[0, :-1], IDS[0, 1:]))


def _peft_logits(base, adapter):
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32).eval()
    with torch.no_grad():
        return peft.PeftModel.from_pretrained(hf, str(adapter)).eval()(IDS).logits


@pytest.mark.parametrize("kind", KINDS)
def test_an_exported_adapter_loads_in_peft_as_trained_or_is_refused(kind, tmp_path, monkeypatch):
    from transformers import AutoModelForCausalLM

    import tpzoo.checkpoint.peft as peft_io

    base = tmp_path / "base"
    hf = _hf_model(kind)
    hf.save_pretrained(base)
    with torch.no_grad():
        plain = hf.eval()(IDS).logits
    want = merged_want = _lora_checkpoint(base, tmp_path / "lora")
    assert (want - plain).abs().max() > 0.05  # the adapters matter
    try:
        adapter = export_peft(str(tmp_path / "lora"), tmp_path / "peft")
    except CheckpointError as exc:
        message = str(exc)
        assert "\n" not in message and "--merge" in message and not (tmp_path / "peft").exists(), message
        assert message.startswith(f"{kind.removesuffix('_noq')}: PEFT cannot load this adapter's "), message
        # the refusal is needed: written anyway, PEFT loads it to other logits (what it did before the check)
        monkeypatch.setattr(peft_io, "check_peft_loads", lambda *a: None)
        unchecked = _peft_logits(base, export_peft(str(tmp_path / "lora"), tmp_path / "unchecked"))
        assert (unchecked - want).abs().max() > 1e-3, message
        # the targets it suggests export, and PEFT gives tpzoo's logits
        monkeypatch.undo()
        suggested = message.split("--lora-targets ")[1].split(",")
        want = _lora_checkpoint(base, tmp_path / "lora2", suggested)
        adapter = export_peft(str(tmp_path / "lora2"), tmp_path / "peft")
    got = _peft_logits(base, adapter)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    assert abs(_loss(got) - _loss(want)) < 1e-5
    # --merge: a plain transformers model with the adapters in, whatever PEFT reads
    export_merged(str(tmp_path / "lora"), tmp_path / "merged", progress=False)
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged", dtype=torch.float32).eval()
    with torch.no_grad():
        torch.testing.assert_close(merged(IDS).logits, merged_want, rtol=1e-4, atol=1e-4)


def test_convert_to_hf_refuses_an_adapter_peft_would_drop_in_one_line(tmp_path, monkeypatch, capsys):
    """`tpzoo convert to-hf` of a Qwen3-MoE LoRA checkpoint with its dense layer's MLP adapted (the default
    all-linear): exit 2, one line, nothing at the destination."""
    base = tmp_path / "base"
    _hf_model("qwen3_moe").save_pretrained(base)
    _lora_checkpoint(base, tmp_path / "lora")
    targets = json.loads((tmp_path / "lora" / "manifest.json").read_text())["metadata"]["lora"]["targets"]
    assert targets == ["all-linear"]
    line = one_error_line(*cli(monkeypatch, capsys, "convert", "to-hf", tmp_path / "lora", tmp_path / "out"),
                          "convert to-hf", "qwen3_moe: PEFT cannot load this adapter's down_proj, gate_proj, up_proj",
                          "fused routed experts", "convert to-hf --merge", "--lora-targets k_proj,o_proj,q_proj,v_proj")
    assert not (tmp_path / "out").exists() and not list(tmp_path.glob(".out*")), line
