"""The plan advisor with context parallelism: the search proposes cp for a 128K-token sequence, the
activation memory per rank shrinks by cp, ring transfers count as communication only beyond the attention they
overlap, and bad cp layouts are refused. (The ring's p2p volume formula is checked against the counted sends in
tests/test_ring_attention.py; the measured memory per rank in docs/benchmarks.md.)"""
import pytest

from tpzoo.models import get_config
from tpzoo.parallel import ParallelLayoutError
from tpzoo.plan import ClusterSpec, Layout, TrainingSpec, check_layout, estimate, local_vocab, search

CFG = get_config("llama-3-8b")
H100x8 = ClusterSpec(gpus=8, gpu_memory_gib=80)
LONG = TrainingSpec(seq_len=131072, global_batch_size=8)


def test_search_proposes_cp_for_a_long_sequence():
    ests = search(CFG, H100x8, LONG, recompute="full")
    best_cp1 = next(e for e in ests if e.fits and e.layout.cp == 1)
    assert ests[0].fits and ests[0].layout.cp > 1 and ests[0].time.total < best_cp1.time.total
    short = search(CFG, H100x8, TrainingSpec(seq_len=8192, global_batch_size=128), recompute="full")
    assert {e.layout.cp for e in short} == {1}  # cp is searched for long sequences only


def test_activations_per_rank_shrink_by_cp_and_states_shard_over_dp_x_cp():
    lay = dict(tp=2, pp=1, micro_batch_size=1, recompute="full", sequence_parallel=True)
    zero = TrainingSpec(seq_len=131072, global_batch_size=8, zero=1)
    one, four = (estimate(CFG, Layout(**lay, dp=4 // cp, cp=cp), H100x8, zero) for cp in (1, 4))
    # every activation is per token but the fused head's fp32 weight gradient (plan/head.py), one per rank
    fixed = 4 * local_vocab(CFG, 2) * CFG.hidden_size
    assert four.memory.activations - fixed == pytest.approx((one.memory.activations - fixed) / 4, rel=0.01)
    assert four.memory.optimizer == one.memory.optimizer  # ZeRO-1 shards over dp x cp = 4 in both


def test_ring_transfers_are_exposed_only_when_slower_than_the_attention():
    lay = Layout(tp=1, cp=8, dp=1, micro_batch_size=1, recompute="full")
    fast = estimate(CFG, lay, H100x8, LONG)
    slow = estimate(CFG, lay, ClusterSpec(gpus=8, gpu_memory_gib=80, intra_node_gbps=0.5), LONG)
    assert fast.time.cp_comm < 0.01 * fast.time.total  # 128K tokens: a block's attention hides its K/V transfer
    assert slow.time.cp_comm > 10 * fast.time.cp_comm


@pytest.mark.parametrize("layout,says", [
    (Layout(tp=2, cp=2, dp=2), None),
    (Layout(tp=2, cp=8, dp=1), "!= 8 GPUs"),
    (Layout(tp=2, cp=4, dp=1, sequence_parallel=True), None),
])
def test_cp_layouts_are_checked(layout, says):
    run = TrainingSpec(seq_len=24, global_batch_size=8)  # 24 = 2 * cp * 6 at cp=2; not a multiple of 16 at cp=4
    if layout.cp == 4:
        with pytest.raises(ParallelLayoutError, match=r"cp=4: seq_len=24 is not a multiple of 2\*cp\*tp = 16"):
            check_layout(CFG, layout, H100x8, run)
    elif says:
        with pytest.raises(ParallelLayoutError, match=says):
            check_layout(CFG, layout, H100x8, run)
    else:
        check_layout(CFG, layout, H100x8, run)
