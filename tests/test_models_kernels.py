"""The zoo's models give the same loss and gradients with the fused kernels forced on (Triton's interpreter on
CPU) and off (torch references), at tp=2 with sequence parallelism. The 2024-25 families run their (1 + w) and
per-head q/k RMSNorms through the RMSNorm kernel and Gemma's GeGLU through the SwiGLU kernel pair; OLMo 2's
full-width q/k norm stays on the torch path (docs/kernels.md)."""
import pytest
import torch

import tpzoo
from tpzoo import kernels as K
from tpzoo.models import Inputs, ModelLayout, Transformer, get_config
from tpzoo.testing import run_on_ranks


def _loss_and_grads(cfg, backend, ids, labels):
    torch.manual_seed(0)
    model = Transformer(cfg, ModelLayout(sequence_parallel=True), seed=3)
    with K.use_backend(backend):
        per_token = model(Inputs(ids, labels=labels))
        loss = per_token.sum() / (labels != -100).sum()
        loss.backward()
    tpzoo.parallel.finish_tp_grads(model)
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


_NANO = get_config("nano-llama")
NEW = [  # Gemma 3's switches: (1 + w) norms before and after each sublayer, per-head (1 + w) q/k norms, one
    # sliding and one full layer with their own rope tables (Qwen3's q/k norms and OLMo 2's post-norms are the same
    # kernel calls)
    _NANO.replace(family="gemma3", activation="geglu_tanh", qk_norm="head", head_dim=16, post_norm=True,
                  norm_offset=True, embed_scale=True, tie_embeddings=True, attn_scale=24, sliding_window=4,
                  layer_types=["sliding_attention", "full_attention"], rope_local_theta=1e4, name="nano-gemma3"),
]


def _compare_backends(name):
    tpzoo.init_parallel(tp=2)
    cfg = get_config(name) if isinstance(name, str) else name
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, cfg.vocab_size, (2, 12), generator=g)
    labels = ids.roll(-1, dims=1)
    labels[:, -1] = -100
    ref_loss, ref_grads = _loss_and_grads(cfg, "torch", ids, labels)
    used, load = set(), K.dispatch.load
    K.dispatch.load = lambda module, *ts: used.add(module) or load(module, *ts)
    try:
        loss, grads = _loss_and_grads(cfg, "triton", ids, labels)
    finally:
        K.dispatch.load = load
    # the Triton path really ran for every kernel this family uses (no silent fallback to the reference)
    norms = "rms" if cfg.norm == "rmsnorm" else "norms"  # RMSNorm's own kernels (kernels/rms.py)
    expected = {norms, "activations", "vocab_cross_entropy"} | ({"rotary"} if cfg.position == "rope" else set())
    assert used == expected, used
    torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-5)
    for n in ref_grads:
        torch.testing.assert_close(grads[n], ref_grads[n], rtol=1e-4, atol=1e-5, msg=n)
    return float(loss)


@pytest.mark.parametrize("name", ["nano-gpt", "nano-llama", *NEW], ids=lambda c: c if isinstance(c, str) else c.name)
def test_model_loss_and_grads_same_with_kernels_on_and_off(name):
    losses = run_on_ranks(2, _compare_backends, name, pool_env={"TRITON_INTERPRET": "1"})
    assert losses[0] == losses[1]
