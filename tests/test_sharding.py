"""ShardSpec: plain splits, fused parts and replicated heads map full tensors to shards and back exactly."""
import pytest
import torch

from tpzoo.parallel import ParallelLayoutError, ShardSpec, shard, unshard


def _round_trip(full, spec, tp):
    shards = [shard(full, spec, r, tp) for r in range(tp)]
    assert all(s.shape[spec.dim] == spec.local_size(full.shape[spec.dim], tp) for s in shards)
    torch.testing.assert_close(unshard(shards, spec), full, rtol=0, atol=0)
    return shards


def test_plain_split_is_contiguous_rows():
    full = torch.arange(24.0).view(8, 3)
    shards = _round_trip(full, ShardSpec(0), 4)
    torch.testing.assert_close(shards[1], full[2:4])
    shards = _round_trip(full.t().contiguous(), ShardSpec(1), 4)
    torch.testing.assert_close(shards[3], full.t()[:, 6:8])


def test_fused_parts_are_split_separately():
    gate, up = torch.arange(8.0).view(4, 2), 100 + torch.arange(8.0).view(4, 2)
    full = torch.cat([gate, up])
    shards = _round_trip(full, ShardSpec(0, parts=(4, 4)), 2)
    torch.testing.assert_close(shards[1], torch.cat([gate[2:], up[2:]]))  # rank 1: its gate half, its up half


def test_replicated_kv_heads():
    hd, nq, nkv, tp = 2, 4, 1, 4  # one kv head shared by all 4 ranks
    q = torch.arange(nq * hd * 1.0).view(nq * hd, 1)
    k, v = 100 + torch.arange(hd * 1.0).view(hd, 1), 200 + torch.arange(hd * 1.0).view(hd, 1)
    spec = ShardSpec(0, parts=(nq * hd, nkv * hd, nkv * hd), replicas=(1, tp, tp), block=hd)
    shards = _round_trip(torch.cat([q, k, v]), spec, tp)
    for r, s in enumerate(shards):
        torch.testing.assert_close(s, torch.cat([q[r * hd:(r + 1) * hd], k, v]))
    # partial gradients on the copies sum to the gradient of the shared head
    grads = [torch.full_like(s, float(r + 1)) for r, s in enumerate(shards)]
    summed = unshard(grads, spec, reduce="sum")
    torch.testing.assert_close(summed[nq * hd:], torch.full((2 * hd, 1), 10.0))


def test_indivisible_part_is_a_layout_error():
    with pytest.raises(ParallelLayoutError, match="not divisible by tp=4"):
        shard(torch.zeros(6, 2), ShardSpec(0), 0, 4)
