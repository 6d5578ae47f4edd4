"""LoRA on the frontier families with Hugging Face PEFT as the oracle (tests/frontier_models.py's tiny models):

- in one process, adapters on every projection `all-linear` targets (MLA's q_a_proj / q_b_proj or q_proj,
  kv_a_proj_with_mqa, kv_b_proj, o_proj; GQA's q/k/v/o), random B, saved as a tpzoo LoRA checkpoint and exported as
  a PEFT adapter: peft.PeftModel on the transformers model gives the same logits. DeepSeek-V3's and GLM-4.5's MLP
  projections take no adapter and naming one is refused (PEFT reads those names of these model types as the fused
  routed experts: models/lora.py);
- `finetune`'s path end to end: --lora-rank 8 at tp 2 + SP from a DeepSeek-V3 HF directory, the checkpoint
  exported as `convert to-hf` exports it (export_peft), and transformers + peft give the loss tpzoo gives (1e-4)."""
import json

import pytest
import torch
from frontier_models import make_hf_model

from tpzoo.checkpoint import load_model, save_model_shards
from tpzoo.checkpoint.lora_io import lora_metadata
from tpzoo.checkpoint.peft import export_peft
from tpzoo.errors import ConfigError
from tpzoo.evaluation import evaluate
from tpzoo.models.lora import LoRAConfig, add_lora, init_lora
from tpzoo.parallel.lora import is_lora_param
from tpzoo.testing import run_on_ranks

peft = pytest.importorskip("peft")
IDS = torch.tensor([[3, 14, 15, 9, 6, 35, 8, 7, 32, 38, 46, 26]])


@pytest.mark.parametrize("kind", ["deepseek_v3", "deepseek_v3_noq", "glm4_moe", "gpt_oss"])
def test_peft_adapter_gives_transformers_the_same_logits(kind, tmp_path):
    from transformers import AutoModelForCausalLM

    base = tmp_path / "base"
    make_hf_model(kind).save_pretrained(base)
    model = load_model(str(base))
    lcfg = LoRAConfig(rank=4, alpha=8, targets="all-linear")
    add_lora([model], lcfg)
    init_lora([model], 0)
    g = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if ".lora.B." in n:
                p.copy_(torch.randn(p.shape, generator=g) * 0.05)
        want = model.full_logits(model(IDS))
    ckpt = tmp_path / "lora"
    ckpt.mkdir()
    save_model_shards(model, ckpt, model.cfg, select=is_lora_param, metadata=lora_metadata(lcfg, str(base)))
    adapter = export_peft(str(ckpt), tmp_path / "peft")
    targets = set(json.loads((adapter / "adapter_config.json").read_text())["target_modules"])
    if kind.startswith("deepseek"):
        assert {"kv_a_proj_with_mqa", "kv_b_proj", "o_proj"} <= targets
        assert ({"q_a_proj", "q_b_proj"} if kind == "deepseek_v3" else {"q_proj"}) <= targets
    else:
        assert {"q_proj", "k_proj", "v_proj", "o_proj"} <= targets
    assert not targets & {"gate_proj", "up_proj", "down_proj"}
    hf = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32).eval()
    with torch.no_grad():
        plain = hf(IDS).logits
        got = peft.PeftModel.from_pretrained(hf, adapter).eval()(IDS).logits
    assert (plain - want).abs().max() > 0.1  # the adapters matter
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    if kind != "gpt_oss":
        with pytest.raises(ConfigError, match="fused routed experts"):
            add_lora([load_model(str(base))], LoRAConfig(rank=4, alpha=8, targets="q_proj,down_proj"
                                                         if kind != "deepseek_v3" else "q_a_proj,down_proj"))


def _train(cfg):
    from tpzoo.train import train

    return train(cfg)


def test_lora_finetune_at_tp2_exports_an_adapter_transformers_and_peft_load(tmp_path):
    import sysconfig
    from pathlib import Path

    from transformers import AutoModelForCausalLM

    from tpzoo.data import iter_documents, load_tokenizer, preprocess
    from tpzoo.train import load_config

    hf_dir = tmp_path / "hf"
    make_hf_model("deepseek_v3", vocab=259).save_pretrained(hf_dir)  # (the byte tokenizer's vocabulary)
    lib = Path(sysconfig.get_paths()["stdlib"])
    store = str(preprocess(iter_documents([str(lib / "textwrap.py")]), "byte", tmp_path / "store").path)
    cfg = dict(base=str(hf_dir), data=[store], lora_rank=8, lora_alpha=16.0, seq_len=16, global_batch_size=4,
               micro_batch_size=2, steps=3, lr=1e-2, warmup_steps=1, tp=2, sequence_parallel=True,
               save=str(tmp_path / "run"), sample_prompt="", quiet=True, eval_fraction=0.0, seed=0, prefetch=1)
    ckpt = run_on_ranks(2, _train, load_config(None, cfg))[0]["checkpoint"]
    export_peft(ckpt, tmp_path / "peft")  # (what `tpzoo convert to-hf` does with a LoRA checkpoint)
    tokens = torch.tensor(load_tokenizer("byte").encode("def wrap(text, width=70):\n    return text\n"))[:33]
    ours = evaluate(load_model(ckpt), tokens, 16, batch_size=2)["loss"]
    hf = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    model = peft.PeftModel.from_pretrained(hf, str(tmp_path / "peft")).eval()
    windows = [tokens[s:s + 17] for s in range(0, len(tokens) - 1, 16)]  # (tpzoo.evaluation's windows)

    def loss() -> float:
        with torch.no_grad():
            total = sum(torch.nn.functional.cross_entropy(model(w[None, :-1]).logits[0], w[1:], reduction="sum")
                        for w in windows)
        return float(total) / sum(len(w) - 1 for w in windows)

    theirs = loss()
    assert abs(ours - theirs) < 1e-4, (ours, theirs)
    with model.disable_adapter():
        assert abs(loss() - theirs) > 1e-3  # the adapters trained
