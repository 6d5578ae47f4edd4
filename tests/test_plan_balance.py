"""Pipeline stages balanced by each layer's own cost (issue 32 item 7, issue 33 item 6), on a dense-first mixture of
experts (DeepSeek-V3's and Qwen3-MoE's pattern: the first layers dense, an MoE layer holding many times a dense
layer's weights for about the same compute per token):
- the default split (tpzoo.pipeline.partition_layers, what the trainer builds) balances parameters layer by layer:
  the plan's stage parameters are those of the real stages, and the fullest stage holds less than with a
  count-even split;
- the time-balanced split (tpzoo.plan.balance) makes the slowest stage faster than the default split does, its
  per-layer FLOPs add up to the stage FLOPs the estimate times; the search offers it beside the default one (only
  for models whose layers differ: a uniform model's plan is unchanged), marks it and prints each stage's layers,
  memory and time and the split as --pp-boundaries;
- --pp-boundaries fixes the split; a bad one is one line.
"""
import pytest

from tpzoo.cli import main
from tpzoo.models import get_config
from tpzoo.plan import ClusterSpec, Layout, TrainingSpec, estimate, search, stage_params
from tpzoo.plan.balance import layer_step_flops, layers_differ, time_balanced_boundaries
from tpzoo.plan.estimate import stage_flops
from tpzoo.plan.memory import stage_layer_ids

from test_plan_memory import build_stage, unique_params

# 12 layers: 4 dense (ffn 128) then MoE layers of 16 experts (ffn 64, top 2): an MoE layer holds ~4x the weights
DENSE_FIRST = get_config("nano-mixtral").replace(name="dense-first-moe", num_layers=12, num_experts=16,
                                                 mlp_only_layers=[0, 1, 2, 3], ffn_hidden_size=128,
                                                 moe_ffn_hidden_size=64)
RUN = TrainingSpec(seq_len=256, global_batch_size=8)
CLUSTER = ClusterSpec(gpus=4, gpu_memory_gib=80)


def test_default_split_balances_each_layers_parameters():
    layout = Layout(pp=4)
    counts = [stage_params(DENSE_FIRST, layout, s).numel for s in range(4)]
    for s in range(4):  # the plan's stages are the real ones
        assert counts[s] == sum(p.numel() for p in unique_params(build_stage(DENSE_FIRST, 1, 0, 4, s)))
    even = Layout(pp=4, boundaries=(0, 3, 6, 9, 12))
    assert max(counts) < max(stage_params(DENSE_FIRST, even, s).numel for s in range(4))


def test_time_balanced_split_is_faster_and_offered_by_the_search():
    assert layers_differ(DENSE_FIRST) and not layers_differ(get_config("nano-mixtral"))
    layout = Layout(pp=4, micro_batch_size=1, dp=1)
    cuts = time_balanced_boundaries(DENSE_FIRST, layout, RUN)
    default, timed = (estimate(DENSE_FIRST, lay, CLUSTER, RUN) for lay in (layout, layout.replace(boundaries=cuts)))
    assert [r[0] for r in timed.stage_layers] + [12] == list(cuts) != [r[0] for r in default.stage_layers] + [12]
    assert max(timed.stage_busy_s) < 0.95 * max(default.stage_busy_s)  # the slowest stage is faster
    assert timed.time.total < default.time.total
    for s in range(4):  # the weights it splits by are the stage FLOPs the estimate times
        f = stage_flops(DENSE_FIRST, layout, RUN, s)
        layers = sum(layer_step_flops(DENSE_FIRST, layout, RUN)[i] for i in stage_layer_ids(DENSE_FIRST, layout, s))
        head = 3 * 2 * 256 * DENSE_FIRST.hidden_size * DENSE_FIRST.vocab_size if s == 3 else 0
        assert f["forward"] + f["dgrad"] + f["wgrad"] + f["recompute"] == pytest.approx(layers + head, rel=1e-12)
    found = search(DENSE_FIRST, CLUSTER, RUN, max_micro_batch=1, pp=4, recompute="none")
    assert {e.layout.boundaries for e in found} >= {None, cuts}
    uniform = search(get_config("nano-mixtral"), CLUSTER, RUN, max_micro_batch=1, pp=2, recompute="none")
    assert all(e.layout.boundaries is None for e in uniform)


def test_cli_prints_stages_and_takes_pp_boundaries(tmp_path, capsys):
    path = tmp_path / "m.json"
    path.write_text(DENSE_FIRST.to_json())
    args = ["plan", "--model", str(path), "--gpus", "4", "--gpu-memory", "80", "--seq-len", "256",
            "--global-batch-size", "8", "--pp", "4", "--recompute", "none", "--max-micro-batch", "1", "--top", "3"]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "pipeline stages of #1" in out and "stage 3: layers" in out and "busy" in out
    assert main(args + ["--pp-boundaries", "0,2,5,8,12"]) == 0
    out = capsys.readouterr().out
    assert "--pp-boundaries 0,2,5,8,12" in out and "stage 0: layers 0-1," in out and "stage 3: layers 8-11," in out
    assert main(args + ["--pp-boundaries", "0,2,5,8,11"]) == 2
    err = capsys.readouterr().err
    assert "--pp-boundaries" in err and "end at num_layers=12" in err and len(err.strip().splitlines()) == 1
    assert main(args + ["--pp-boundaries", "0,two"]) == 2
    assert main(args + ["--pp-boundaries", "0,4,12"]) == 2  # 2 stages at --pp 4
    assert "--pp-boundaries gives 2 model stages: not pp * virtual stages for --pp 4" in capsys.readouterr().err
