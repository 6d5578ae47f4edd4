"""Pipeline machinery: layer partitioning, model chunks, schedule orders (checked by simulation: complete,
deadlock free, bubble and memory as the papers say), and the schedules' behaviour on 4 gloo ranks."""
import pytest
import torch

import tpzoo
from tpzoo.models import Inputs, ModelLayout, Stage, Transformer, get_config
from tpzoo.parallel import ParallelDims, count_collectives, gather_tp_param, get_pp_rank
from tpzoo.pipeline import (PartitionError, ScheduleError, SCHEDULES, build_model_chunks, bubble_fractions,
                            forward_backward, partition_layers, peak_inflight, plan, simulate, validate)
from tpzoo.pipeline.weight_grad import backward_input
from tpzoo.testing import run_on_ranks

LLAMA8 = get_config("nano-llama").replace(num_layers=8)


# -- partitioning -----------------------------------------------------------------------------------------------
def test_partition_balances_parameters_and_counts_the_embedding_and_head():
    assert partition_layers(LLAMA8, 2) == [(0, 4), (4, 8)]  # small vocabulary: plain halves
    # GPT-2: the 38.6M-parameter embedding weighs five layers, so the end stages get fewer layers.
    ranges = partition_layers(get_config("gpt2"), 4)
    sizes = [end - start for start, end in ranges]
    assert sum(sizes) == 12 and ranges[0][0] == 0 and ranges[-1][1] == 12
    assert sizes[0] < sizes[1] and sizes[-1] < sizes[1], sizes
    assert all(a[1] == b[0] for a, b in zip(ranges, ranges[1:]))


def _splits(n: int, stages: int):
    """Every split of n layers into `stages` non-empty contiguous ranges (their counts)."""
    if stages == 1:
        yield (n,)
        return
    for first in range(1, n - stages + 2):
        for rest in _splits(n - first, stages - 1):
            yield (first,) + rest


def test_partition_weighs_each_layer_by_its_kinds():
    """Dense-first mixtures of experts (DeepSeek-V3's first_k_dense_replace, Qwen3-MoE's mlp_only_layers): an MoE
    layer holds many times a dense one's parameters, so the split is the contiguous one whose fullest stage is
    smallest (brute force over every split), its stage parameters the real model's, and not the count-even one;
    other weights (the plan's time per layer) split by those."""
    from tpzoo.pipeline.partition import layer_parameters

    cfg = get_config("nano-mixtral").replace(num_layers=8, mlp_only_layers=[0, 1, 2])
    per_layer = layer_parameters(cfg)
    built = [sum(p.numel() for p in Transformer(cfg, ModelLayout(device="meta"), Stage(range(i, i + 1), False,
                                                                                          False)).parameters())
             for i in range(cfg.num_layers)]
    assert per_layer == built and per_layer[0] < per_layer[3] / 2
    embed, head = cfg.vocab_size * cfg.hidden_size, cfg.vocab_size * cfg.hidden_size + cfg.hidden_size
    for pp in (2, 3, 4):
        ranges = partition_layers(cfg, pp)
        assert ranges[0][0] == 0 and ranges[-1][1] == 8 and all(a[1] == b[0] for a, b in zip(ranges, ranges[1:]))

        def fullest(counts):
            ends = [sum(counts[:k + 1]) for k in range(pp)]
            return max(sum(per_layer[e - c:e]) + (embed if k == 0 else 0) + (head if k == pp - 1 else 0)
                       for k, (c, e) in enumerate(zip(counts, ends)))
        best = min(fullest(c) for c in _splits(8, pp))
        assert fullest([b - a for a, b in ranges]) == best, (pp, ranges)
        even = [8 // pp + (k < 8 % pp) for k in range(pp)]
        assert fullest(even) > best, pp  # the count-even split holds more on its fullest stage
    # the same layers at equal weights: water-filling (ends weighing nothing), e.g. 3 + 3 + 2 at pp 3
    assert partition_layers(cfg, 3, weights=[1] * 8, ends=(0, 0)) == [(0, 3), (3, 6), (6, 8)]
    assert partition_layers(cfg, 2, weights=[5, 5, 5, 1, 1, 1, 1, 1], ends=(0, 0)) == [(0, 2), (2, 8)]


def test_partition_explicit_boundaries_and_errors():
    assert partition_layers(LLAMA8, 2, boundaries=[0, 3, 8]) == [(0, 3), (3, 8)]
    assert partition_layers(LLAMA8, 2, virtual_stages=2) == [(0, 2), (2, 4), (4, 6), (6, 8)]
    with pytest.raises(PartitionError, match="stage 1 would be empty"):
        partition_layers(LLAMA8, 3, boundaries=[0, 3, 3, 8])
    with pytest.raises(PartitionError, match="must have 3 entries"):
        partition_layers(LLAMA8, 2, boundaries=[0, 8])
    with pytest.raises(PartitionError, match="start at 0 and end at num_layers=8"):
        partition_layers(LLAMA8, 2, boundaries=[0, 4, 7])
    with pytest.raises(PartitionError, match="2 layers cannot fill 4 pipeline stages"):
        partition_layers(get_config("nano-llama"), 2, virtual_stages=2)
    with pytest.raises(PartitionError, match="3 layer weights for 8 layers"):
        partition_layers(LLAMA8, 2, weights=[1, 2, 3])


def test_model_chunks_follow_megatrons_interleaved_order():
    # Chunk c of rank r is model stage c*pp + r; built on the meta device for a virtual rank: no process group.
    for rank in range(2):
        chunks = build_model_chunks(LLAMA8, ParallelDims.for_rank(pp=2, pp_rank=rank), virtual_stages=2)
        assert all(p.device.type == "meta" for c in chunks for p in c.parameters())  # virtual dims: meta
        assert [(c.stage.layers.start, c.stage.layers.stop) for c in chunks] == (
            [(0, 2), (4, 6)] if rank == 0 else [(2, 4), (6, 8)])
        assert [c.pre_process for c in chunks] == [rank == 0, False]
        assert [c.post_process for c in chunks] == [False, rank == 1]
        assert sorted(chunks[0].state_dict())[0].startswith("embed" if rank == 0 else "layers")


# -- schedule orders (pure Python) ------------------------------------------------------------------------------
@pytest.mark.parametrize("schedule", sorted(SCHEDULES))
def test_schedules_are_complete_and_deadlock_free(schedule):
    for p in (2, 3, 4, 8):
        for m in range(1, 3 * p + 1):
            v = 2 if schedule == "interleaved" else 1
            if schedule == "interleaved" and m % p:
                with pytest.raises(ScheduleError, match="multiple of the pipeline size"):
                    plan(schedule, 0, p, m, v)
                continue
            acts = [plan(schedule, r, p, m, v) for r in range(p)]
            validate(acts, p, v, m)
            simulate(acts, p, v)  # raises if the ranks would wait on each other forever


def test_simulated_bubbles_match_theory():
    p, m = 4, 8
    unit = {s: bubble_fractions(simulate([plan(s, r, p, m, 1) for r in range(p)], p, 1)) for s in ("gpipe", "1f1b")}
    for s in ("gpipe", "1f1b"):
        assert unit[s] == pytest.approx([(p - 1) / m] * p)
    v = 2  # a chunk costs 1/v of a stage
    inter = simulate([plan("interleaved", r, p, m, v) for r in range(p)], p, v, {"F": 1 / v, "B": 2 / v, "W": 0})
    assert bubble_fractions(inter) == pytest.approx([(p - 1) / (m * v)] * p)
    # ZB-H1 with T_F = T_B = T_W: bubble (p-1)(T_F + T_B - T_W) over m(T_F + T_B + T_W) of work, a third of 1F1B.
    zb = bubble_fractions(simulate([plan("zb", r, p, m, 1) for r in range(p)], p, 1))
    assert zb == pytest.approx([(p - 1) / (3 * m)] * p)


def test_inflight_activations_per_schedule():
    p, m = 4, 8
    assert [peak_inflight(plan("1f1b", r, p, m, 1)) for r in range(p)] == [4, 3, 2, 1]
    assert [peak_inflight(plan("gpipe", r, p, m, 1)) for r in range(p)] == [m] * p
    assert max(peak_inflight(plan("zb", r, p, m, 1)) for r in range(p)) == p  # as much as 1F1B's first stage


def test_one_stage_is_a_plain_loop_and_chunks_need_interleaving():
    for s in SCHEDULES:
        assert [repr(a) for a in plan(s, 0, 1, 2, 1)] == ["F0", "B0", "F1", "B1"]
    with pytest.raises(ScheduleError, match="virtual_stages=1 or use schedule='interleaved'"):
        plan("1f1b", 0, 2, 4, 2)
    with pytest.raises(ValueError, match="unknown schedule"):
        plan("pipedream", 0, 2, 4, 1)


# -- on 4 ranks -------------------------------------------------------------------------------------------------
def _schedules_on_four_ranks(m: int):
    cfg = LLAMA8
    g = torch.Generator().manual_seed(0)
    mbs = [{"input_ids": torch.randint(0, cfg.vocab_size, (1, 8), generator=g)} for _ in range(m)]
    for mb in mbs:
        mb["labels"] = torch.roll(mb["input_ids"], -1, dims=1)
    out = {}
    tpzoo.init_parallel(pp=4)
    try:
        for schedule in sorted(SCHEDULES):
            chunks = build_model_chunks(cfg, virtual_stages=2 if schedule == "interleaved" else 1)
            res = forward_backward(chunks, mbs, schedule=schedule, loss_scale=0.01)
            grad_norm = sum(float(p.grad.double().square().sum()) for c in chunks for p in c.parameters())
            kinds = [e[0] for e in res["timeline"]]
            out[schedule] = {"loss_sum": res["loss_sum"], "peak": res["peak_inflight"], "tokens": res["tokens"],
                             "counts": {k: kinds.count(k) for k in "FBW"}, "grad_norm": grad_norm,
                             "ordered": all(a[3] <= b[2] for a, b in zip(res["timeline"], res["timeline"][1:]))}
            for c in chunks:
                c.zero_grad(set_to_none=True)
            evaluation = forward_backward(chunks, mbs, schedule=schedule, forward_only=True)
            out[schedule]["eval"] = (evaluation["loss_sum"], evaluation["peak_inflight"],
                                     any(p.grad is not None for c in chunks for p in c.parameters()))
        return get_pp_rank(), out
    finally:
        tpzoo.destroy_parallel()


def test_schedules_on_four_ranks_memory_timeline_and_loss():
    p, m = 4, 8
    results = dict(run_on_ranks(4, _schedules_on_four_ranks, m))
    first = results[0]
    assert first["1f1b"]["peak"] == p  # 1F1B: at most p micro-batches alive on the first stage
    assert first["gpipe"]["peak"] == m  # GPipe: all of them
    assert first["zb"]["peak"] <= p
    ref_loss = results[p - 1]["1f1b"]["loss_sum"]
    for rank, res in results.items():
        for schedule, r in res.items():
            v = 2 if schedule == "interleaved" else 1
            assert r["counts"] == {"F": m * v, "B": m * v, "W": m if schedule == "zb" else 0}, (rank, schedule)
            assert r["ordered"] and r["tokens"] == m * 8
            # the same loss on every pipeline rank (broadcast from the last stage) and for every schedule
            assert r["loss_sum"] == pytest.approx(ref_loss, rel=1e-6), (rank, schedule)
            assert r["eval"] == (pytest.approx(ref_loss, rel=1e-6), 0, False), (rank, schedule)
    # every schedule accumulates the same gradients (per-rank norms; the chunks differ only for interleaving)
    for rank, res in results.items():
        assert res["gpipe"]["grad_norm"] == pytest.approx(res["1f1b"]["grad_norm"], rel=1e-5)
        assert res["zb"]["grad_norm"] == pytest.approx(res["1f1b"]["grad_norm"], rel=1e-5)


# -- zero-bubble's split backward -------------------------------------------------------------------------------
def _split_backward_matches_full(tp: int):
    tpzoo.init_parallel(tp=tp)
    try:
        cfg = get_config("nano-gpt").replace(num_layers=2)  # biases, LayerNorm, learned positions, tied head
        stage = Transformer(cfg, ModelLayout(sequence_parallel=tp > 1), Stage(pre_process=False))
        params = [p for p in stage.parameters()]
        x0 = torch.randn(2, 8 // tp, cfg.hidden_size, generator=torch.Generator().manual_seed(1))
        labels = torch.randint(0, cfg.vocab_size, (2, 8), generator=torch.Generator().manual_seed(2))

        def loss_of(x):
            return stage(Inputs(hidden=x, labels=labels)).sum()

        x = x0.clone().requires_grad_()
        out = loss_of(x)
        with count_collectives() as full_comm:
            out.backward()
        want = {n: gather_tp_param(p, grad=True) for n, p in stage.named_parameters()}
        want_x = x.grad.clone()
        stage.zero_grad(set_to_none=True)

        x = x0.clone().requires_grad_()
        out = loss_of(x)
        with count_collectives() as b_comm:
            gx, owed = backward_input(out, None, x, params)
        assert owed.fallback == [] and all(p.grad is None for p in params)  # B computed no weight gradient
        with count_collectives() as w_comm:
            owed.run()
        torch.testing.assert_close(gx, want_x, rtol=1e-5, atol=1e-7)
        for n, p in stage.named_parameters():
            torch.testing.assert_close(gather_tp_param(p, grad=True), want[n], rtol=1e-5, atol=1e-7)
        return {k: v.calls for k, v in b_comm.stats.items()}, {k: v.calls for k, v in w_comm.stats.items()}, {
            k: v.calls for k, v in full_comm.stats.items()}
    finally:
        tpzoo.destroy_parallel()


def test_zero_bubble_split_backward_walks_each_part_once():
    for b, w, full in run_on_ranks(2, _split_backward_matches_full, 1):
        assert b == w == full == {}
    for b, w, full in run_on_ranks(2, _split_backward_matches_full, 2):
        # W runs only weight branches: none of the activation-gradient chain, so none of its collectives but
        # the all-gathers of the sequence-parallel column inputs (2 layers x qkv, fc_in), which B kept sharded
        # (the fused head computed its weight gradient in the forward: W only scales it); B and W together
        # issue exactly what the whole backward issues.
        assert w == {("all_gather", "tp"): 2 * 2}
        assert {k: b.get(k, 0) + w.get(k, 0) for k in full} == full and set(b) <= set(full)


# -- NCCL's point-to-point semantics (strict collective mode) -----------------------------------------------------
def _one_f_one_b_on_two_ranks(shared_group: bool):
    from tpzoo.parallel import CollectiveMisuse, ParallelDims, strict, strict_collectives

    cfg = LLAMA8.replace(num_layers=2)
    g = torch.Generator().manual_seed(0)
    mbs = [{"input_ids": torch.randint(0, cfg.vocab_size, (1, 8), generator=g)} for _ in range(4)]
    for mb in mbs:
        mb["labels"] = torch.roll(mb["input_ids"], -1, dims=1)
    original, previous = ParallelDims.p2p_group, strict.P2P_TIMEOUT
    if shared_group:  # what the pipeline did before: every message of the pair on the one pp group
        ParallelDims.p2p_group = lambda self, src, dst: self.pp_group
    strict.P2P_TIMEOUT = 3.0
    tpzoo.init_parallel(pp=2)
    try:
        with strict_collectives(True):
            chunks = build_model_chunks(cfg)
            return forward_backward(chunks, mbs, schedule="1f1b", loss_scale=0.01)["loss_sum"]
    except CollectiveMisuse as e:
        strict.forget()
        return str(e)
    finally:
        ParallelDims.p2p_group, strict.P2P_TIMEOUT = original, previous
        tpzoo.destroy_parallel()


def test_pipeline_messages_cannot_deadlock_on_nccl_streams():
    # On one shared group, 1F1B posts a receive (the next gradient) in a batch queued before a send (the next
    # activation) that the peer needs first: NCCL, running a group's batches one after another, hangs; strict
    # mode does the same. One group per direction leaves nothing queued behind a receive.
    shared = run_on_ranks(2, _one_f_one_b_on_two_ranks, True, timeout=120)
    assert any("did not complete within 3 s. NCCL runs a group's batches one after another" in str(r)
               for r in shared), shared
    fixed = run_on_ranks(2, _one_f_one_b_on_two_ranks, False)
    assert isinstance(fixed[1], float) and fixed[0] == fixed[1]
