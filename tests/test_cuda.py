"""On a GPU (`pytest -m cuda`, run by scripts/gpu_check.sh; skipped where CUDA is absent): the runtime places
the model, the optimizer's buffers and every batch on cuda:LOCAL_RANK, trains with the same losses as the CPU,
and loads a Hugging Face checkpoint straight into GPU shards whose greedy generation equals transformers'."""
import sysconfig
from pathlib import Path

import pytest
import torch

import tpzoo
from tpzoo.train import load_config

from checkpoint_helpers import ids, write_hf

pytestmark = pytest.mark.cuda


def _config(device: str, save: str = ""):
    text = str(Path(sysconfig.get_paths()["stdlib"]) / "textwrap.py")
    return load_config(None, dict(model="nano-llama", data=[text], seq_len=64, global_batch_size=4,
                                  micro_batch_size=2, steps=4, warmup_steps=1, tp=1, pp=1, save=save,
                                  sample_prompt="", quiet=True, eval_fraction=0.0, seed=0, device=device))


def test_training_runs_on_the_gpu_with_the_cpu_losses():
    from tpzoo.train.loop import Trainer

    losses = {}
    for device in ("cpu", "cuda"):
        dims = tpzoo.init_parallel(device=device)
        try:
            trainer = Trainer(_config(device), dims)
            if device == "cuda":
                assert dims.device == torch.device("cuda", torch.cuda.current_device())
                opt = trainer.optimizer
                tensors = [p for c in trainer.chunks for p in c.parameters()] + [
                    opt.flat, opt.master, opt.exp_avg, opt.exp_avg_sq, opt.grads.data]
                assert all(t.device == dims.device for t in tensors)
            try:
                losses[device] = trainer.run()["losses"]
            finally:
                trainer.close()
        finally:
            tpzoo.destroy_parallel()
    assert losses["cuda"] == pytest.approx(losses["cpu"], abs=1e-4)


def test_hf_checkpoint_loads_into_gpu_shards_and_generates_like_transformers(tmp_path):
    from tpzoo.checkpoint import load_model
    from tpzoo.generation import generate

    ref_model = write_hf("llama", tmp_path / "llama")
    prompt = ids(batch=2, seq=5, seed=11)
    with torch.no_grad():
        ref = ref_model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=12,
                                 do_sample=False)
    dims = tpzoo.init_parallel(device="cuda")
    try:
        model = load_model(tmp_path / "llama", dims, dtype=torch.float32)
        assert all(p.device == dims.device for p in model.parameters())
        got = generate(model, prompt, 12)
        assert got.device == dims.device and torch.equal(got.cpu(), ref)
    finally:
        tpzoo.destroy_parallel()
