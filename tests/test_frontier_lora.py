"""LoRA on DeepSeek-V3 trained with tpzoo and loaded by Hugging Face PEFT (the oracle), at tp 2 + SP:
`finetune`'s path end to end: --lora-rank 8 on the latent attention's projections (q_a_proj, q_b_proj,
kv_a_proj_with_mqa, kv_b_proj, o_proj; the replicated ones included) from a DeepSeek-V3 HF directory, the
checkpoint exported as `convert to-hf` exports it (export_peft), and transformers + peft give the loss tpzoo gives
(1e-4). (Every MoE family's adapters against PEFT, and what PEFT cannot load: tests/test_lora_peft_moe.py.)"""
import pytest
import torch
from frontier_models import make_hf_model

from tpzoo.checkpoint import load_model
from tpzoo.checkpoint.peft import export_peft
from tpzoo.evaluation import evaluate
from tpzoo.testing import run_on_ranks

peft = pytest.importorskip("peft")


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
    cfg = dict(base=str(hf_dir), data=[store], lora_rank=8, lora_alpha=16.0,
               lora_targets=["q_a_proj,q_b_proj,kv_a_proj_with_mqa,kv_b_proj,o_proj"], seq_len=16, global_batch_size=4,
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
