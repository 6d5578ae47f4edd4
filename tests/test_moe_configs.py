"""Mixture-of-experts configs and bad input: the named configs' total and active parameter counts are the
published ones (model cards), OLMoE (q/k norms over the whole width, no top-k renormalization) equals
transformers in one process, and impossible expert layouts fail with one clear error before anything is built."""
import pytest
import torch
from safetensors.torch import load_file

from tpzoo.checkpoint.tensors import hf_to_full, load_full_tensors
from tpzoo.errors import ConfigError
from tpzoo.models import Inputs, ModelLayout, Transformer, from_hf_config, get_config
from tpzoo.parallel import ParallelDims, ParallelLayoutError, check_layout

# (total, active) parameters in billions, as the model cards state them
PUBLISHED = {"mixtral-8x7b": (46.7, 12.9), "mixtral-8x22b": (141, 39), "qwen3-30b-a3b": (30.5, 3.3),
             "qwen3-235b-a22b": (235, 22), "olmoe-1b-7b": (6.9, 1.3)}


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_total_and_active_parameters_are_the_published_ones(name):
    cfg = get_config(name)
    total, active = PUBLISHED[name]
    assert abs(cfg.num_parameters() / 1e9 - total) <= 0.02 * total
    assert abs(cfg.num_parameters(active=True) / 1e9 - active) <= 0.04 * active


def test_olmoe_matches_transformers(tmp_path):
    import transformers as tf

    torch.manual_seed(0)
    hf = tf.OlmoeForCausalLM(tf.OlmoeConfig(vocab_size=101, hidden_size=32, intermediate_size=24, num_hidden_layers=2,
                                            num_attention_heads=4, num_experts=8, num_experts_per_tok=2,
                                            output_router_logits=True, eos_token_id=None, pad_token_id=None))
    with torch.no_grad():
        for n, p in hf.named_parameters():
            if n.endswith("mlp.gate.weight"):
                p.normal_(std=1.0)
    hf.save_pretrained(tmp_path)
    ids = torch.randint(0, 101, (2, 8), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = hf.eval()(input_ids=ids, labels=ids)
    cfg = from_hf_config(tmp_path)
    model = Transformer(cfg)
    load_full_tensors(model, dict(hf_to_full(cfg, load_file(tmp_path / "model.safetensors"))).__getitem__, 0, 1)
    labels = torch.cat([ids[:, 1:], torch.full((2, 1), -100)], dim=1)
    with torch.no_grad():
        torch.testing.assert_close(model.full_logits(model(ids)), ref.logits, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(model.aux_reports["router_aux_loss"], ref.aux_loss, rtol=1e-5, atol=1e-6)
        loss = model(Inputs(ids, labels=labels)).sum() / (labels != -100).sum()
        torch.testing.assert_close(loss, ref.loss, rtol=1e-5, atol=1e-5)


def test_bad_expert_layouts_fail_clearly():
    with pytest.raises(ConfigError, match=r"num_experts_per_tok \(top-k\) must be in \[1, num_experts=4\], got 5"):
        get_config("tiny-mixtral").replace(num_experts_per_tok=5)
    with pytest.raises(ParallelLayoutError, match=r"ep=4 does not divide dp\*cp = 2\*1 = 2"):
        check_layout(4, tp=2, ep=4)
    with pytest.raises(ParallelLayoutError, match="ep=8 does not divide num_experts=4"):
        Transformer(get_config("tiny-mixtral"), ModelLayout(ParallelDims.for_rank(dp=8, ep=8), device="meta"))


def test_benchmark_config_is_qwen3_30b_a3b_cut_to_8_layers():
    full, cut = get_config("qwen3-30b-a3b"), get_config("qwen3-30b-a3b-8l")
    assert cut == full.replace(num_layers=8, hf_source=None, name="qwen3-30b-a3b-8l")
    norm = full.hidden_size  # the final norm, once
    per_layer = (full.num_parameters(include_embeddings=False) - norm) / 48
    assert cut.num_parameters(include_embeddings=False) == 8 * per_layer + norm
    assert cut.num_parameters(active=True) - cut.num_parameters(active=True, include_embeddings=False) == (
        2 * full.vocab_size * full.hidden_size)  # untied embedding and head: 0.62 B of the 1.08 B active
