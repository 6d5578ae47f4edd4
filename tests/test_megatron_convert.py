"""Megatron-LM checkpoints in and out (`tpzoo convert from-megatron` / `to-megatron`), Megatron-Core the oracle.

One Megatron-Core session on 2 gloo ranks (tests/megatron_oracle.py) does the Megatron side of every test here:
it saves a random Llama-style GPTModel (grouped-query attention with 2 query groups of 2 heads, RMSNorm, SwiGLU,
RoPE, untied head, vocabulary 259 padded to 272) at tp 2 in the torch_dist form (common.pt, as Megatron-Core
0.16 writes it) and the legacy per-rank form, with its full-vocabulary logits on the evaluation windows; and it
loads, strictly, a checkpoint `to-megatron` wrote from a transformers Llama, with its logits. Everything tpzoo
does runs in this process, where megatron is never imported (its import widens torch.load's allowlist).
Megatron's loss normalizes over the padded rows too; tpzoo drops them, so the reference loss is the
cross-entropy of Megatron-Core's logits over the real vocabulary.
"""
import importlib.util
import json
import math
import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from tpzoo.checkpoint import CheckpointSource, convert_from_hf
from tpzoo.cli import main as cli
from tpzoo.evaluation import token_windows
from tpzoo.testing import run_on_ranks

from checkpoint_helpers import TEXT
from hf_models import VOCAB, save_hf_model

pytestmark = pytest.mark.skipif(importlib.util.find_spec("megatron") is None,
                                reason="needs megatron-core (the dev extra)")

SEQ, TOKENS = 24, 150
BYTES = 259  # the byte tokenizer's vocabulary
LLAMA = dict(num_layers=2, hidden_size=32, ffn_hidden_size=48, num_attention_heads=4, group_query_attention=True,
             num_query_groups=2, kv_channels=8, normalization="RMSNorm", norm_epsilon=1e-5, swiglu=True,
             add_bias_linear=False, add_qkv_bias=False, position_embedding_type="rope", rotary_base=10000,
             untie_embeddings_and_output_weights=True, padded_vocab_size=272, vocab_size=BYTES,
             make_vocab_size_divisible_by=8, max_position_embeddings=64, seq_length=64)
MODEL_ARGS = ("num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads", "group_query_attention",
              "num_query_groups", "kv_channels", "normalization", "norm_epsilon", "swiglu", "add_bias_linear",
              "add_qkv_bias", "position_embedding_type", "rotary_base", "untie_embeddings_and_output_weights",
              "padded_vocab_size", "max_position_embeddings", "num_experts", "moe_router_topk",
              "moe_ffn_hidden_size")


def megatron_args(common_pt) -> dict:
    """The model arguments `to-megatron` wrote (read here with torch's own weights_only loader)."""
    import argparse

    with torch.serialization.safe_globals([argparse.Namespace]):
        args = vars(torch.load(common_pt, weights_only=True)["args"])
    return {k: args[k] for k in MODEL_ARGS if args.get(k) is not None}


def reference_loss(logits: list, windows: list, vocab: int) -> float:
    """Token-weighted cross-entropy of Megatron-Core's logits over the real vocabulary."""
    total = sum(torch.nn.functional.cross_entropy(x[:, :vocab].double(), w[1:], reduction="sum").item()
                for x, w in zip(logits, windows))
    return total / sum(len(w) - 1 for w in windows)


def eval_loss(ckpt, text_file, capsys, *extra) -> dict:
    """`tpzoo eval` as typed (one rank runs in this process), its JSON line."""
    capsys.readouterr()
    assert cli(["eval", str(ckpt), "--text-file", str(text_file), "--seq-len", str(SEQ),
                "--max-tokens", str(TOKENS), *extra]) == 0
    return json.loads(capsys.readouterr().out.strip().splitlines()[-1])


def full_tensors(ckpt) -> dict:
    src = CheckpointSource(ckpt)
    try:
        return {n: src.read_box(n, [(0, k) for k in src.full_shape(n)]).clone() for n in src.tensors}
    finally:
        src.close()


def dcp_tensors(iter_dir) -> dict:
    """Every tensor of a torch_dist directory, read by torch.distributed.checkpoint itself."""
    from torch.distributed.checkpoint import FileSystemReader, load
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    reader = FileSystemReader(str(iter_dir))
    md = reader.read_metadata().state_dict_metadata
    out = {k: torch.empty(tuple(m.size), dtype=m.properties.dtype) for k, m in md.items()
           if isinstance(m, TensorStorageMetadata)}
    load(out, storage_reader=reader, no_dist=True)
    return out


@pytest.fixture(scope="module")
def mc(tmp_path_factory):
    from megatron_oracle import POOL_ENV, first_result, session

    root = tmp_path_factory.mktemp("megatron")
    hf = save_hf_model("llama", root / "hf")
    convert_from_hf(root / "hf", root / "tz", tp=2, progress=False)
    assert cli(["convert", "to-megatron", str(root / "tz"), str(root / "to_mc"), "--tp", "2", "--megatron-core",
                "0.16", "--transformer-impl", "local", "--quiet"]) == 0
    (root / "text.txt").write_text(TEXT)
    windows = token_windows(list(TEXT.encode())[:TOKENS], SEQ)
    hf_ids = torch.randint(0, VOCAB, (13,), generator=torch.Generator().manual_seed(3))
    jobs = [dict(args=LLAMA, tp=2, seed=1, dist=str(root / "dist" / "iter_0000010"),
                 legacy=str(root / "legacy" / "iter_0000010"), windows=windows),
            dict(args=megatron_args(root / "to_mc" / "release" / "common.pt"), tp=2,
                 load=str(root / "to_mc" / "release"), windows=[hf_ids])]
    saved, loaded = first_result(run_on_ranks(2, session, jobs, pool_env=POOL_ENV))
    with torch.no_grad():
        hf_logits = hf(input_ids=hf_ids[None, :-1]).logits[0]
    return SimpleNamespace(root=root, windows=windows, saved=saved, loaded=loaded[0], hf_logits=hf_logits)


@pytest.fixture
def torch_load_allowlist_without_megatron():
    """torch.load's allowlist as a process that never imported megatron has it. Importing megatron.core (another
    test module may, in this process) adds its classes to that list; the reader must work without them."""
    saved = torch.serialization.get_safe_globals()
    torch.serialization.clear_safe_globals()
    yield
    torch.serialization.add_safe_globals(saved)


def test_from_megatron_torch_dist_and_legacy_evaluate_to_megatron_core_loss(mc, tmp_path, capsys,
                                                                             torch_load_allowlist_without_megatron):
    assert not torch.serialization.get_safe_globals()  # megatron's classes not allowed: the reader keeps its own list
    root = mc.root
    assert cli(["convert", "from-megatron", str(root / "dist"), str(tmp_path / "a"), "--pp", "2", "--tokenizer",
                "byte", "--quiet"]) == 0
    assert cli(["convert", "from-megatron", str(root / "legacy" / "iter_0000010"), str(tmp_path / "b"), "--tp", "2",
                "--tokenizer", "byte", "--quiet"]) == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert summary["family"] == "llama" and summary["tp"] == 2
    # the two formats give the same model, bit for bit (stored at tp 1 x pp 2 and tp 2 x pp 1)
    a, b = full_tensors(tmp_path / "a"), full_tensors(tmp_path / "b")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert a["embed.weight"].shape == (BYTES, 32)  # the 13 padded rows dropped
    # evaluated at another layout (tp 1, pp 1), with the tokenizer recorded at conversion
    result = eval_loss(tmp_path / "a", root / "text.txt", capsys)
    ref = reference_loss(mc.saved, mc.windows, BYTES)
    assert result["tokens"] == TOKENS - 1 and math.isclose(result["loss"], ref, rel_tol=1e-5)
    manifest = json.loads((tmp_path / "a" / "manifest.json").read_text())
    assert "tpzoo_tokenizer.json" in manifest["aux_files"] and manifest["metadata"]["tokenizer"] == "byte"
    meg = manifest["metadata"]["megatron"]
    assert meg["format"] == "torch_dist" and meg["iteration"] == 10 and meg["padded_vocab_size"] == 272
    assert meg["layout"] == {"tp": 2, "pp": 1, "ep": 1} and meg["args"]["num_query_groups"] == 2
    assert "attention_backend" not in meg["args"]  # a Megatron enum: read (as an inert record), not recorded
    assert cli(["inspect", str(root / "legacy")]) == 0
    shown = capsys.readouterr().out
    assert "(legacy, iteration 10" in shown and "tp=2 pp=1 ep=1" in shown and "num_query_groups = 2" in shown
    assert "decoder.layers.self_attention.linear_qkv.weight" in shown and "[2, 64, 32]" in shown


def test_to_megatron_loads_strictly_into_megatron_core_with_transformers_logits(mc):
    # the session's load is Megatron-Core's strict one (no key missing, none unexpected) at tp 2
    assert mc.loaded.shape == (12, 256)  # the vocabulary padded as Megatron-LM pads it: to a multiple of 128 x tp
    torch.testing.assert_close(mc.loaded[:, :VOCAB], mc.hf_logits, rtol=1e-4, atol=1e-4)
    assert torch.count_nonzero(mc.loaded[:, VOCAB:].abs() > 0) == 0  # zero padding rows: zero logits


def test_megatron_round_trip_is_bit_exact(mc, tmp_path, capsys):
    root = mc.root
    assert cli(["convert", "from-megatron", str(root / "dist"), str(tmp_path / "tz"), "--quiet"]) == 0
    assert cli(["convert", "to-megatron", str(tmp_path / "tz"), str(tmp_path / "back"), "--tp", "2", "--iteration",
                "10", "--quiet"]) == 0
    back = tmp_path / "back" / "iter_0000010"
    assert (tmp_path / "back" / "latest_checkpointed_iteration.txt").read_text().strip() == "10"
    assert not (back / "common.pt").exists()  # Megatron-Core >= 0.19's form: the common state in the .distcp files
    original, rewritten = dcp_tensors(root / "dist" / "iter_0000010"), dcp_tensors(back)
    assert set(rewritten) == {k for k in original if not k.startswith("optimizer.")}
    for key, t in rewritten.items():
        want = original[key]
        if key in ("embedding.word_embeddings.weight", "output_layer.weight"):
            assert torch.equal(t[:BYTES], want[:BYTES]) and not t[BYTES:].any(), key  # the padding: zero rows
        else:
            assert torch.equal(t, want), key
    # the common state, read the way Megatron-Core >= 0.19 reads it (torch.distributed.checkpoint, weights_only)
    import argparse
    import io

    from torch.distributed.checkpoint import FileSystemReader, load

    state = {"common_state/shard_0_1": io.BytesIO()}
    with torch.serialization.safe_globals([argparse.Namespace]):
        load(state, storage_reader=FileSystemReader(str(back)), no_dist=True)
    common = state["common_state/shard_0_1"][0]
    assert common["iteration"] == 10 and common["checkpoint_version"] == 3.0
    assert {k: getattr(common["args"], k) for k in LLAMA} == LLAMA
    # and tpzoo reads it back the same way
    assert cli(["convert", "from-megatron", str(tmp_path / "back"), str(tmp_path / "again"), "--quiet"]) == 0
    a, b = full_tensors(tmp_path / "tz"), full_tensors(tmp_path / "again")
    assert all(torch.equal(a[k], b[k]) for k in a)


def _expect_error(args, match, capsys, parent: Path):
    before = sorted(p.name for p in parent.iterdir())
    capsys.readouterr()
    assert cli(args) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith(f"tpzoo convert {args[1]}: error:") and match in err, err
    assert sorted(p.name for p in parent.iterdir()) == before  # no DST, no temporary directory


def test_bad_megatron_inputs_fail_in_one_line_writing_nothing(mc, tmp_path, capsys):
    out = tmp_path / "out"
    out.mkdir()
    dst = str(out / "ckpt")
    dist = mc.root / "dist" / "iter_0000010"
    # no saved arguments, no --megatron-args
    bare = tmp_path / "bare"
    shutil.copytree(dist, bare)
    torch.save({"checkpoint_version": 3.0, "iteration": 10}, bare / "common.pt")
    _expect_error(["convert", "from-megatron", str(bare), dst], "--megatron-args", capsys, out)
    # ... which --megatron-args supplies (YAML; the vocabulary from the tokenizer): the same model
    (tmp_path / "args.yaml").write_text("".join(f"{k}: {json.dumps(v)}\n" for k, v in LLAMA.items()
                                                if k != "vocab_size"))
    assert cli(["convert", "from-megatron", str(bare), dst, "--megatron-args", str(tmp_path / "args.yaml"),
                "--tokenizer", "byte", "--quiet"]) == 0
    assert cli(["convert", "from-megatron", str(dist), str(tmp_path / "ref"), "--quiet"]) == 0
    a, b = full_tensors(dst), full_tensors(tmp_path / "ref")
    assert all(torch.equal(a[k], b[k]) for k in b)
    shutil.rmtree(dst)
    # an argument that contradicts the tensors' shapes
    (tmp_path / "wrong.json").write_text(json.dumps({"ffn_hidden_size": 40}))
    _expect_error(["convert", "from-megatron", str(dist), dst, "--megatron-args", str(tmp_path / "wrong.json")],
                  "linear_fc1.weight has shape [2, 96, 32], but the arguments imply [2, 80, 32]", capsys, out)
    # a truncated shard, in either format
    cut = tmp_path / "cut"
    shutil.copytree(dist, cut)
    shard = cut / "__1_0.distcp"
    shard.write_bytes(shard.read_bytes()[:-100])
    _expect_error(["convert", "from-megatron", str(cut), dst], "truncated", capsys, out)
    cut_legacy = tmp_path / "cut_legacy"
    shutil.copytree(mc.root / "legacy" / "iter_0000010", cut_legacy)
    rank = cut_legacy / "mp_rank_01" / "model_optim_rng.pt"
    rank.write_bytes(rank.read_bytes()[:-5000])
    _expect_error(["convert", "from-megatron", str(cut_legacy), dst], "mp_rank_01", capsys, out)
    # and the way out: a layout Megatron cannot run (2 query groups at tp 4)
    _expect_error(["convert", "to-megatron", str(mc.root / "tz"), dst, "--tp", "4"],
                  "2 kv heads at tp=4: Megatron needs num_query_groups divisible by tp", capsys, out)


# --- the other shapes and layouts (slow tier): GPT-style at tp 2 x pp 2, Mixtral-style experts at ep 2 ------------
# (Megatron-Core wants sequence parallelism for experts under tp, which its torch norms do not support: ep 2 x dp 2)

GPT = dict(num_layers=2, hidden_size=32, ffn_hidden_size=64, num_attention_heads=4, group_query_attention=False,
           normalization="LayerNorm", norm_epsilon=1e-5, swiglu=False, add_bias_linear=True,
           position_embedding_type="learned_absolute", untie_embeddings_and_output_weights=False,
           padded_vocab_size=272, vocab_size=BYTES, make_vocab_size_divisible_by=8, max_position_embeddings=64,
           seq_length=64)
MOE = dict(LLAMA, num_experts=4, moe_router_topk=2, moe_ffn_hidden_size=40, untie_embeddings_and_output_weights=False)


def _mixtral(path):
    import transformers as tf

    torch.manual_seed(4)
    model = tf.MixtralForCausalLM(tf.MixtralConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=48,
                                                   num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=2,
                                                   num_local_experts=4, num_experts_per_tok=2,
                                                   max_position_embeddings=128))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(".gate.weight"):
                p.normal_(std=1.0)  # confident, uneven routing
    model.save_pretrained(path)
    return model


@pytest.fixture(scope="module")
def layouts(tmp_path_factory):
    from megatron_oracle import POOL_ENV, first_result, session

    root = tmp_path_factory.mktemp("megatron_layouts")
    hf_ids = torch.randint(0, VOCAB, (13,), generator=torch.Generator().manual_seed(3))
    refs, jobs = {}, []
    for kind, hf, layout in (("gpt2", None, ("--tp", "2", "--pp", "2")), ("mixtral", _mixtral, ("--ep", "2")),
                             ("qwen2", None, ())):  # qwen2: q/k/v biases only (add_qkv_bias), one kv head
        model = hf(root / kind) if hf else save_hf_model(kind, root / kind)
        with torch.no_grad():
            refs[kind] = model(input_ids=hf_ids[None, :-1]).logits[0]
        assert cli(["convert", "to-megatron", str(root / kind), str(root / f"{kind}_mc"), *layout,
                    "--megatron-core", "0.16", "--transformer-impl", "local", "--quiet"]) == 0
    windows = token_windows(list(TEXT.encode())[:TOKENS], SEQ)
    jobs = [dict(args=GPT, tp=2, pp=2, seed=2, dist=str(root / "gpt_dist" / "iter_0000020"),
                 legacy=str(root / "gpt_legacy" / "iter_0000020"), windows=windows),
            dict(args=megatron_args(root / "gpt2_mc" / "release" / "common.pt"), tp=2, pp=2,
                 load=str(root / "gpt2_mc" / "release"), windows=[hf_ids]),
            dict(args=MOE, tp=1, ep=2, seed=3, dist=str(root / "moe_dist" / "iter_0000030"),
                 legacy=str(root / "moe_legacy" / "iter_0000030"), windows=windows),
            dict(args=megatron_args(root / "mixtral_mc" / "release" / "common.pt"), tp=1, ep=2,
                 load=str(root / "mixtral_mc" / "release"), windows=[hf_ids]),
            dict(args=megatron_args(root / "qwen2_mc" / "release" / "common.pt"), tp=1,
                 load=str(root / "qwen2_mc" / "release"), windows=[hf_ids])]
    out = first_result(run_on_ranks(4, session, jobs, pool_env=POOL_ENV))
    return SimpleNamespace(root=root, windows=windows, out=out, refs=refs)


@pytest.mark.slow
@pytest.mark.parametrize("kind, job, family", [("gpt", 0, "gpt2"), ("moe", 2, "mixtral")])
def test_gpt_and_moe_layouts_from_megatron(layouts, kind, job, family, tmp_path, capsys):
    root = layouts.root
    (tmp_path / "text.txt").write_text(TEXT)
    ref = reference_loss(layouts.out[job], layouts.windows, BYTES)
    converted = []
    for fmt in ("dist", "legacy"):
        dst = tmp_path / fmt
        assert cli(["convert", "from-megatron", str(root / f"{kind}_{fmt}"), str(dst), "--tp", "2", "--tokenizer",
                    "byte", "--quiet"] + (["--ep", "2"] if kind == "moe" else [])) == 0
        assert json.loads((dst / "manifest.json").read_text())["model_config"]["family"] == family
        converted.append(full_tensors(dst))
    assert all(torch.equal(converted[0][k], converted[1][k]) for k in converted[0])
    result = eval_loss(tmp_path / "legacy", tmp_path / "text.txt", capsys)
    assert math.isclose(result["loss"], ref, rel_tol=1e-5), (result, ref)


@pytest.mark.slow
@pytest.mark.parametrize("kind, job", [("gpt2", 1), ("mixtral", 3), ("qwen2", 4)])
def test_gpt_and_moe_layouts_to_megatron(layouts, kind, job):
    torch.testing.assert_close(layouts.out[job][0][:, :VOCAB], layouts.refs[kind], rtol=1e-4, atol=1e-4)
