"""Megatron-style mixed precision: bf16 weights, micro-batch gradients accumulated straight into fp32 main
gradients (the trainer's optimizer and executor), 18 bytes per parameter in bf16 without ZeRO-1."""
import torch

from tpzoo.models import Inputs, Transformer, get_config
from tpzoo.parallel import local_dims
from tpzoo.pipeline import forward_backward
from tpzoo.train.optim import DistributedAdamW

CFG = get_config("nano-llama")
MICRO, B, S = 64, 2, 16


def _microbatches():
    g = torch.Generator().manual_seed(3)
    out = []
    for _ in range(MICRO):
        ids = torch.randint(0, CFG.vocab_size, (B, S), generator=g)
        out.append({"input_ids": ids, "labels": torch.roll(ids, -1, dims=1)})
    return out


def _sum_of_microbatch_grads(model, mbs, scale, accumulate_dtype):
    """Each micro-batch's bf16 gradient (the very ops the executor runs), summed in `accumulate_dtype`."""
    params = list(model.parameters())
    total = [torch.zeros_like(p, dtype=accumulate_dtype) for p in params]
    for mb in mbs:
        grads = torch.autograd.grad(model(Inputs(mb["input_ids"], labels=mb["labels"])).sum() * scale, params)
        for t, g in zip(total, grads):
            t.add_(g.to(accumulate_dtype))
    return {n: t.double() for (n, _), t in zip(model.named_parameters(), total)}


def test_64_bf16_microbatches_accumulate_like_the_fp32_sum():
    dims = local_dims()
    mbs = _microbatches()
    scale = 1.0 / (MICRO * B * S)
    model = Transformer(CFG, dims, seed=5)
    opt = DistributedAdamW(list(model.parameters()), dims, model_dtype=torch.bfloat16)
    assert all(p.dtype == torch.bfloat16 for p in model.parameters())
    opt.zero_grad()
    forward_backward([model], mbs, dims, loss_scale=scale)
    assert all(p.grad is None for p in model.parameters())  # no 16-bit gradient kept between micro-batches
    got = {n: p.main_grad.double() for n, p in model.named_parameters()}

    reference = Transformer(CFG, dims, seed=5)
    for p in reference.parameters():  # bf16 weights; the rotary frequencies stay fp32, as in the trainer
        p.data = p.data.to(torch.bfloat16)
    want = _sum_of_microbatch_grads(reference, mbs, scale, torch.float64)
    naive = _sum_of_microbatch_grads(reference, mbs, scale, torch.bfloat16)  # what 16-bit .grad accumulation does
    worst_main, worst_naive = 0.0, 0.0
    for n, w in want.items():
        rel = lambda x: float((x - w).abs().max()) / max(float(w.abs().max()), 1e-30)  # noqa: E731
        worst_main, worst_naive = max(worst_main, rel(got[n])), max(worst_naive, rel(naive[n]))
    assert worst_main < 1e-6, worst_main  # fp32 accumulation: fp32 rounding only
    assert worst_naive > 1e-3, worst_naive  # the test can tell: bf16 accumulation drifts by far more


def test_bf16_training_state_is_18_bytes_per_parameter():
    dims = local_dims()
    model = Transformer(CFG, dims)
    n = sum(p.numel() for p in model.parameters())
    for dtype, per_param in ((torch.bfloat16, 18), (torch.float32, 16)):
        opt = DistributedAdamW(list(Transformer(CFG, dims).parameters()), dims, model_dtype=dtype)
        assert sum(opt.buffer_bytes().values()) == per_param * n
