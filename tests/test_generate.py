"""Greedy generation through the pipeline executor gives transformers' generate(do_sample=False) tokens at tp 1
and 2, pp 2 (KV cache per stage) and tp 2 with sequence parallelism (no cache: the padded context each step);
sampling is identical on every rank; the CLI decodes with the tokenizer that travelled with the checkpoint."""
import json

import pytest
import torch

import tpzoo
from tpzoo.checkpoint import convert_from_hf, load_model
from tpzoo.cli import main as cli
from tpzoo.generation import generate
from tpzoo.testing import run_on_ranks

from checkpoint_helpers import KINDS, ids, write_hf

NEW_TOKENS = 20  # longer than Mistral's sliding window (8): the cached decode must apply it


@pytest.fixture(scope="module")
def cases(tmp_path_factory):
    root = tmp_path_factory.mktemp("gen")
    prompt = ids(batch=2, seq=5, seed=11)
    out = []
    for kind in KINDS:
        model = write_hf(kind, root / kind, tokenizer=kind == "llama")
        convert_from_hf(root / kind, root / f"{kind}-ckpt", tp=2, pp=1, progress=False)
        with torch.no_grad():
            ref = model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=NEW_TOKENS,
                                 do_sample=False)
        out.append((kind, str(root / f"{kind}-ckpt"), prompt, ref))
    return root, out


def _generate_at(cases, layouts):
    samples = []
    for tp, pp, sp in layouts:
        dims = tpzoo.init_parallel(tp=tp, pp=pp)
        for kind, path, prompt, ref in cases:
            model = load_model(path, dims, sequence_parallel=sp).eval()
            cfg = model.cfg
            got = generate(model, prompt, NEW_TOKENS, eos_token_id=cfg.eos_token_id)
            what = f"{kind} tp={tp} pp={pp} sp={sp}"
            assert torch.equal(got, ref), f"{what}: {got.tolist()} vs transformers {ref.tolist()}"
            samples.append(generate(model, prompt, 6, greedy=False, temperature=0.9, top_p=0.9, top_k=20, seed=3))
        tpzoo.destroy_parallel()
    return samples


def test_greedy_matches_transformers_at_every_layout(cases):
    _, items = cases
    per_rank = run_on_ranks(2, _generate_at, items, [(1, 1, False), (2, 1, False), (1, 2, False), (2, 1, True)])
    for a, b in zip(*per_rank):  # same seed, same tokens on every rank
        assert torch.equal(a, b)


def test_generate_command(cases, capsys):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    root, items = cases
    ckpt = items[KINDS.index("llama")][1]
    assert cli(["generate", ckpt, "--prompt", "the lazy dog", "--max-new-tokens", "6", "--json"]) == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    tok = AutoTokenizer.from_pretrained(ckpt)  # the tokenizer files travelled with the checkpoint
    assert result["prompt_ids"] == tok("the lazy dog")["input_ids"]
    ref = AutoModelForCausalLM.from_pretrained(root / "llama").generate(
        torch.tensor([result["prompt_ids"]]), max_new_tokens=6, do_sample=False)
    assert result["new_ids"] == ref[0, len(result["prompt_ids"]):].tolist()
    assert result["completion"] == tok.decode(result["new_ids"])
