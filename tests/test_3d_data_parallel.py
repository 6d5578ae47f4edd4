"""Data-parallel gradient reduction: buckets, fp32 reduction of low-precision gradients, the dp group."""
import torch
import torch.nn as nn

import tpzoo
from tpzoo.parallel import count_collectives, get_dp_rank
from tpzoo.parallel.data_parallel import allreduce_gradients, grad_buckets
from tpzoo.testing import run_on_ranks


def test_buckets_follow_parameter_order_and_size():
    params = [nn.Parameter(torch.zeros(n)) for n in (100, 200, 300, 50, 1000)]
    for p in params:
        p.grad = torch.zeros_like(p)
    params[3].grad = None  # no gradient: not reduced
    limit_mb = 400 * 4 / 2**20  # 400 fp32 elements
    sizes = [[p.numel() for p in b] for b in grad_buckets(params, limit_mb)]
    assert sizes == [[100, 200], [300], [1000]]  # a parameter larger than a bucket gets one of its own


def _reduce(bucket_mb: float, dtype: torch.dtype):
    tpzoo.init_parallel(tp=2)  # 4 ranks: tp=2, dp=2, so the dp group is not the world
    try:
        rank = get_dp_rank()
        params = [nn.Parameter(torch.zeros(n, dtype=dtype)) for n in (3, 5, 7)]
        for i, p in enumerate(params):
            p.grad = torch.full_like(p, float(rank + 1) * (i + 1))
        with count_collectives() as c:
            buckets = allreduce_gradients(params, bucket_mb=bucket_mb)
        return buckets, c.get("all_reduce", "dp").calls, [p.grad.tolist() for p in params]
    finally:
        tpzoo.destroy_parallel()


def test_allreduce_sums_over_the_dp_group_in_buckets():
    for bucket_mb, expected_buckets in ((25.0, 1), (8 * 4 / 2**20, 2)):
        for buckets, calls, grads in run_on_ranks(4, _reduce, bucket_mb, torch.float32):
            assert buckets == calls == expected_buckets
            assert grads == [[3.0 * (i + 1)] * n for i, n in enumerate((3, 5, 7))]  # (1 + 2) * (i + 1)


def _bf16_sum():
    tpzoo.init_parallel(dp=4)
    try:
        # 1 + 3 * 2^-9: summed in bf16 from rank 0 on (8 significant bits), every partial sum rounds back to 1.
        g = torch.tensor([1.0 if get_dp_rank() == 0 else 2.0**-9], dtype=torch.bfloat16)
        p = nn.Parameter(torch.zeros(1, dtype=torch.bfloat16))
        p.grad = g
        allreduce_gradients([p])
        return p.grad.dtype, float(p.grad)
    finally:
        tpzoo.destroy_parallel()


def test_low_precision_gradients_are_summed_in_fp32():
    expected = float(torch.tensor(1 + 3 * 2.0**-9).to(torch.bfloat16))  # fp32 sum, rounded once: 1 + 2^-7
    assert expected > 1.0
    assert run_on_ranks(4, _bf16_sum) == [(torch.bfloat16, expected)] * 4
