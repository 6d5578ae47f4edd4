"""MiniMax-M2 (models/minimax_m2.py) against transformers' MiniMaxM2ForCausalLM on a tiny random model (every dim a
multiple of 128, partial rotary, full-width q/k norms, a random selection bias, confident routing):

- its HF checkpoint converts and exports bit for bit, and tpzoo's logits equal transformers' (fp32) in one process;
- the block-FP8 checkpoint the hub ships (built here), kept quantized, evaluates at tp 2 + SP and at ep 2 as
  transformers does reading it with its own FP8 loader (1e-4), in one spawned run;
- the named configs are the hub's: `minimax-m2` equals what its config.json reads into.
"""
from __future__ import annotations

import json

import pytest
import torch
from checkpoint_helpers import assert_bit_exact, safetensors_dir
from quant_models import evaluate_kept, hf_loss, hf_model, write_fp8

from tpzoo.checkpoint import convert_from_hf, convert_to_hf, load_model
from tpzoo.models import Inputs, get_config
from tpzoo.models.registry import from_hf_config
from tpzoo.testing import run_on_ranks

IDS = torch.randint(0, 200, (2, 12), generator=torch.Generator().manual_seed(2))


def test_minimax_m2_converts_bit_exact_and_matches_transformers(tmp_path):
    hf = hf_model("minimax_m2")
    hf.save_pretrained(tmp_path / "hf")
    convert_from_hf(tmp_path / "hf", tmp_path / "ckpt", tp=2, progress=False)
    convert_to_hf(tmp_path / "ckpt", tmp_path / "back", progress=False)
    assert_bit_exact(safetensors_dir(tmp_path / "hf"), safetensors_dir(tmp_path / "back"))
    assert json.loads((tmp_path / "hf" / "config.json").read_text()) == json.loads(
        (tmp_path / "back" / "config.json").read_text())
    model = load_model(tmp_path / "ckpt", dtype=torch.float32, device="cpu")
    assert model.cfg.attention.qk_norm == "full" and model.cfg.attention.rotary_dim == 64
    with torch.no_grad():
        ours, theirs = model.full_logits(model(Inputs(IDS))), hf(IDS).logits
    assert (theirs - theirs.mean()).abs().max() > 1  # logits that say something
    torch.testing.assert_close(ours, theirs, rtol=1e-4, atol=1e-4)


def test_minimax_m2_fp8_kept_evaluates_as_transformers_at_tp2_and_ep2(tmp_path):
    write_fp8("minimax_m2", tmp_path / "fp8")
    convert_from_hf(tmp_path / "fp8", tmp_path / "kept", tp=2, keep_quantized=True, progress=False)
    want = hf_loss(tmp_path / "fp8")  # transformers' own FP8 loader (dequantizes on CPU)
    cases = [(str(tmp_path / "kept"), 2, 1, True), (str(tmp_path / "kept"), 1, 2, False)]
    for loss, stored in run_on_ranks(2, evaluate_kept, cases)[0]:
        assert stored == ["torch.float8_e4m3fn"]
        assert abs(loss - want) < 1e-4, (loss, want)


def test_minimax_m2_named_configs_are_the_hubs():
    hub = {"architectures": ["MiniMaxM2ForCausalLM"], "model_type": "minimax_m2", "vocab_size": 200064,
           "hidden_size": 3072, "intermediate_size": 1536, "num_hidden_layers": 62, "num_attention_heads": 48,
           "num_key_value_heads": 8, "head_dim": 128, "rotary_dim": 64, "rope_theta": 5000000, "hidden_act": "silu",
           "max_position_embeddings": 196608, "num_local_experts": 256, "num_experts_per_tok": 8,
           "rms_norm_eps": 1e-06, "scoring_func": "sigmoid", "use_routing_bias": True, "use_qk_norm": True,
           "qk_norm_type": "per_layer", "shared_intermediate_size": 0, "attn_type_list": [1] * 62, "use_mtp": True,
           "num_mtp_modules": 3, "tie_word_embeddings": False, "bos_token_id": 200034, "eos_token_id": 200020,
           "quantization_config": {"quant_method": "fp8", "fmt": "float8_e4m3fn", "activation_scheme": "dynamic",
                                   "weight_block_size": [128, 128]}}
    got = from_hf_config(hub)
    named = get_config("minimax-m2")
    for c in (got, named):
        c.extra, c.name, c.hf_source = {}, "", ""
    assert got == named
    with pytest.raises(Exception, match="attn_type_list"):
        from_hf_config({**hub, "attn_type_list": [0, 1] * 31})
