"""Rank layout (ParallelDims), group membership, the device choice, bad layouts and the multi-rank harness's
failure behaviour."""
import time

import pytest
import torch
import torch.distributed as dist

import tpzoo
from tpzoo.parallel import SELF_GROUP, ParallelDims, resolve_device
from tpzoo.parallel import state as ps
from tpzoo.parallel.dims import ParallelLayoutError, check_layout
from tpzoo.testing import RankFailure, run_on_ranks


def test_check_layout_infers_dp_and_names_the_numbers():
    assert check_layout(8, tp=2, pp=2) == 2
    assert check_layout(4, tp=4) == 1
    with pytest.raises(ParallelLayoutError, match=r"world size 6 is not divisible by tp\*pp\*cp = 4\*1\*1 = 4"):
        check_layout(6, tp=4)
    with pytest.raises(ParallelLayoutError, match=r"does not equal world size 8"):
        check_layout(8, tp=2, dp=2)
    with pytest.raises(ParallelLayoutError, match="tp must be a positive integer"):
        check_layout(8, tp=0)


def test_single_process_init_without_torchrun():
    st = tpzoo.init_parallel()
    try:
        assert (st.tp, st.pp, st.dp, st.world_size) == (1, 1, 1, 1)
        assert st.device == torch.device("cpu")  # no CUDA here: auto picks the CPU
        assert ps.get_dims() is st and ps.get_tp_size() == 1 and st.is_first_stage and st.is_last_stage
        assert st.tp_group is SELF_GROUP  # a group of one never communicates
    finally:
        tpzoo.destroy_parallel()
    assert not dist.is_initialized()
    assert ps.get_dims().world_size == 1 and ps.get_dims().device == torch.device("cpu")  # the default again


def test_device_choice_is_explicit_and_checked():
    assert resolve_device(None) == resolve_device("auto") == torch.device("cpu")
    assert resolve_device("cpu") == torch.device("cpu")
    with pytest.raises(ValueError, match="CUDA is not available"):
        resolve_device("cuda")
    with pytest.raises(ValueError, match="expected auto, cpu, cuda"):
        resolve_device("gpu0")


def test_virtual_dims_describe_one_rank_without_groups():
    d = ParallelDims.for_rank(tp=4, pp=2, dp=2, tp_rank=3, pp_rank=1, dp_rank=1)
    assert (d.tp_rank, d.pp_rank, d.dp_rank, d.rank, d.world_size) == (3, 1, 1, 3 + 4 * (1 + 2 * 1), 16)
    assert d.ranks("tp") == [12, 13, 14, 15] and d.ranks("embedding") == [7, 15] and d.device.type == "meta"
    assert d.dp_cp_rank == 1 and d.is_last_stage and not d.is_first_stage
    with pytest.raises(RuntimeError, match="no process groups"):
        d.tp_group
    assert ParallelDims.for_rank(tp=1, dp=2).tp_group is SELF_GROUP
    with pytest.raises(ParallelLayoutError, match="tp rank 4 is outside a tp size of 4"):
        ParallelDims.for_rank(tp=4, tp_rank=4)


def _layout_of_rank(tp, pp, dp):
    st = tpzoo.init_parallel(tp=tp, pp=pp)
    return {
        "coords": st.coords(),
        "tp": st.ranks("tp"), "dp": st.ranks("dp"), "pp": st.ranks("pp"), "embedding": st.ranks("embedding"),
        "next": st.pp_peer(st.pp_rank + 1), "prev": st.pp_peer(st.pp_rank - 1),
        "sizes": (st.tp, st.dp, st.pp), "virtual": ParallelDims.for_rank(tp, pp, dp=st.dp, **{
            f"{k}_rank": v for k, v in st.coords().items()}).ranks("embedding"),
    }


def test_megatron_rank_order_tp_fastest_then_dp_then_pp():
    out = run_on_ranks(8, _layout_of_rank, 2, 2, None)
    # rank = tp + 2*(dp + 2*pp)
    for rank, o in enumerate(out):
        c = o["coords"]
        assert rank == c["tp"] + 2 * (c["dp"] + 2 * c["pp"])
        assert o["sizes"] == (2, 2, 2)
    assert out[0]["tp"] == [0, 1] and out[5]["tp"] == [4, 5]
    assert out[0]["dp"] == [0, 2] and out[5]["dp"] == [5, 7]
    assert out[0]["pp"] == [0, 4] and out[3]["pp"] == [3, 7]
    assert out[0]["embedding"] == [0, 4]
    assert out[0]["next"] == 4 and out[4]["prev"] == 0
    assert all(o["virtual"] == o["embedding"] for o in out)  # a virtual rank has the real one's groups


def _init_bad_layout():
    try:
        tpzoo.init_parallel(tp=3)
    except ParallelLayoutError as e:
        return str(e)
    return None


def test_bad_world_size_fails_on_every_rank_before_any_collective():
    msgs = run_on_ranks(4, _init_bad_layout, timeout=30)
    assert all(m and "world size 4 is not divisible by tp*pp*cp = 3*1*1 = 3" in m for m in msgs)


def _one_rank_raises():
    if dist.get_rank() == 1:
        raise RuntimeError("boom on rank one")
    t = torch.ones(1)
    dist.all_reduce(t)  # rank 1 never joins: would hang forever without the harness's bound
    return t.item()


def test_failing_rank_reports_its_traceback_and_never_hangs():
    start = time.monotonic()
    with pytest.raises(RankFailure) as info:
        run_on_ranks(2, _one_rank_raises, timeout=60)
    assert "rank 1" in str(info.value) and "boom on rank one" in str(info.value)
    assert time.monotonic() - start < 30  # bounded by the harness's grace period, not the 60 s timeout
    # the pool is rebuilt for the next call
    assert run_on_ranks(2, _layout_of_rank, 2, 1, None)[1]["coords"]["tp"] == 1
