"""Main gradients and the one data-parallel reduction (GradBuffer): fp32 accumulation of 16-bit gradients, no
16-bit .grad kept, the sum over the dp group in buckets or reduce-scattered, exact in fp32."""
import torch
import torch.nn as nn

import tpzoo
from tpzoo.parallel import GradBuffer, count_collectives
from tpzoo.testing import run_on_ranks


def test_gradients_accumulate_in_fp32_main_grads_and_no_16bit_grad_is_kept():
    w = nn.Parameter(torch.ones(4, dtype=torch.bfloat16))
    unused = nn.Parameter(torch.ones(3, dtype=torch.bfloat16))
    buf = GradBuffer([w, unused, w], device="cpu", pad_to=4)  # a parameter listed twice is held once
    assert (buf.numel, buf.padded, buf.data.dtype) == (7, 8, torch.float32)
    small = 2.0 ** -9  # below bf16's resolution next to 1: a bf16 running sum would drop every one
    (w * 1.0).sum().backward()
    for _ in range(64):
        (w * small).sum().backward()
        assert w.grad is None  # moved into main_grad as soon as autograd produced it
    assert torch.equal(w.main_grad, torch.full((4,), 1 + 64 * small))
    assert torch.equal(unused.main_grad, torch.zeros(3))
    buf.zero()
    assert float(buf.data.abs().sum()) == 0.0
    buf.remove()
    (w * 2.0).sum().backward()
    assert not hasattr(w, "main_grad") and torch.equal(w.grad, torch.full((4,), 2.0, dtype=torch.bfloat16))


def _reduce(bucket_elems: int, shard: bool):
    dims = tpzoo.init_parallel(tp=2)  # 4 ranks: tp=2, dp=2, so the dp group is not the world
    try:
        params = [nn.Parameter(torch.zeros(n)) for n in (3, 5, 7)]
        buf = GradBuffer(params, device=dims.device, pad_to=dims.dp, bucket_elems=bucket_elems)
        for i, p in enumerate(params):
            (p * float(dims.dp_rank + 1) * (i + 1)).sum().backward()
        with count_collectives() as c:
            out = buf.reduce(dims.grad_group, shard=shard)
        kind = "reduce_scatter" if shard else "all_reduce"
        return dims.dp_rank, c.get(kind, "dp_cp").calls, out.tolist(), [p.main_grad.tolist() for p in params]
    finally:
        tpzoo.destroy_parallel()


def test_reduction_sums_over_the_dp_group_in_buckets_or_shards():
    expected = [3.0 * (i + 1) for i, n in enumerate((3, 5, 7)) for _ in range(n)] + [0.0]  # (1 + 2) * (i + 1)
    for bucket_elems, calls in ((1 << 20, 1), (8, 2)):
        for _, n_calls, out, main in run_on_ranks(4, _reduce, bucket_elems, False):
            assert n_calls == calls and out == expected
            assert main == [[3.0 * (i + 1)] * n for i, n in enumerate((3, 5, 7))]
    for dp_rank, n_calls, out, _ in run_on_ranks(4, _reduce, 1 << 20, True):
        assert n_calls == 1 and out == expected[dp_rank * 8:(dp_rank + 1) * 8]  # ZeRO-1: this rank's half


def _bf16_sum():
    dims = tpzoo.init_parallel(dp=4)
    try:
        # 1 + 3 * 2^-9: summed in bf16 from rank 0 on (8 significant bits), every partial sum rounds back to 1.
        p = nn.Parameter(torch.zeros(1, dtype=torch.bfloat16))
        buf = GradBuffer([p], device=dims.device)
        (p * (1.0 if dims.dp_rank == 0 else 2.0 ** -9)).sum().backward()
        buf.reduce(dims.grad_group)
        return p.main_grad.dtype, float(p.main_grad)
    finally:
        tpzoo.destroy_parallel()


def test_low_precision_gradients_are_summed_in_fp32():
    assert run_on_ranks(4, _bf16_sum) == [(torch.float32, 1 + 3 * 2.0 ** -9)] * 4
