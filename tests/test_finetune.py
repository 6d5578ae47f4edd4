"""Fine-tuning: SFT on a JSONL file (loss on responses only) from a tpzoo checkpoint or a Hugging Face directory,
held-out evaluation, and export with `tpzoo convert to-hf` that transformers loads with the same logits."""
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tpzoo.testing import run_on_ranks
from tpzoo.train import load_config

WORDS = ["apple", "river", "stone", "cloud", "green", "tiger", "piano", "lemon", "north", "sugar"]


@pytest.fixture(scope="module")
def sft_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("sft") / "sft.jsonl"
    with path.open("w") as f:
        for i in range(60):
            a, b = WORDS[i % 10], WORDS[(3 * i + 1) % 10]
            f.write(json.dumps({"prompt": f"Join {a} and {b}.", "response": f"{a}-{b}"}) + "\n")
    return str(path)


def _cfg(**kw):
    # seq_len 64: packing keeps examples whole, so a sequence must hold one (the records here: up to ~57 tokens)
    base = dict(task="sft", seq_len=64, global_batch_size=8, micro_batch_size=4, lr=3e-3, min_lr=3e-4,
                warmup_steps=2, weight_decay=0.0, tp=1, pp=1, dp=0, save="", sample_prompt="", quiet=True,
                eval_fraction=0.2, seed=0, prefetch=1, eval_batches=2)
    base.update(kw)
    return load_config(None, base)


def _train(cfg):
    from tpzoo.train import train

    return train(cfg)


@pytest.fixture(scope="module")
def base_ckpt(tmp_path_factory):
    """A briefly pretrained nano GPT (byte tokenizer) as the starting point."""
    import sysconfig

    save = tmp_path_factory.mktemp("base") / "run"
    lib = Path(sysconfig.get_paths()["stdlib"])
    cfg = _cfg(task="pretrain", model="nano-gpt", data=[str(lib / "textwrap.py")], steps=2, save=str(save),
               eval_fraction=0.0, data_cache=str(save.parent / "cache"))
    run_on_ranks(1, _train, cfg)
    return str(save / "step_00000002")


def test_sft_lowers_the_response_loss_and_exports_to_transformers(base_ckpt, sft_file, tmp_path):
    save = tmp_path / "sft"
    cfg = _cfg(base=base_ckpt, data=[sft_file], steps=30, tp=2, sequence_parallel=True, save=str(save))
    first = run_on_ranks(2, _train, _cfg(base=base_ckpt, data=[sft_file], steps=1, tp=2, sequence_parallel=True,
                                         lr=0.0, min_lr=0.0))[0]
    r = run_on_ranks(2, _train, cfg)[0]
    assert r["status"] == "ok"
    assert r["losses"][-1] < r["losses"][0] - 1.5
    assert r["eval_loss"] < first["eval_loss"] - 1.5  # held-out records, never trained on

    # Export with the CLI and reload in transformers: the same logits as tpzoo's model from the checkpoint.
    ckpt, hf_dir = r["checkpoint"], tmp_path / "hf"
    out = subprocess.run([sys.executable, "-m", "tpzoo", "convert", "to-hf", ckpt, str(hf_dir)],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr
    from transformers import AutoModelForCausalLM

    from tpzoo.checkpoint import load_model

    hf = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    ours = load_model(ckpt)
    ids = torch.tensor([list(b"<|user|>\nJoin apple and river.\n<|assistant|>\n")])
    with torch.no_grad():
        want = hf(ids).logits
        got = ours.full_logits(ours(ids))
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


def _tiny_hf_llama(path):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=272, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                      tie_word_embeddings=False)
    LlamaForCausalLM(cfg).save_pretrained(path)


def test_finetune_from_a_hf_directory_padded_examples(sft_file, tmp_path):
    hf_dir = tmp_path / "hf-base"
    _tiny_hf_llama(hf_dir)  # no tokenizer saved with it: the byte tokenizer (259 ids < 272) is used
    r = run_on_ranks(2, _train, _cfg(base=str(hf_dir), data=[sft_file], steps=12, tp=2, packing=False,
                                     seq_len=64))[0]
    assert r["status"] == "ok" and r["losses"][-1] < r["losses"][0] - 0.5


def test_finetune_cli_requires_a_base(tmp_path):
    out = subprocess.run([sys.executable, "-m", "tpzoo", "finetune", "--data", "x.jsonl"], capture_output=True,
                         text=True, cwd=tmp_path, timeout=120)
    assert out.returncode == 2 and "tpzoo finetune: error: --base" in out.stderr and "Traceback" not in out.stderr
