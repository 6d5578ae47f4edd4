"""The 2024-25 families (Qwen3, OLMo 2, Gemma 2, Gemma 3, SmolLM3, Phi-3/4) end to end against transformers, on
tiny models written by transformers itself (tests/hf_models.py: randomized norms, kv heads fewer than tp=4, Gemma's
sliding window 8 shorter than the prompts). tests/test_models_hf_parity.py checks their logits and loss at tp 1, 2,
4 (+SP); here: tp=2 x pp=2 (+SP) logits, loss, eval loss and greedy generation; the bit-exact HF round trip and
resharding; training at (tp, pp, dp) = (2, 2, 1) + SP against one process; OLMo 2's extra all-reduce, counted; meta
default device; HF configs using a feature the family does not implement, refused with the field named; named
configs against the published parameter counts and transformers' own config classes."""
import json
import math

import pytest
import torch

import tpzoo
from tpzoo.checkpoint import convert_from_hf, convert_to_hf, load_model, reshard
from tpzoo.errors import ConfigError
from tpzoo.evaluation import evaluate
from tpzoo.generation import generate
from tpzoo.models import ModelLayout, Transformer, from_hf_config
from tpzoo.parallel import count_collectives
from tpzoo.pipeline import pipeline_forward
from tpzoo.testing import run_on_ranks

from checkpoint_helpers import assert_bit_exact, ids, safetensors_dir, write_hf
from test_3d_parity import check_layout, reference, train_layout
from test_eval import _hf_loss

NEW = ["qwen3", "olmo2", "gemma2", "gemma3", "smollm3", "phi3"]
NEW_TOKENS = 16  # prompts of 10 (longer than the sliding windows of 8: the prefill slides) + 16 cached decode steps
EVAL_SEQ = 12    # eval windows longer than the sliding window too


@pytest.fixture(scope="module")
def cases(tmp_path_factory):
    root = tmp_path_factory.mktemp("new")
    x, prompt = ids(), ids(batch=2, seq=10, seed=11)
    tokens = ids(batch=1, seq=31, seed=2)[0]
    out = {}
    for kind in NEW:
        model = write_hf(kind, root / kind)
        convert_from_hf(root / kind, root / f"{kind}-t2p2", tp=2, pp=2, progress=False)
        with torch.no_grad():
            res = model(input_ids=x, labels=x)
            gen = model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=NEW_TOKENS,
                                 do_sample=False)
        out[kind] = (str(root / kind), str(root / f"{kind}-t2p2"), res.logits, res.loss, gen,
                     _hf_loss(model, tokens, EVAL_SEQ)[0])
    return root, x, prompt, tokens, out


def _pipeline_checks(x, prompt, tokens, items):
    labels = torch.cat([x[:, 1:], torch.full_like(x[:, :1], -100)], dim=1)
    for sp in (False, True):
        dims = tpzoo.init_parallel(tp=2, pp=2)
        for kind, ckpt, ref_logits, ref_loss, ref_gen, ref_eval in items:
            what = f"{kind} tp=2 pp=2 sp={sp}"
            model = load_model(ckpt, dims, sequence_parallel=sp).eval()
            with torch.no_grad():
                logits, per_token = pipeline_forward(model, x), pipeline_forward(model, x, labels)
            if model.post_process:
                torch.testing.assert_close(model.full_logits(logits), ref_logits, rtol=1e-4, atol=1e-4, msg=what)
                loss = per_token.sum() / (labels != -100).sum()
                torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-5, msg=what)
            got = generate(model, prompt, NEW_TOKENS, eos_token_id=model.cfg.eos_token_id,
                           pad_token_id=model.cfg.pad_token_id)
            assert torch.equal(got, ref_gen), f"{what}: {got.tolist()} vs transformers {ref_gen.tolist()}"
            if not sp:
                result = evaluate(model, tokens, EVAL_SEQ, batch_size=2)
                assert math.isclose(result["loss"], ref_eval, rel_tol=1e-5), (what, result, ref_eval)
        tpzoo.destroy_parallel()


def test_pipeline_logits_loss_eval_and_generation_match_transformers(cases):
    _, x, prompt, tokens, out = cases
    items = [(kind, ckpt, logits, loss, gen, ev) for kind, (_, ckpt, logits, loss, gen, ev) in out.items()]
    run_on_ranks(4, _pipeline_checks, x, prompt, tokens, items)


def _config(path):
    d = json.loads((path / "config.json").read_text())
    d.pop("transformers_version", None)
    return d


@pytest.mark.parametrize("kind", NEW)
def test_round_trip_and_reshard_are_bit_exact(cases, tmp_path, kind):
    root, *_ = cases
    hf = root / kind
    convert_to_hf(root / f"{kind}-t2p2", tmp_path / "back", progress=False)
    assert_bit_exact(safetensors_dir(hf), safetensors_dir(tmp_path / "back"))
    assert _config(hf) == _config(tmp_path / "back")
    reshard(root / f"{kind}-t2p2", tmp_path / "t4p1", tp=4, pp=1, progress=False)  # kv heads replicated at tp=4
    reshard(tmp_path / "t4p1", tmp_path / "t1p2", tp=1, pp=2, progress=False)
    convert_to_hf(tmp_path / "t1p2", tmp_path / "again", progress=False)
    assert_bit_exact(safetensors_dir(hf), safetensors_dir(tmp_path / "again"))


def _train(cfgs, layout):
    return [train_layout(cfg, layout) for cfg in cfgs]


def test_training_at_tp2_pp2_sp_matches_one_process(cases):
    """Two SGD steps: loss, every gradient (1e-5 of each tensor's largest entry) and every parameter."""
    root, *_ = cases
    # windows of 4 within the training sequences of 8: the sliding layers really slide
    cfgs = [from_hf_config(root / kind).replace(sliding_window=4) if kind in ("gemma2", "gemma3", "phi3")
            else from_hf_config(root / kind) for kind in NEW]
    layout = dict(tp=2, pp=2, sp=True, steps=2)
    per_rank = run_on_ranks(4, _train, cfgs, layout)
    for i, cfg in enumerate(cfgs):
        check_layout(cfg, reference(cfg, steps=2), [r[i] for r in per_rank], {**layout, "family": cfg.family})


def _count_norm_all_reduces(cfg, x):
    tpzoo.init_parallel(tp=2)
    calls = []
    for variant in (cfg, cfg.replace(qk_norm="none")):
        model = Transformer(variant, seed=1)
        with torch.no_grad(), count_collectives() as c:
            model(x)
        calls.append((c.get("all_reduce").calls, c.get("all_reduce").elements))
    tpzoo.destroy_parallel()
    return calls


def test_olmo2_qk_norm_costs_one_all_reduce_per_layer(cases):
    root, x, *_ = cases
    cfg = from_hf_config(root / "olmo2")
    (with_norm, elems), (without, base_elems) = run_on_ranks(2, _count_norm_all_reduces, cfg, x)[0]
    assert with_norm - without == cfg.num_layers  # q's and k's sums of squares travel together
    assert elems - base_elems == cfg.num_layers * x.numel() * 2  # 2 fp32 per token per layer


def test_built_under_a_meta_default_device(cases):
    root, x, *_ = cases
    for kind in NEW:
        cfg = from_hf_config(root / kind)
        expected = Transformer(cfg, ModelLayout(device="cpu"), seed=3)(x)
        torch.set_default_device("meta")
        try:
            got = Transformer(cfg, ModelLayout(device="cpu"), seed=3)(x)
        finally:
            torch.set_default_device(None)
        assert torch.equal(got, expected), kind


LONGROPE = {"rope_type": "longrope", "rope_theta": 10000.0, "partial_rotary_factor": 0.75,
            "short_factor": [1.0] * 6, "long_factor": [2.0] * 6}
BAD = [  # (kind, change to its config.json, the field the error must name)
    ("phi3", {"rope_parameters": LONGROPE}, "rope_parameters.rope_type='longrope'"),
    ("qwen3", {"rope_parameters": {"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e6}},
     "rope_parameters.rope_type='yarn'"),
    ("qwen3", {"hidden_act": "gelu"}, "hidden_act='gelu'"),
    ("qwen3", {"rope_parameters": {"rope_type": "default", "rope_theta": 1e6, "partial_rotary_factor": 0.5}},
     "rope_parameters.partial_rotary_factor=0.5"),
    ("olmo2", {"rope_parameters": {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 1e4}},
     "rope_parameters.rope_type='dynamic'"),
    ("gemma2", {"layer_types": ["sliding_attention", "chunked_attention"]}, "layer_types='chunked_attention'"),
    ("gemma2", {"use_bidirectional_attention": True}, "use_bidirectional_attention=True"),
    ("gemma3", {"hidden_activation": "gelu"}, "hidden_activation='gelu'"),
    ("gemma3", {"rope_parameters": {"full_attention": {"rope_type": "default", "rope_theta": 1e6},
                                    "sliding_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e4}}},
     "rope_parameters.sliding_attention.rope_type='linear'"),
]


@pytest.mark.parametrize("kind,change,field", BAD, ids=[b[2].split("=")[0] + "-" + b[0] for b in BAD])
def test_unsupported_features_are_refused_naming_the_field(cases, kind, change, field):
    root, *_ = cases
    hf = {**json.loads((root / kind / "config.json").read_text()), **change}
    with pytest.raises(ConfigError) as e:
        from_hf_config(hf)
    message = str(e.value)
    assert field in message and "\n" not in message, message


# Published parameter counts: the Qwen3 model cards (total and non-embedding, in billions, as printed), the OLMo 2
# model cards / paper, the SmolLM2/3 and Phi-3/4 names, model cards and hub pages (total), the Gemma 2 report
# (exact non-embedding counts; its embedding row counts a 256,128-row table where the HF checkpoints hold 256,000)
# and the Gemma 3 report (non-embedding, in millions; the text decoder only: 4B-27B add a 417M vision encoder).
PUBLISHED = {
    "qwen3-0.6b": (0.6, 0.44), "qwen3-1.7b": (1.7, 1.4), "qwen3-4b": (4.0, 3.6), "qwen3-8b": (8.2, 6.95),
    "qwen3-14b": (14.8, 13.2), "qwen3-32b": (32.8, 31.2),
    "olmo-2-1b": (1.48, None), "olmo-2-7b": (7.30, None), "olmo-2-13b": (13.72, None), "olmo-2-32b": (32.23, None),
    "smollm2-135m": (0.135, None), "smollm2-360m": (0.36, None), "smollm2-1.7b": (1.7, None),
    "smollm3-3b": (3.08, None),
    "phi-3-mini": (3.8, None), "phi-3-medium": (14, None), "phi-4-mini": (3.8, None), "phi-4": (14.7, None),
}
GEMMA2_NON_EMBEDDING = {"gemma-2-2b": 2_024_517_888, "gemma-2-9b": 8_324_201_984, "gemma-2-27b": 26_047_480_320}
GEMMA3_NON_EMBEDDING_M = {"gemma-3-1b": 698, "gemma-3-4b": 3209, "gemma-3-12b": 10759, "gemma-3-27b": 25600}


def test_named_configs_have_the_published_parameter_counts():
    from tpzoo.models import get_config

    def rounded(n, like):  # to the published figure's number of decimals
        decimals = len(str(like).split(".")[1]) if "." in str(like) else 0
        return round(n / 1e9, decimals)

    for name, (total, non_embedding) in PUBLISHED.items():
        cfg = get_config(name)
        assert rounded(cfg.num_parameters(), total) == total, name
        if non_embedding is not None:
            assert rounded(cfg.num_parameters(include_embeddings=False), non_embedding) == non_embedding, name
    for name, count in GEMMA2_NON_EMBEDDING.items():
        assert get_config(name).num_parameters(include_embeddings=False) == count, name
    for name, millions in GEMMA3_NON_EMBEDDING_M.items():
        assert round(get_config(name).num_parameters(include_embeddings=False) / 1e6) == millions, name


NAMED = ["qwen3-0.6b", "qwen3-8b", "olmo-2-32b", "gemma-2-27b", "gemma-3-1b", "gemma-3-27b", "smollm3-3b",
         "phi-3-medium", "phi-4-mini"]


@pytest.mark.parametrize("name", NAMED)
def test_named_configs_write_hf_configs_transformers_reads_back(name):
    """A named config's HF config (what `convert to-hf` writes for a model trained from scratch) is read by
    transformers with the same per-layer attention kinds, and reads back into the same ModelConfig."""
    import transformers

    from tpzoo.models import get_config, to_hf_config

    cfg = get_config(name)
    hf = to_hf_config(cfg)
    theirs = transformers.AutoConfig.for_model(**hf)
    if cfg.layer_types is not None:  # Gemma 2 alternates, Gemma 3 has 5 sliding layers to 1 global: HF's defaults
        default = transformers.AutoConfig.for_model(**{k: v for k, v in hf.items() if k != "layer_types"})
        assert list(theirs.layer_types) == list(default.layer_types) == cfg.layer_types
    back = from_hf_config(theirs.to_dict())
    ours = {k: v for k, v in cfg.to_dict().items() if k not in ("name", "hf_source", "extra")}
    assert {k: v for k, v in back.to_dict().items() if k in ours} == ours
