"""The plan's memory floor (tpzoo/plan/bound.py) and what the search does with it (issue 48, items 4 and 5).

- The floor is one: for every layout of several searches (dense and mixture-of-experts models, ZeRO 0 to 3, LoRA (on
  experts too), context parallelism) it is at most what estimate() finds, and the search that leaves out the layouts over their
  floor finds exactly the layouts that fit of the search that estimates them all.
- `tpzoo plan` as typed with only --model, --gpus and --gpu-memory runs (4096-token sequences, 4M-token batches),
  and when nothing fits says which flag would: that flag, run, fits; with --replicas it says that nothing is left
  to compare across them.
- The pipeline schedules' replay, cut at their steady state, gives the full replay's peaks.
- A long search draws a progress bar."""
import re

import pytest

from tpzoo.cli import main
from tpzoo.models import get_config
from tpzoo.plan import ClusterSpec, Layout, TrainingSpec, enumerate_layouts, estimate, search
from tpzoo.plan.bound import memory_floor
from tpzoo.plan.estimate import GIB

CASES = {  # (model, GPUs of 80 GiB, the run, the search's restrictions)
    "dense": ("llama-3-8b", 8, TrainingSpec(seq_len=4096, global_batch_size=16), dict(max_micro_batch=2, pp=2)),
    "zero3": ("llama-3-70b", 16, TrainingSpec(seq_len=4096, global_batch_size=16, zero=3),
              dict(max_micro_batch=2, tp=8)),
    "lora": ("llama-3-70b", 8, TrainingSpec(seq_len=2048, global_batch_size=8, lora_rank=16),
             dict(max_micro_batch=1, recompute="full")),
    "cp": ("llama-3-8b", 8, TrainingSpec(seq_len=32768, global_batch_size=8),
           dict(max_micro_batch=1, recompute="full")),
    "lora_experts": ("qwen3-30b-a3b", 8, TrainingSpec(seq_len=4096, global_batch_size=16, lora_rank=16,
                                                      lora_experts=True), dict(max_micro_batch=2, tp=1, pp=1)),
    "experts": ("qwen3-30b-a3b", 16, TrainingSpec(seq_len=4096, global_batch_size=16, zero=1),
                dict(max_micro_batch=1, recompute="selective", tp=2)),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_the_floor_is_under_every_estimate_and_loses_no_fitting_layout(case):
    name, gpus, training, only = CASES[case]
    cfg, cluster = get_config(name), ClusterSpec(gpus=gpus, gpu_memory_gib=80)
    mbs = only.pop("max_micro_batch")
    every = [estimate(cfg, lay, cluster, training) for lay in enumerate_layouts(cfg, cluster, training, mbs, **only)]
    assert every
    for est in every:
        floor = memory_floor(cfg, est.layout, training, cluster.reserve_gib * GIB)
        assert floor <= est.memory.total, (est.layout, floor / GIB, est.memory.total / GIB)
    found = search(cfg, cluster, training, mbs, **only)
    assert {e.layout for e in found if e.fits} == {e.layout for e in every if e.fits}
    assert found.considered == len(every) and found.ruled_out > 0, case  # (the floor does rule some out)


def test_plan_as_typed_says_which_flag_would_fit(capsys):
    assert main(["plan", "--model", "llama-3-8b", "--gpus", "1", "--gpu-memory", "80"]) == 0
    out = capsys.readouterr().out
    assert "seq 4096, global batch 1024 (4,194,304 tokens/step)" in out and ", 0 fit (" in out
    hint = next(line for line in out.splitlines() if line.startswith("nothing fits: "))
    flags = re.match(r"nothing fits: (.*) would make it fit: e\.g\. ", hint).group(1).split()
    assert main(["plan", "--model", "llama-3-8b", "--gpus", "1", "--gpu-memory", "80", *flags, "--top", "1"]) == 0
    out = capsys.readouterr().out
    assert re.search(r"layouts, [1-9]\d* fit", out), out
    # replicas of one GPU each: nothing fits, and the replicas' section says so instead of vanishing
    assert main(["plan", "--model", "llama-3-8b", "--gpus", "2", "--gpu-memory", "80", "--replicas", "2",
                 "--replica-link-gbps", "1"]) == 0
    assert "across 2 replicas: nothing to compare, no layout of one replica fits" in capsys.readouterr().out


def test_a_long_search_draws_a_progress_bar(monkeypatch, capsys):
    import importlib

    search_module = importlib.import_module("tpzoo.plan.search")  # (tpzoo.plan.search is also the function)

    monkeypatch.setattr(search_module, "BAR_FROM", 1)
    search(get_config("tiny-llama"), ClusterSpec(gpus=2), TrainingSpec(seq_len=64, global_batch_size=4),
           progress=True)
    assert "tpzoo plan" in capsys.readouterr().err
    monkeypatch.setattr(search_module, "BAR_FROM", 10 ** 9)
    search(get_config("tiny-llama"), ClusterSpec(gpus=2), TrainingSpec(seq_len=64, global_batch_size=4),
           progress=True)
    assert "tpzoo plan" not in capsys.readouterr().err


def test_a_longer_steady_state_adds_no_peak():
    """held_states replays at most steady_micro_batches() micro-batches: the full replay of more gives the same
    candidate peaks, on every rank, for 1F1B, zero-bubble and interleaving (and GPipe is never cut short)."""
    from tpzoo.plan.schedule import replay_held_states, steady_micro_batches

    for schedule, vs in (("1f1b", (1,)), ("zb", (1,)), ("interleaved", (2, 3))):
        for pp in (2, 3, 5, 8):
            for v in vs:
                cut = steady_micro_batches(schedule, pp, 10 ** 6, v)
                assert cut < 10 ** 6 and (schedule != "interleaved" or cut % pp == 0)
                for m in (cut + pp, 2 * cut):
                    assert steady_micro_batches(schedule, pp, m, v) == cut
                    for rank in range(pp):
                        assert set(replay_held_states(schedule, rank, pp, m, v)) == set(
                            replay_held_states(schedule, rank, pp, cut, v)), (schedule, pp, v, m, rank)
    assert steady_micro_batches("gpipe", 4, 1000) == 1000
