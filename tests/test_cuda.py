"""The runtime places the model, the optimizer's buffers and every batch on its device, trains with the same
losses as the CPU, and loads a Hugging Face checkpoint straight into shards on the device whose greedy generation
equals transformers'. Ring attention's CUDA block kernels (flash in bf16, memory-efficient in fp32; a sliding
window mixing fused, masked and skipped blocks) run every cp rank's schedule in one process and equal SDPA over
the whole sequence (their CPU twins, over emulated ops: tests/test_ring_attention.py); on Hopper the experts'
grouped GEMMs (torch._grouped_mm, bf16) equal the loop (twin: tests/test_moe_experts.py).

The placement tests run on `cpu` everywhere (CI: their assertions are exercised at every change, so they cannot
rot unseen) and on `cuda` where a GPU is present (`pytest -m cuda`, run by scripts/gpu_check.sh; skipped without
one)."""
import sysconfig
from pathlib import Path

import pytest
import torch

import tpzoo
from tpzoo.data import load_tokenizer
from tpzoo.models import get_config
from tpzoo.train import load_config

from checkpoint_helpers import ids, write_hf

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)]


def _config(device: str, save: str = "", base: str = ""):
    text = str(Path(sysconfig.get_paths()["stdlib"]) / "textwrap.py")
    return load_config(None, dict(model="nano-llama", data=[text], seq_len=64, global_batch_size=4,
                                  micro_batch_size=2, steps=4, warmup_steps=1, tp=1, pp=1, save=save, base=base,
                                  sample_prompt="", quiet=True, eval_fraction=0.0, seed=0, device=device))


def _initial_weights(tmp_path) -> str:
    """A checkpoint of the CPU-initialized model: every device's run starts from these weights (a seed draws other
    weights on a CUDA generator than on the CPU's, by design: each device draws on its own)."""
    from tpzoo.checkpoint import save_model_shards
    from tpzoo.models import Transformer

    cfg = _config("cpu")
    model = Transformer(get_config(cfg.model).replace(vocab_size=load_tokenizer("byte").vocab_size), seed=0)
    (tmp_path / "initial").mkdir()
    save_model_shards(model, tmp_path / "initial")
    return str(tmp_path / "initial")


def _optimizer_tensors(opt) -> list[torch.Tensor]:
    """Every buffer the optimizer holds (the fp32 master is the flat buffer itself with fp32 weights: None)."""
    tensors = [opt.flat, opt.master, opt.exp_avg, opt.exp_avg_sq, opt.grads.data]
    assert opt.flat is not None and opt.exp_avg is not None and opt.grads.data is not None
    return [t for t in tensors if t is not None]


@pytest.mark.parametrize("device", DEVICES)
def test_training_runs_on_the_device_with_the_cpu_losses(device, tmp_path):
    from tpzoo.train.loop import Trainer

    losses, base = {}, _initial_weights(tmp_path)
    for where in dict.fromkeys(("cpu", device)):  # the CPU reference, then the device under test
        dims = tpzoo.init_parallel(device=where)
        try:
            trainer = Trainer(_config(where, base=base), dims)
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


@pytest.mark.cuda  # CPU twin: tests/test_ring_attention.py (the same cases over emulated kernels)
@pytest.mark.parametrize("kernel,dtype,tol", [("cuda_flash", torch.bfloat16, 2e-2),
                                              ("cuda_efficient", torch.float32, 1e-4)])
def test_ring_attention_cuda_blocks_equal_sdpa(kernel, dtype, tol):
    from test_ring_attention import one_process_case

    for case in [(4, 4, 2, 256, None), (4, 4, 2, 256, 40)]:  # (cp, heads, kv heads, tokens, window)
        assert one_process_case(kernel, *case, dtype=dtype, device="cuda", head_dim=64) < tol, (kernel, case)


@pytest.mark.cuda  # CPU twin: tests/test_moe_experts.py (grouped vs loop over the reference grouped op)
def test_grouped_expert_gemms_equal_the_loop_on_hopper():
    if torch.cuda.get_device_capability() < (9, 0):
        pytest.skip("torch._grouped_mm needs compute capability 9.0+")
    from test_moe_experts import CFG, _batch, _loss_and_grads, _uneven

    from tpzoo.models import ModelLayout, Transformer
    from tpzoo.models.kinds.experts import use_grouped

    dims = tpzoo.init_parallel(device="cuda")
    try:
        cfg = CFG.replace(hidden_size=64, ffn_hidden_size=64)  # GEMM dims multiples of 8
        model = _uneven(Transformer(cfg, ModelLayout(dims, dtype=torch.bfloat16), seed=3))
        mlp = model.layers["0"].mlp
        assert use_grouped("auto", torch.zeros(1, 64, dtype=torch.bfloat16, device="cuda"), mlp.gate_up, mlp.down)
        ids, labels = (t.cuda() for t in _batch())
        loss_l, grads_l, _ = _loss_and_grads(model, ids, labels, "loop")
        loss_g, grads_g, _ = _loss_and_grads(model, ids, labels, "grouped")
        torch.testing.assert_close(loss_g.float(), loss_l.float(), rtol=2e-2, atol=2e-2)
        for name in grads_l:
            ref = grads_l[name].float()
            rel = float((grads_g[name].float() - ref).norm() / ref.norm().clamp_min(1e-12))
            assert rel < 2e-2, (name, rel)
    finally:
        tpzoo.destroy_parallel()
