"""The plan advisor's layout rules, schedule model (against tpzoo.pipeline's own simulator), search and CLI."""
import json

import pytest

from tpzoo.cli import main
from tpzoo.models import get_config, list_configs
from tpzoo.parallel import ParallelLayoutError
from tpzoo.pipeline import peak_inflight, plan, simulate
from tpzoo.plan import (ClusterSpec, Layout, TrainingSpec, bubble_time, check_layout, enumerate_layouts, estimate,
                        held_states, search)
from tpzoo.plan.estimate import GIB

H100x8 = ClusterSpec(gpus=8, gpu_memory_gib=80)
RUN = TrainingSpec(seq_len=4096, global_batch_size=64)


@pytest.mark.parametrize("schedule,v", [("1f1b", 1), ("gpipe", 1), ("interleaved", 2), ("interleaved", 3),
                                        ("zb", 1)])
def test_bubble_equals_tpzoo_pipeline_simulation(schedule, v):
    for p, m in [(2, 4), (4, 4), (4, 8), (8, 16), (4, 2), (3, 6)]:
        if schedule == "interleaved" and m % p:
            continue
        for f, b, w in [(1.0, 1.0, 1.0), (1.0, 2.0, 1.0), (2.0, 3.0, 1.5)]:
            split = schedule == "zb"
            cost = {"F": f / v, "B": b / v, "W": w / v} if split else {"F": f / v, "B": (b + w) / v, "W": 0.0}
            timelines = simulate([plan(schedule, r, p, m, v) for r in range(p)], p, v, cost)
            span = max(e[2] for t in timelines for e in t) - min(e[1] for t in timelines for e in t)
            layout = Layout(pp=p, schedule=schedule, virtual_stages=v)
            assert bubble_time(layout, m, f, b, w) == pytest.approx(span - m * (f + b + w)), (p, m, f, b, w)


@pytest.mark.parametrize("schedule,v", [("1f1b", 1), ("gpipe", 1), ("interleaved", 2), ("zb", 1)])
def test_in_flight_replays_tpzoo_schedules(schedule, v):
    for p, m in [(2, 4), (4, 8), (4, 4), (8, 16)]:
        for rank in range(p):
            states = held_states(schedule, rank, p, m, v)
            assert max(sum(acts) for acts, _ in states) == peak_inflight(plan(schedule, rank, p, m, v))
    # Korthikanti et al.'s counts for the first stage: p for 1F1B, all m for GPipe.
    first = max(sum(a) for a, _ in held_states(schedule, 0, 4, 8, v))
    assert first == {"1f1b": 4, "gpipe": 8, "zb": 4, "interleaved": 2 * 3 + 4 + 1}[schedule]


@pytest.mark.parametrize("layout,message", [
    (Layout(tp=2, pp=2, dp=1), "!= 8 GPUs"),
    (Layout(tp=8, pp=1, dp=1, sequence_parallel=True), None),
    (Layout(tp=1, pp=1, dp=8, sequence_parallel=True), "sequence parallelism needs tp > 1"),
    (Layout(tp=1, pp=2, dp=4, schedule="interleaved", virtual_stages=3), None),  # uneven chunks: allowed
    (Layout(tp=1, pp=2, dp=4, schedule="interleaved", virtual_stages=1), "virtual_stages must be >= 2"),
    (Layout(tp=1, pp=8, dp=1, schedule="interleaved", virtual_stages=5), "num_layers"),
    (Layout(tp=1, pp=8, dp=1, micro_batch_size=1, schedule="interleaved", virtual_stages=2), None),
    (Layout(tp=1, pp=1, dp=8, micro_batch_size=3), "not divisible by dp*mbs"),
])
def test_layout_rules(layout, message):
    cfg = get_config("llama-3-8b")
    if message is None:
        check_layout(cfg, layout, H100x8, RUN)
    else:
        with pytest.raises(ParallelLayoutError, match=message.replace("*", r"\*")):
            check_layout(cfg, layout, H100x8, RUN)


def test_tensor_parallelism_never_crosses_a_node():
    with pytest.raises(ParallelLayoutError, match="must divide the 8 GPUs of a node"):
        check_layout(get_config("llama-3-8b"), Layout(tp=16, dp=1), ClusterSpec(gpus=16), RUN)
    with pytest.raises(ParallelLayoutError, match="must divide the 6 GPUs of a node"):
        check_layout(get_config("llama-3-8b"), Layout(tp=4, dp=3), ClusterSpec(gpus=12, gpus_per_node=6), RUN)


def test_kv_heads_rule_and_layer_limit():
    cfg = get_config("tiny-llama")  # 4 heads, 2 kv heads, 4 layers
    with pytest.raises(ParallelLayoutError, match="num_layers"):
        check_layout(cfg, Layout(pp=8, dp=1), H100x8, RUN)
    check_layout(cfg, Layout(tp=4, dp=2), H100x8, RUN)  # kv heads replicated, as the model does
    odd = cfg.replace(num_heads=6, num_kv_heads=3, hidden_size=96)
    with pytest.raises(ParallelLayoutError, match="num_heads"):
        check_layout(odd, Layout(tp=4, dp=2), H100x8, RUN)


def test_enumeration_covers_only_valid_layouts():
    cfg = get_config("llama-3-8b")
    cluster = ClusterSpec(gpus=32, gpu_memory_gib=80)
    layouts = enumerate_layouts(cfg, cluster, RUN, max_micro_batch=4)
    assert layouts and all(lay.gpus == 32 and 8 % lay.tp == 0 for lay in layouts)
    assert {lay.tp for lay in layouts} == {1, 2, 4, 8} and max(lay.pp for lay in layouts) == 32
    assert {lay.schedule for lay in layouts if lay.pp > 1} == {"1f1b", "zb", "interleaved"}
    assert not any(lay.sequence_parallel for lay in layouts if lay.tp == 1)


def test_search_ranks_fitting_layouts_by_step_time_and_explains_the_rest():
    res = search(get_config("llama-3-8b"), H100x8, RUN, max_micro_batch=4)
    fits = [e for e in res if e.fits]
    assert fits and not res[-1].fits
    assert [e.time.total for e in fits] == sorted(e.time.total for e in fits)
    assert all(e.memory.total <= 80 * GIB for e in fits)
    # tp 1 x dp 8 cannot fit (ruled out by its memory floor): one of its layouts is estimated, to say why
    plain = next(e for e in res if (e.layout.tp, e.layout.pp, e.layout.dp) == (1, 1, 8))
    assert not plain.fits and plain.reason.startswith(f"needs {plain.memory.total / GIB:.1f} GiB > 80 GiB")
    assert res.ruled_out > 0 and res.considered > len(res)
    best = fits[0]
    assert best.tokens_per_s == pytest.approx(64 * 4096 / best.time.total)
    assert 0.2 < best.mfu < H100x8.efficiency * 1.3  # MFU counts non-causal attention (see docs/plan.md)


def test_knobs_move_the_estimate_the_right_way():
    cfg, run = get_config("llama-3-70b"), TrainingSpec(seq_len=8192, global_batch_size=128)
    cluster = ClusterSpec(gpus=64, gpu_memory_gib=80)
    base = Layout(tp=8, pp=4, dp=2, micro_batch_size=1, recompute="none", sequence_parallel=False)
    est = lambda lay, r=run: estimate(cfg, lay, cluster, r)  # noqa: E731
    e0 = est(base)
    full = est(Layout(**{**base.to_dict(), "recompute": "full"}))
    sp = est(Layout(**{**base.to_dict(), "sequence_parallel": True}))
    inter = est(Layout(**{**base.to_dict(), "schedule": "interleaved", "virtual_stages": 2}))
    zb = est(Layout(**{**base.to_dict(), "schedule": "zb"}))
    zero = est(base, TrainingSpec(seq_len=8192, global_batch_size=128, zero1=True))
    assert full.memory.activations < e0.memory.activations / 5 and full.time.recompute > 0
    assert sp.memory.activations < e0.memory.activations
    assert inter.time.bubble < e0.time.bubble and inter.memory.activations > e0.memory.activations
    assert zb.time.bubble < e0.time.bubble
    assert zero.memory.optimizer + zero.memory.master < e0.memory.optimizer + e0.memory.master
    assert e0.time.dp_comm > 0 and e0.time.tp_comm > 0 and e0.time.bubble > 0


def _plannable(configs) -> None:
    for name, cfg in configs:  # mixtures of experts too (ep searched: tests/test_plan_experts.py)
        res = search(cfg, H100x8, TrainingSpec(seq_len=2048, global_batch_size=16), max_micro_batch=2,
                     recompute="full")
        assert res, name


def test_a_zoo_config_of_every_family_can_be_planned():
    """The smallest named config of each family (the plan sees its kinds, whatever the size)."""
    smallest = {}
    for name, cfg in list_configs().items():
        if cfg.family not in smallest or cfg.num_parameters() < smallest[cfg.family][1].num_parameters():
            smallest[cfg.family] = (name, cfg)
    assert len(smallest) >= 20
    _plannable(smallest.values())


@pytest.mark.slow
def test_every_zoo_config_can_be_planned():
    _plannable(list_configs().items())


def test_cli_table(capsys):
    rc = main(["plan", "--model", "llama-3-8b", "--gpus", "8", "--gpu-memory", "80", "--seq-len", "4096",
               "--global-batch-size", "64", "--top", "3", "--max-micro-batch", "2"])
    out = capsys.readouterr().out
    assert rc == 0
    assert "tpzoo plan: llama-3-8b" in out and "tokens/s" in out and "MFU" in out
    assert "bf16, ZeRO off (training state 18 B/param)" in out
    assert "needs" in out and "GiB > 80 GiB" in out
    rows = [line for line in out.splitlines() if line.strip()[:2].strip().isdigit()]
    assert len(rows) == 3


def test_cli_json_and_model_files(tmp_path, capsys):
    cfg = get_config("tiny-llama")
    path = tmp_path / "tiny.json"
    path.write_text(cfg.to_json())
    hf = tmp_path / "config.json"
    hf.write_text(json.dumps({"model_type": "llama", "architectures": ["LlamaForCausalLM"], "vocab_size": 512,
                              "hidden_size": 128, "num_hidden_layers": 4, "num_attention_heads": 4,
                              "num_key_value_heads": 2, "intermediate_size": 352}))
    for model in (str(path), str(hf)):
        rc = main(["plan", "--model", model, "--gpus", "4", "--gpu-memory", "16", "--seq-len", "256",
                   "--global-batch-size", "8", "--json", "--top", "2", "--zero1"])
        data = json.loads(capsys.readouterr().out)
        assert rc == 0 and data["training"]["zero"] == 1 and len(data["recommended"]) == 2  # --zero1 is --zero 1
        rec = data["recommended"][0]
        assert rec["fits"] and rec["memory_gib"]["total"] <= 16 and rec["tokens_per_s"] > 0
        assert {"params", "grads", "master", "optimizer", "activations"} <= set(rec["memory_gib"])
    assert main(["plan", "--model", "no-such-model", "--gpus", "8", "--gpu-memory", "80", "--seq-len", "8",
                 "--global-batch-size", "8"]) == 2
