"""`tpzoo plan --replicas K --replica-link-gbps G` (tpzoo.plan.replicas): the bytes each form sends across the
replicas follow tpzoo.train.diloco's exchanges (checked against counted runs in tests/test_diloco.py), the link
time is amortized over H, hidden by overlap, and the recommendation is the smallest H (then F, T) within 5 %."""
import json

import pytest

from tpzoo.models import get_config
from tpzoo.plan import ClusterSpec, TrainingSpec, estimate, search
from tpzoo.plan.estimate import synced_params
from tpzoo.plan.replicas import (BUDGET, CANDIDATE_H, ReplicaSpec, diloco, recommend, replica_estimates,
                                 synchronous)

CFG = get_config("llama-3-8b")
CLUSTER = ClusterSpec(gpus=16, gpu_memory_gib=80)  # one replica of 2
TRAINING = TrainingSpec(seq_len=4096, global_batch_size=128, zero=1)


@pytest.fixture(scope="module")
def best():
    return search(CFG, CLUSTER, TRAINING, tp=2, pp=2)[0]


def test_bytes_follow_the_exchanges(best):
    """Synchronous: each rank's 1/r of the fp32 gradients, all-reduced across K replicas every step. DiLoCo under
    ZeRO: the owned 1/r of the parameters once per H steps, in fp32 (all-reduce) or bf16 / fp8 (all-gather: (K-1)
    x the encoded vector)."""
    n = synced_params(CFG, best.layout, TRAINING).numel
    r = best.layout.grad_replicas
    for k in (2, 4):
        spec = ReplicaSpec(k, 10.0, 5.0)
        assert synchronous(CFG, best, CLUSTER, TRAINING, spec).bytes_per_step == pytest.approx(
            2 * (k - 1) / k * 4 * n / r)
        assert diloco(CFG, best, CLUSTER, TRAINING, spec, 10).bytes_per_step == pytest.approx(
            2 * (k - 1) / k * 4 * n / r / 10)
        assert diloco(CFG, best, CLUSTER, TRAINING, spec, 10, 2, 1, "bf16").bytes_per_step == pytest.approx(
            (k - 1) * 2 * n / r / 10)
        fp8 = diloco(CFG, best, CLUSTER, TRAINING, spec, 10, dtype="fp8").bytes_per_step
        assert fp8 == pytest.approx((k - 1) * (1 + 4 / 128) * n / r / 10)
    unsharded = TrainingSpec(seq_len=4096, global_batch_size=128)  # ZeRO-0: every rank sends its whole model
    est0 = estimate(CFG, best.layout, CLUSTER, unsharded)
    assert diloco(CFG, est0, CLUSTER, unsharded, ReplicaSpec(2, 10.0), 10).bytes_per_step == pytest.approx(4 * n / 10)


def test_link_time_is_amortized_and_hidden_by_overlap(best):
    spec = ReplicaSpec(2, 1.0, 20.0)
    sync = synchronous(CFG, best, CLUSTER, TRAINING, spec)
    assert sync.link_s == pytest.approx(sync.bytes_per_step * 8 / 1e9 + 3 * 0.02)
    assert sync.step_s == pytest.approx(best.time.total + sync.link_s)
    h10 = diloco(CFG, best, CLUSTER, TRAINING, spec, 10)
    h100 = diloco(CFG, best, CLUSTER, TRAINING, spec, 100)
    assert h10.link_s == pytest.approx(10 * h100.link_s) and h10.link_s < sync.link_s / 9
    one = h100.bytes_per_step * 100 * 8 / 1e9 + 0.02  # one exchange of the whole model
    overlapped = diloco(CFG, best, CLUSTER, TRAINING, spec, 100, 1, 1)
    assert overlapped.link_s == pytest.approx(max(0.0, one - best.time.total) / 100)
    streamed = diloco(CFG, best, CLUSTER, TRAINING, spec, 100, 4, 1)
    assert streamed.link_s == pytest.approx(4 * max(0.0, one / 4 + 0.015 - best.time.total) / 100, abs=1e-9)
    assert streamed.tokens_per_s == pytest.approx(2 * 128 * 4096 / streamed.step_s)
    assert h100.extra_gib > 0 and h100.fits


def test_the_recommendation_is_the_smallest_h_within_budget(best):
    slow = ReplicaSpec(2, 1.0, 20.0)
    rec = recommend(CFG, best, CLUSTER, TRAINING, slow)
    assert rec.sync_every > 1 and rec.link_share <= BUDGET
    smaller = [h for h in CANDIDATE_H if h < rec.sync_every]
    for h in smaller:  # no form at a smaller H is within the budget
        for f in (1, 2, 4, 8, 16, 32):
            if f <= min(h, CFG.num_layers):
                for t in ((0, 1) if h >= 20 and h // f > 1 else (0,)):
                    assert diloco(CFG, best, CLUSTER, TRAINING, slow, h, f, t).link_share > BUDGET, (h, f, t)
    fast = ReplicaSpec(2, 3200.0, 0.0)  # InfiniBand-class link: synchronous training is fine
    assert recommend(CFG, best, CLUSTER, TRAINING, fast).sync_every == 1
    forms = replica_estimates(CFG, best, CLUSTER, TRAINING, ReplicaSpec(2, 1.0, 20.0, 50, 2, 1, "bf16"))
    assert [f.form for f in forms] == ["synchronous", "Streaming DiLoCo", rec.form]


def test_plan_command_with_replicas(capsys):
    from tpzoo.cli import main

    args = ["plan", "--model", "llama-3-8b", "--gpus", "32", "--gpu-memory", "80", "--seq-len", "4096",
            "--global-batch-size", "256", "--zero", "1", "--tp", "2", "--pp", "2", "--top", "1", "--rejected", "0",
            "--replicas", "2", "--replica-link-gbps", "1", "--replica-link-latency-ms", "20"]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "(one of 2 replicas: 32 GPUs, global batch 256 in all)" in out and "on 16 GPUs" in out
    line = next(x for x in out.splitlines() if x.startswith("recommended: --replicas 2 --sync-every"))
    assert "within 5%" in line
    assert main(args + ["--json"]) == 0
    forms = json.loads(capsys.readouterr().out)["replicas"]["forms"]
    assert forms[0]["form"] == "synchronous" and forms[-1]["flags"] in line
    assert main(args[:-6]) == 0  # without replicas: no section
    assert "across" not in capsys.readouterr().out
    assert main(args[:-4]) == 2  # replicas without a link
    assert capsys.readouterr().err.strip() == ("tpzoo plan: error: --replicas 2: --replica-link-gbps is required (the "
                                               "link between replicas)")


def test_only_a_form_that_fits_is_recommended_beside_a_layout_with_room_for_it(capsys):
    """gpt-oss-20b on 16 GPUs as 2 replicas at ZeRO-1 over 1 Gbit/s (issue 48): the fastest layout of a replica
    fills its GPUs and DiLoCo's outer state does not fit beside it, so the plan recommended a form that does not
    fit. Now the recommended form fits, within the link budget, beside the fastest layout that has room for one:
    every faster layout has none."""
    from tpzoo.cli import main
    from tpzoo.plan import Layout

    assert main(["plan", "--model", "gpt-oss-20b", "--gpus", "16", "--gpu-memory", "80", "--zero", "1", "--replicas",
                 "2", "--replica-link-gbps", "1", "--seq-len", "4096", "--global-batch-size", "1024",
                 "--max-micro-batch", "2", "--json", "--top", "100000", "--rejected", "0"]) == 0
    d = json.loads(capsys.readouterr().out)
    rec = d["replicas"]["forms"][-1]
    assert rec["fits"] and rec["link_share"] <= BUDGET and rec["sync_every"] > 1
    layouts = [r["layout"] for r in d["recommended"]]
    chosen = layouts.index(d["replicas"]["layout"])
    assert chosen > 0  # the fastest layout has no room (the case)
    cfg, cluster = get_config("gpt-oss-20b"), ClusterSpec(gpus=8, gpu_memory_gib=80)
    training = TrainingSpec(seq_len=4096, global_batch_size=512, zero=1)
    spec = ReplicaSpec(2, 1.0)
    for lay in layouts[:chosen]:
        cuts = lay.get("boundaries")
        est = estimate(cfg, Layout(**{**lay, "boundaries": tuple(cuts) if cuts else None}), cluster, training)
        faster = recommend(cfg, est, cluster, training, spec)
        assert faster is None or faster.link_share > BUDGET, lay


def test_no_recommendation_when_no_form_fits(best):
    """ZeRO-0 on a GPU the layout fills: even synchronous training's shard buffer does not fit; nothing is
    recommended, and the table says so."""
    from tpzoo.plan.estimate import GIB
    from tpzoo.plan.replicas import table

    unsharded = TrainingSpec(seq_len=4096, global_batch_size=128)
    est = estimate(CFG, best.layout, CLUSTER, unsharded)
    full = ClusterSpec(gpus=16, gpu_memory_gib=est.memory.total / GIB + 0.01)
    est = estimate(CFG, best.layout, full, unsharded)
    spec = ReplicaSpec(2, 1.0, 20.0)
    assert est.fits and recommend(CFG, est, full, unsharded, spec) is None
    forms = replica_estimates(CFG, est, full, unsharded, spec)
    assert [f.form for f in forms] == ["synchronous"] and not forms[0].fits
    assert "recommended: none: no form fits in memory" in table(CFG, est, forms, spec)
