"""The runtime places the model, the optimizer's buffers and every batch on its device, trains with the same
losses as the CPU, and loads a Hugging Face checkpoint straight into shards on the device whose greedy generation
equals transformers'.

Each test runs on `cpu` everywhere (CI: its assertions are exercised at every change, so they cannot rot unseen)
and on `cuda` where a GPU is present (`pytest -m cuda`, run by scripts/gpu_check.sh; skipped without one)."""
import sysconfig
from pathlib import Path

import pytest
import torch

import tpzoo
from tpzoo.train import load_config

from checkpoint_helpers import ids, write_hf

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)]


def _config(device: str, save: str = ""):
    text = str(Path(sysconfig.get_paths()["stdlib"]) / "textwrap.py")
    return load_config(None, dict(model="nano-llama", data=[text], seq_len=64, global_batch_size=4,
                                  micro_batch_size=2, steps=4, warmup_steps=1, tp=1, pp=1, save=save,
                                  sample_prompt="", quiet=True, eval_fraction=0.0, seed=0, device=device))


def _optimizer_tensors(opt) -> list[torch.Tensor]:
    """Every buffer the optimizer holds (the fp32 master is the flat buffer itself with fp32 weights: None)."""
    tensors = [opt.flat, opt.master, opt.exp_avg, opt.exp_avg_sq, opt.grads.data]
    assert opt.flat is not None and opt.exp_avg is not None and opt.grads.data is not None
    return [t for t in tensors if t is not None]


@pytest.mark.parametrize("device", DEVICES)
def test_training_runs_on_the_device_with_the_cpu_losses(device):
    from tpzoo.train.loop import Trainer

    losses = {}
    for where in dict.fromkeys(("cpu", device)):  # the CPU reference, then the device under test
        dims = tpzoo.init_parallel(device=where)
        try:
            trainer = Trainer(_config(where), dims)
            if where == device:
                want = torch.device("cuda", torch.cuda.current_device()) if device == "cuda" else torch.device("cpu")
                assert dims.device == want
                tensors = [p for c in trainer.chunks for p in c.parameters()] + _optimizer_tensors(trainer.optimizer)
                assert all(t.device == dims.device for t in tensors)
            try:
                losses[where] = trainer.run()["losses"]
            finally:
                trainer.close()
        finally:
            tpzoo.destroy_parallel()
    assert len(losses["cpu"]) == 4 and losses["cpu"][-1] < losses["cpu"][0]
    assert losses[device] == pytest.approx(losses["cpu"], abs=1e-4)


@pytest.mark.parametrize("device", DEVICES)
def test_hf_checkpoint_loads_into_device_shards_and_generates_like_transformers(tmp_path, device):
    from tpzoo.checkpoint import load_model
    from tpzoo.generation import generate

    ref_model = write_hf("llama", tmp_path / "llama")
    prompt = ids(batch=2, seq=5, seed=11)
    with torch.no_grad():
        ref = ref_model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=12,
                                 do_sample=False)
    dims = tpzoo.init_parallel(device=device)
    try:
        model = load_model(tmp_path / "llama", dims, dtype=torch.float32)
        assert all(p.device == dims.device for p in model.parameters())
        got = generate(model, prompt, 12)
        assert got.device == dims.device and torch.equal(got.cpu(), ref)
    finally:
        tpzoo.destroy_parallel()
