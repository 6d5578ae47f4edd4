"""LoRA adapters of every mixture-of-experts family exported to Hugging Face PEFT (issues 48 and 43), in one process.

PEFT 0.21 with transformers 5 reads the MLP projection names of an adapter's target_modules (`gate_proj`, `up_proj`,
`down_proj`) as the fused routed experts for the Qwen2-MoE-style model types, so an adapter on a dense layer's MLP
(Qwen3-MoE's mlp_only_layers, the dense first layers of DeepSeek-V3 and GLM-4.5) or on the shared experts
(DeepSeek-V3, GLM-4.5, Qwen3-Next) named there would be dropped; the export names those by their weights in
target_parameters instead (models/lora_peft.py). Per family (MiniMax-M2 too), on a tiny model transformers wrote,
adapters on every layer tpzoo can adapt (`all-linear`, or every valid name where all-linear is refused), random B:
- `convert to-hf` (export_peft) writes an adapter (the experts' in PEFT's target_parameters form) that peft.PeftModel.from_pretrained loads with tpzoo's logits
  and loss; `convert to-hf --merge` gives transformers tpzoo's logits;
- the export's guard (PEFT asked whether it loads the keys as written) refuses the old target_modules form;
- dropout on such an adapter (PEFT's parameter targets take none) is refused by `tpzoo convert to-hf` in one line,
  before writing anything (and by preflight before training: test_lora_experts_cli.py)."""
import json
from pathlib import Path

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
    if kind in ("glm4_moe_lite", "mistral4", "deepseek_v32"):  # (Mistral Small 4: transformers' own fused experts)
        import dsa_models

        return dsa_models.make_hf_model(kind)
    if kind == "minimax_m2":  # (Mixtral-style experts to PEFT: w1 / w3 / w2)
        from quant_models import hf_model

        return hf_model("minimax_m2")
    return frontier_models.make_hf_model(kind)  # deepseek_v3 (+ _noq), glm4_moe: a dense first layer; gpt_oss


KINDS = ("qwen3_moe", "qwen3_next", "olmoe", "mixtral", "deepseek_v3", "deepseek_v3_noq", "glm4_moe", "gpt_oss",
         "qwen3_5_moe", "minimax_m2", "glm4_moe_lite", "mistral4", "deepseek_v32")  # (about 0.3 s each)


def _lora_checkpoint(base, path, targets=None, dropout=0.0):
    """A tpzoo LoRA checkpoint on `base` (adapters on `targets`, default every layer tpzoo adapts, and on every routed
    expert (--lora-experts) unless with dropout; random B) and tpzoo's logits with it."""
    model = load_model(str(base))
    if targets is None:
        try:
            add_lora([model], LoRAConfig(rank=4, alpha=8, dropout=dropout, experts=not dropout))  # all-linear
        except ConfigError:  # (Qwen3-Next's in_proj_qkvz / in_proj_ba: every other name instead)
            targets = valid_targets(model)
    if targets is not None:
        add_lora([model], LoRAConfig(rank=4, alpha=8, dropout=dropout, targets=list(targets), experts=not dropout))
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


def _hf_class(directory):
    """The transformers class config.json names (Mistral Small 4's is not in AutoModelForCausalLM's mapping)."""
    import transformers

    return getattr(transformers, json.loads((Path(directory) / "config.json").read_text())["architectures"][0])


def _peft_logits(base, adapter):
    hf = _hf_class(base).from_pretrained(base, dtype=torch.float32).eval()
    with torch.no_grad():
        return peft.PeftModel.from_pretrained(hf, str(adapter)).eval()(IDS).logits


@pytest.mark.parametrize("kind", KINDS)
def test_an_exported_adapter_loads_in_peft_as_trained(kind, tmp_path):
    base = tmp_path / "base"
    hf = _hf_model(kind)
    hf.save_pretrained(base)
    with torch.no_grad():
        plain = hf.eval()(IDS).logits
    want = _lora_checkpoint(base, tmp_path / "lora")
    assert (want - plain).abs().max() > 0.05  # the adapters matter
    adapter = export_peft(str(tmp_path / "lora"), tmp_path / "peft")
    config = json.loads((adapter / "adapter_config.json").read_text())
    assert {"mlp.experts.gate_up_proj", "mlp.experts.down_proj"} <= set(config["target_parameters"])
    if kind.startswith(("deepseek_v3", "glm4_moe")):  # dense first layer and shared experts: named by their weights
        assert {"mlp.gate_proj.weight", "mlp.shared_experts.down_proj.weight"} <= set(config["target_parameters"])
    got = _peft_logits(base, adapter)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    assert abs(_loss(got) - _loss(want)) < 1e-5
    # --merge: a plain transformers model with the adapters in
    export_merged(str(tmp_path / "lora"), tmp_path / "merged", progress=False)
    merged = _hf_class(tmp_path / "merged").from_pretrained(tmp_path / "merged", dtype=torch.float32).eval()
    with torch.no_grad():
        torch.testing.assert_close(merged(IDS).logits, want, rtol=1e-4, atol=1e-4)


def test_peft_check_refuses_what_peft_would_drop():
    """The export's guard (peft_check.py): the form before target_parameters, Qwen3-MoE's dense layer's MLP named in
    target_modules, is what PEFT 0.21 moves to the fused experts and drops; the guard says so in one line."""
    from tpzoo.checkpoint.peft_check import peft_refusal
    from tpzoo.models import from_hf_config

    cfg = from_hf_config(_hf_model("qwen3_moe").config.to_dict())
    shapes = {f"base_model.model.model.layers.0.mlp.{n}.lora_{ab}.weight": (s if ab == "A" else (o, 4))
              for n, s, o in [("gate_proj", (4, 32), 40), ("up_proj", (4, 32), 40), ("down_proj", (4, 40), 32)]
              for ab in "AB"}
    config = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": 4, "lora_alpha": 8, "target_modules":
              ["gate_proj", "up_proj", "down_proj"], "bias": "none"}
    refusal = peft_refusal(cfg, config, shapes)
    assert refusal and "\n" not in refusal, refusal
    assert refusal.startswith("qwen3_moe: PEFT cannot load this adapter's down_proj, gate_proj, up_proj"), refusal
    assert "fused routed experts" in refusal and "convert to-hf --merge" in refusal, refusal


def test_convert_to_hf_refuses_dropout_on_what_peft_takes_as_parameters(tmp_path, monkeypatch, capsys):
    """`tpzoo convert to-hf` of a Qwen3-MoE LoRA checkpoint trained with dropout on its dense layer's MLP (the
    default all-linear; refused before training now, a run from before could have it): exit 2, one line, nothing at
    the destination."""
    base = tmp_path / "base"
    _hf_model("qwen3_moe").save_pretrained(base)
    _lora_checkpoint(base, tmp_path / "lora", dropout=0.1)
    line = one_error_line(*cli(monkeypatch, capsys, "convert", "to-hf", tmp_path / "lora", tmp_path / "out"),
                          "convert to-hf", "qwen3_moe: PEFT takes", "which take no dropout", "--lora-dropout 0.1",
                          "convert to-hf --merge")
    assert not (tmp_path / "out").exists() and not list(tmp_path.glob(".out*")), line
