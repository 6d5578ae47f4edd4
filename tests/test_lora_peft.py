"""LoRA checkpoints in and out of Hugging Face PEFT (the oracle), and LoRA fine-tuning end to end.

Round trip per family, the 2025 ones included (in one process): the base read from a tiny HF model written by transformers, adapters on
every linear layer with random B, saved as a tpzoo LoRA checkpoint (adapters only), exported as a PEFT adapter
directory that peft.PeftModel.from_pretrained loads onto the HF base: the same logits (1e-4); imported back
(--lora-from's path) the same logits; merged (to-hf --merge) a plain HF model with the same logits.
End to end: `finetune --lora-rank` at tp=2 with SP from an HF directory, resumed exactly, exported, continued
from the PEFT adapter at another layout, evaluated; bad inputs give one clear error each."""
import json
import subprocess
import sys

import pytest
import torch
from hf_models import save_hf_model
from test_finetune import _cfg, _tiny_hf_llama, _train

from tpzoo.checkpoint import load_model, reshard, save_model_shards
from tpzoo.checkpoint.format import CheckpointError
from tpzoo.checkpoint.lora_io import lora_metadata
from tpzoo.checkpoint.peft import export_merged, export_peft, load_peft_adapters, read_peft_config
from tpzoo.models.lora import LoRAConfig, add_lora, init_lora
from tpzoo.parallel.lora import is_lora_param
from tpzoo.testing import run_on_ranks

peft = pytest.importorskip("peft")
IDS = torch.tensor([[3, 14, 15, 92, 65, 35, 89, 79, 32, 38, 46, 26]])  # longer than Mistral's window of 8


def _random_b(model) -> None:
    g = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if ".lora.B." in n:
                p.copy_(torch.randn(p.shape, generator=g) * 0.05)


def _hf_logits(model):
    with torch.no_grad():
        return model(IDS).logits


def _ours(model):
    with torch.no_grad():
        return model.full_logits(model(IDS))


@pytest.mark.parametrize("kind", ["llama", "qwen2", "mistral", "gpt2", "qwen3", "olmo2", "gemma3", "phi3", "smollm3",
                                  "qwen3_5"])  # qwen3_5: one adapter spanning in_proj's q|k|v (HF in_proj_qkv)
def test_peft_round_trip(kind, tmp_path):
    from transformers import AutoModelForCausalLM

    base = tmp_path / "base"
    save_hf_model(kind, base)
    model = load_model(str(base))
    lcfg = LoRAConfig(rank=4, alpha=8, targets="all-linear")
    add_lora([model], lcfg)
    init_lora([model], 0)
    _random_b(model)
    want = _ours(model)
    ckpt = tmp_path / "lora"
    ckpt.mkdir()
    save_model_shards(model, ckpt, model.cfg, select=is_lora_param, metadata=lora_metadata(lcfg, base))
    assert all(".lora." in n for n in json.loads((ckpt / "manifest.json").read_text())["tensors"])
    torch.testing.assert_close(_ours(load_model(str(ckpt))), want, rtol=1e-5, atol=1e-5)  # base + adapters
    resharded = reshard(str(ckpt), tmp_path / "lora-tp2", tp=2, pp=1, progress=False)  # the adapters only
    assert resharded["tp"] == 2 and all(".lora." in n for n in resharded["tensors"])
    torch.testing.assert_close(_ours(load_model(str(tmp_path / "lora-tp2"))), want, rtol=1e-5, atol=1e-5)

    # out: PEFT loads the adapter onto the transformers model
    adapter = export_peft(str(ckpt), tmp_path / "peft")
    hf = peft.PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32),
                                        adapter).eval()
    torch.testing.assert_close(_hf_logits(hf), want, rtol=1e-4, atol=1e-4)
    # in: a fresh model takes the adapter back
    fresh = load_model(str(base))
    add_lora([fresh], read_peft_config(adapter))
    load_peft_adapters([fresh], adapter)
    torch.testing.assert_close(_ours(fresh), want, rtol=1e-5, atol=1e-5)
    # merged: a plain HF model equal to base + adapter
    export_merged(str(ckpt), tmp_path / "merged", progress=False)
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged", dtype=torch.float32).eval()
    torch.testing.assert_close(_hf_logits(merged), want, rtol=1e-4, atol=1e-4)


def test_bad_adapters_and_bases_are_refused(tmp_path):
    base, other = tmp_path / "base", tmp_path / "other"
    save_hf_model("llama", base)
    save_hf_model("qwen2", other)  # 1 kv head: k_proj/v_proj adapters of the wrong shape for llama's 2
    model = load_model(str(other))
    lcfg = LoRAConfig(rank=2, alpha=4, targets="k_proj")
    add_lora([model], lcfg)
    init_lora([model], 0)
    ckpt = tmp_path / "lora"
    ckpt.mkdir()
    save_model_shards(model, ckpt, model.cfg, select=is_lora_param, metadata=lora_metadata(lcfg, other))
    adapter = export_peft(str(ckpt), tmp_path / "peft")
    target = load_model(str(base))
    add_lora([target], read_peft_config(adapter))
    with pytest.raises(CheckpointError, match=r"k_proj\.lora_B\.weight has shape \[8, 2\], the base model needs \[16, 2\]"):
        load_peft_adapters([target], adapter)
    # the base of a LoRA checkpoint changed or went away
    save_hf_model("mistral", other)  # overwritten in place: another model
    with pytest.raises(CheckpointError, match="has changed since the adapters were trained"):
        load_model(str(ckpt))
    import shutil

    shutil.rmtree(other)
    with pytest.raises(CheckpointError, match="is missing"):
        load_model(str(ckpt))
    cfg = json.loads((adapter / "adapter_config.json").read_text())
    (adapter / "adapter_config.json").write_text(json.dumps({**cfg, "use_dora": True}))
    with pytest.raises(CheckpointError, match="use_dora"):
        read_peft_config(adapter)


def _eval_logits(ckpt):
    model = load_model(ckpt)
    return _ours(model)


def test_lora_finetune_resume_export_and_continue(tmp_path):
    from test_finetune import WORDS

    sft = tmp_path / "sft.jsonl"
    with sft.open("w") as f:
        for i in range(40):
            a, b = WORDS[i % 10], WORDS[(3 * i + 1) % 10]
            f.write(json.dumps({"prompt": f"Join {a} and {b}.", "response": f"{a}-{b}"}) + "\n")
    base = tmp_path / "hf-base"
    _tiny_hf_llama(base)
    lora = dict(base=str(base), data=[str(sft)], lora_rank=4, lora_alpha=8.0, lora_targets=["q_proj,v_proj",
                                                                                            "down_proj"])
    straight = run_on_ranks(2, _train, _cfg(**lora, steps=4, tp=2, sequence_parallel=True,
                                            save=str(tmp_path / "a")))[0]
    half = run_on_ranks(2, _train, _cfg(**lora, steps=2, tp=2, sequence_parallel=True, save=str(tmp_path / "b")))[0]
    resumed = run_on_ranks(2, _train, _cfg(**lora, steps=4, tp=2, sequence_parallel=True, save=str(tmp_path / "b"),
                                           resume="auto"))[0]
    assert straight["losses"][:2] == half["losses"] and resumed["losses"] == straight["losses"][2:]
    ckpt = straight["checkpoint"]
    manifest = json.loads((tmp_path / "a" / "step_00000004" / "manifest.json").read_text())
    assert set(manifest["tensors"]) and all(".lora." in n for n in manifest["tensors"])
    adapters = sum(f["bytes"] for f in manifest["files"])
    # rank 4 on 3 of 7 projections: under a tenth of even this tiny base (a 70B's adapters are megabytes)
    assert adapters * 10 < sum(p.stat().st_size for p in base.glob("*.safetensors"))
    assert manifest["metadata"]["lora"]["targets"] == ["q_proj", "v_proj", "down_proj"]

    out = subprocess.run([sys.executable, "-m", "tpzoo", "convert", "to-hf", ckpt, str(tmp_path / "peft")],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    # continue from the PEFT adapter at another layout (pp=2), lr 0: the adapters come back unchanged
    cont = run_on_ranks(2, _train, _cfg(base=str(base), data=[str(sft)], lora_from=str(tmp_path / "peft"), steps=1,
                                        tp=1, pp=2, lr=0.0, min_lr=0.0, save=str(tmp_path / "c")))[0]
    torch.testing.assert_close(_eval_logits(cont["checkpoint"]), _eval_logits(ckpt), rtol=1e-5, atol=1e-5)
    # eval and generate take the LoRA checkpoint (base + adapters) at any layout
    text = tmp_path / "held-out.txt"
    text.write_text("Join apple and river. apple-river\n" * 20)
    out = subprocess.run([sys.executable, "-m", "tpzoo", "eval", ckpt, "--text-file", str(text), "--tp", "2"],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and "loss" in out.stdout, out.stderr
    out = subprocess.run([sys.executable, "-m", "tpzoo", "generate", ckpt, "--prompt", "Join apple and river.",
                          "--max-new-tokens", "4", "--tp", "1", "--pp", "2"], capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0 and out.stdout.strip(), out.stderr


def test_lora_config_errors_before_any_rank_starts(tmp_path):
    base = tmp_path / "hf-base"
    _tiny_hf_llama(base)
    (tmp_path / "x.jsonl").write_text(json.dumps({"prompt": "a", "response": "b"}) + "\n")
    for flags, message in ((["--lora-rank", "4", "--lora-targets", "q_proj,qkv"], "unknown lora target qkv"),
                           (["--lora-rank", "-1"], "lora_rank"), (["--lora-rank", "2", "--lora-alpha", "0"],
                                                                  "lora_alpha")):
        out = subprocess.run([sys.executable, "-m", "tpzoo", "finetune", "--base", str(base), "--data", "x.jsonl",
                              *flags], capture_output=True, text=True, cwd=tmp_path, timeout=120)
        assert out.returncode != 0 and message in out.stderr and "Traceback" not in out.stderr, out.stderr


def test_lora_with_zero_and_recompute_matches_the_plain_run(tmp_path):
    """dp=2: ZeRO-1 shards the adapters' optimizer state, ZeRO-2 their gradients too, in small overlapped buckets
    (the partial-gradient adapters reduced late), nothing of the frozen base; full recomputation replays the
    adapters. Same losses and adapters as the plain data-parallel run."""
    sft = tmp_path / "sft.jsonl"
    sft.write_text("".join(json.dumps({"prompt": f"Say {w}.", "response": w * 3}) + "\n"
                           for w in ("apple", "river", "stone", "cloud", "green", "tiger", "piano", "lemon") * 3))
    base = tmp_path / "hf-base"
    _tiny_hf_llama(base)
    runs = {}
    for name, extra in (("plain", {}), ("zero1", dict(zero1=True, recompute="full")),
                        ("zero2", dict(zero=2, grad_bucket_elems=4096))):
        runs[name] = run_on_ranks(2, _train, _cfg(base=str(base), data=[str(sft)], lora_rank=4, lora_alpha=8.0,
                                                  steps=3, tp=1, dp=2, save=str(tmp_path / name), **extra))[0]
    for name in ("zero1", "zero2"):
        assert runs[name]["losses"] == pytest.approx(runs["plain"]["losses"], rel=1e-6), name
        torch.testing.assert_close(_eval_logits(runs[name]["checkpoint"]), _eval_logits(runs["plain"]["checkpoint"]),
                                   rtol=1e-5, atol=1e-6)
