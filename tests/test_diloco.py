"""Training across slow links (tpzoo.train.diloco): replicas, the hierarchical synchronous reduction, DiLoCo and
Streaming DiLoCo, their checkpoints and bad input.

- Synchronous replicas (`--replicas 2`, dp 4) equal flat dp 4 (losses, norms and every weight after 3 steps, to
  1e-6), and send across replicas half the bytes the flat all-reduce carries (counted), at ZeRO-0, ZeRO-3 and with
  tp 2 inside each replica; and the same for tp 2 + SP, pp 2, ZeRO-1 and ep 2 inside replicas.
- DiLoCo and Streaming DiLoCo (2 replicas on 2 ranks) equal a plain-torch reference in one process: two dense
  models, torch.optim.AdamW each, torch.optim.SGD(nesterov=True) on the averaged parameter change, fragments on
  their offsets, the overlapped exchange applied T steps late, bf16 outer gradients summed in fp32; the bytes sent
  per step are exactly the fragment's parameters at the sync dtype, divided by dp/K under ZeRO.
- Resume mid-interval (step 15 of sync_every 10; step 14 with an exchange in flight) equals the uninterrupted run
  bit for bit; a DiLoCo checkpoint resumes at another dp per replica and ZeRO level with its outer state exact.
"""
import json
import math
import re
from pathlib import Path

import pytest
import torch

from tpzoo.parallel.lora import is_lora_param
from tpzoo.testing import run_on_ranks
from tpzoo.train import load_config

from test_train import _cli, _train_capturing_state, store  # noqa: F401 (store: the session's token store)

ROOT = Path(__file__).resolve().parents[1]


def tiny(store, **kw):
    base = dict(model="nano-gpt", data=[store], seq_len=16, global_batch_size=8, micro_batch_size=2, steps=3,
                lr=3e-3, min_lr=3e-4, warmup_steps=2, tp=1, pp=1, dp=0, save="", sample_prompt="", quiet=True,
                log_interval=100, eval_fraction=0.0, seed=0, prefetch=0, eps=1e-4, clip_grad=0.0)
    base.update(kw)
    return load_config(None, base)


def _train(cfg, log_dir=None):
    """train(cfg) on this rank, with comm's counters over the whole run; returns (result, this rank's weights by
    name at the end, counted collectives, this rank's metrics rows when rank 0 logs them to log_dir)."""
    from tpzoo.parallel import comm
    from tpzoo.train.loop import Trainer, train
    from tpzoo.train.metrics import read_metrics

    weights, original = {}, Trainer.close

    def close(self):
        with self.optimizer.weights_readable():
            for c in self.chunks:
                weights.update({n: p.detach().float().clone() for n, p in c.named_parameters()})
        return original(self)

    Trainer.close = close
    try:
        with comm.count_collectives() as counter:
            result = train(cfg)
    finally:
        Trainer.close = original
    rows = read_metrics(cfg.log_dir) if cfg.log_dir and Path(cfg.log_dir, "metrics.jsonl").exists() else None
    return result, weights, counter.summary(), rows


# -- the single-process reference ---------------------------------------------------------------------------------

def reference_diloco(cfg, replicas: int) -> dict:
    """DiLoCo in plain torch: `replicas` dense models, each with torch.optim.AdamW on its dp rank's batches;
    after the steps t with t = floor((f+1) H/F) (mod H), fragment f (layer i in fragment i % F; the rest in 0)
    takes torch.optim.SGD(nesterov=True) on the mean of (global - local), computed T = sync_overlap steps
    earlier, cast to the sync dtype per replica and summed in fp32 in replica order; every replica then holds
    the new global values of the fragment."""
    from tpzoo.data import IGNORE_INDEX
    from tpzoo.models import Inputs, Transformer
    from tpzoo.train.data import build_datasets, make_loader
    from tpzoo.train.lr import lr_at
    from tpzoo.train.run_model import resolve_run_model

    run = resolve_run_model(cfg, resume=None)
    tok, model_cfg = run.tokenizer, run.config
    train_ds, _, _ = build_datasets(cfg, tok)
    models = [Transformer(model_cfg, seed=cfg.seed) for _ in range(replicas)]
    inner = []
    for m in models:
        decayed = [p for p in m.parameters() if p.dim() >= 2]
        inner.append(torch.optim.AdamW([{"params": decayed},
                                        {"params": [p for p in m.parameters() if p.dim() < 2], "weight_decay": 0}],
                                       lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps,
                                       weight_decay=cfg.weight_decay))
    names = [n for n, _ in models[0].named_parameters()]
    glob = {n: torch.nn.Parameter(p.detach().clone()) for n, p in models[0].named_parameters()}
    outer = torch.optim.SGD(list(glob.values()), lr=cfg.outer_lr, momentum=cfg.outer_momentum, nesterov=True)
    H, F, T = cfg.sync_every, cfg.sync_fragments, cfg.sync_overlap
    frag = {n: (int(m.group(1)) % F if (m := re.search(r"layers\.(\d+)\.", n)) else 0) for n in names}
    loaders = [make_loader(train_ds, cfg, r, replicas) for r in range(replicas)]
    n_micro = cfg.global_batch_size // (cfg.micro_batch_size * replicas)
    low = {"fp32": torch.float32, "bf16": torch.bfloat16}[cfg.sync_dtype]
    losses, sent, started = [], [], {}
    for step in range(1, cfg.steps + 1):
        lr = lr_at(step - 1, lr=cfg.lr, min_lr=cfg.min_lr, warmup_steps=cfg.warmup_steps, total_steps=cfg.steps)
        for r, (m, opt) in enumerate(zip(models, inner)):
            batches = [next(loaders[r]) for _ in range(n_micro)]
            tokens = sum(int((b["labels"] != IGNORE_INDEX).sum()) for b in batches)
            loss = sum(m(Inputs(b["input_ids"], labels=b["labels"])).sum() for b in batches) / tokens
            loss.backward()
            if r == 0:
                losses.append(float(loss.detach()))
            for g in opt.param_groups:
                g["lr"] = lr
            opt.step()
            opt.zero_grad()
        numel = 0
        due = [f for f in range(F) if H > 1 and step % H == (f + 1) * H // F % H]
        for f in range(F):
            if H > 1 and (step + T) % H == (f + 1) * H // F % H:  # start: the outer gradient as it is now
                deltas = [{n: (glob[n].detach() - p.detach()).to(low).float() for n, p in m.named_parameters()
                           if frag[n] == f} for m in models]
                started[f] = {n: sum(d[n] for d in deltas) / replicas for n in deltas[0]}
                numel += sum(d.numel() for d in deltas[0].values())
        for f in due:
            mean = started.pop(f)
            for n, p in glob.items():
                p.grad = mean.get(n)
            outer.step()
            outer.zero_grad(set_to_none=True)
            with torch.no_grad():
                for m in models:
                    for n, p in m.named_parameters():
                        if n in mean:
                            p.copy_(glob[n])
        sent.append(numel)
    return {"losses": losses, "numel_sent": sent,
            "weights": [{n: p.detach().clone() for n, p in m.named_parameters()} for m in models]}


def _close(a: dict, b: dict, rel: float, what: str) -> None:
    for n, t in a.items():
        tol = rel * max(float(t.abs().max()), 1.0)
        assert torch.allclose(b[n], t, atol=tol, rtol=0), (what, n, float((b[n] - t).abs().max()))


DILOCO = {"diloco": dict(sync_every=3, steps=7),
          "streaming": dict(sync_every=4, sync_fragments=2, sync_overlap=1, sync_dtype="bf16", steps=9,
                            outer_lr=0.5, outer_momentum=0.5)}


@pytest.mark.parametrize("form", sorted(DILOCO))
def test_diloco_equals_plain_torch_reference(store, tmp_path, form):
    """2 replicas on 2 ranks (tp 1) train like two torch models with AdamW and an outer Nesterov SGD (module
    docstring): replica 0's losses, and both replicas' weights after the last step (1e-5 of each tensor's largest
    entry, AdamW on two summation orders); the bytes each rank sends across replicas per step equal the reference's
    outer-gradient elements at the sync dtype. A streaming run applied without its T-step delay (the exchange's
    result taken at once) differs from the reference: the comparison can fail."""
    cfg = tiny(store, replicas=2, log_dir=str(tmp_path / "log"), **DILOCO[form])
    ref = reference_diloco(cfg, 2)
    out = run_on_ranks(2, _train, cfg)
    (result, w0, _, rows), (_, w1, _, _) = out
    assert result["losses"] == pytest.approx(ref["losses"], abs=1e-5)
    _close(ref["weights"][0], w0, 1e-5, "replica 0")
    _close(ref["weights"][1], w1, 1e-5, "replica 1")
    elt = {"fp32": 4, "bf16": 2}[cfg.sync_dtype]  # K = 2: a ring all-reduce and a 2-rank all-gather send 1 x
    assert [r["sync_bytes"] for r in rows] == [n * elt for n in ref["numel_sent"]]
    assert sum(ref["numel_sent"]) > 0 and all(r["sync_s"] >= 0 for r in rows)
    if form == "streaming":  # the same run without the overlap: replicas differ from the reference
        other = reference_diloco(tiny(store, replicas=2, **{**DILOCO[form], "sync_overlap": 0}), 2)
        assert max(float((other["weights"][0][n] - w0[n]).abs().max()) for n in w0) > 1e-3


def test_a_diloco_replica_evaluates_the_synchronous_held_out_set(store):
    """With lr 0 (weights never change) a DiLoCo run's held-out loss (replica 0's ranks alone) equals the
    synchronous run's (every dp rank): the same held-out batches, not a replica's share of them."""
    kw = dict(replicas=2, lr=0.0, min_lr=0.0, steps=2, eval_fraction=0.2, eval_batches=2)
    sync, dil = run_on_ranks(2, _train_all, [tiny(store, **kw), tiny(store, sync_every=2, **kw)])[0]
    assert sync[0]["eval_loss"] is not None
    assert dil[0]["eval_loss"] == pytest.approx(sync[0]["eval_loss"], abs=1e-6, rel=0)


# -- synchronous replicas equal flat data parallelism -------------------------------------------------------------

def _train_all(cfgs: list, log_dirs: list | None = None) -> list:
    """Several runs in one call (one rank pool); _train's tuple for each."""
    return [_train(cfg) for cfg in cfgs]


def _numel(weights: dict, lora: bool = False) -> int:
    return sum(w.numel() for n, w in weights.items() if not lora or is_lora_param(n))


def _payload(counts: dict, key: str) -> int:
    return counts.get(key, {}).get("payload_bytes", 0)


# (layout, the flat run's keywords, DiLoCo checked too): 4 ranks
SYNC_LAYOUTS = {
    "dp4_zero0": dict(),
    "dp4_zero3": dict(zero=3),
    "pp2_dp2": dict(pp=2),
    "ep2_dp4_zero1": dict(model="nano-mixtral", ep=2, zero=1),
}


def _peers(world: int, tp: int = 1, pp: int = 1, **_) -> list[tuple[int, int]]:
    """Pairs of ranks at the same coordinates in replica 0 and replica 1 (rank = tp_rank + tp (dp_rank + dp
    pp_rank), 2 replicas of dp/2)."""
    dp = world // (tp * pp)
    return [(t + tp * (d + dp * p), t + tp * (d + dp // 2 + dp * p))
            for t in range(tp) for p in range(pp) for d in range(dp // 2)]


def _check_sync_pair(flat, rep, name: str, steps: int, replica_dp: int, lora: bool = False) -> None:
    """A synchronous replica run equals its flat twin, and sends across replicas one shard per step."""
    (fr, fw, fc, _), (rr, rw, rc, _) = flat, rep
    assert rr["losses"] == pytest.approx(fr["losses"], abs=1e-6, rel=0), name
    assert rr["grad_norms"] == pytest.approx(fr["grad_norms"], abs=1e-6, rel=0), name
    assert rr["losses"][-1] < rr["losses"][0], name
    _close(fw, rw, 1e-6, name)
    # across replicas: this rank's 1/replica_dp of its (padded) fp32 gradients, once per step (the dense part;
    # expert weights reduce over their own groups), half of what flat data parallelism all-reduces
    cross = _payload(rc, "all_reduce@cross_replica")
    assert cross > 0 and rc["all_reduce@cross_replica"]["calls"] % steps == 0, name
    if "ep" not in name:
        numel = _numel(rw, lora)
        assert cross == steps * 4 * (-(-numel // replica_dp)), (name, cross, numel)
    if name.startswith("dp4_zero0") or name.startswith("lora"):  # the flat all-reduce's gradient bytes, counted
        scalars = _payload(rc, "all_reduce@dp_cp")  # the token count and loss sums: the same in both runs
        assert 2 * cross == _payload(fc, "all_reduce@dp_cp") - scalars, name


def test_synchronous_replicas_equal_flat_and_send_a_shard(store):
    """dp 4 as 2 replicas (--sync-every 1) at ZeRO 0, 1 and 3, tp 2 + SP, pp 2 and ep 2 (a mixture of experts)
    inside each replica: 3 steps equal the flat layout (losses and norms to 1e-6, every weight to 1e-6 of its
    tensor's largest entry), and each rank sends across replicas only its 1/(dp/K) shard of the fp32 gradients
    per step: half the bytes of the flat all-reduce (counted by comm's counters). DiLoCo (sync_every 2) trains at
    pp 2 and ep 2 too (ZeRO 0/1/3: test_diloco_under_zero_sends_the_owned_shard), and after a sync step both
    replicas hold the same weights, bit for bit."""
    cfgs, diloco_too = [], ("pp2_dp2", "ep2_dp4_zero1")
    for name, kw in SYNC_LAYOUTS.items():
        cfgs += [tiny(store, **kw), tiny(store, replicas=2, **kw)]
        cfgs += [tiny(store, replicas=2, sync_every=2, steps=4, **kw)] if name in diloco_too else []
    out = run_on_ranks(4, _train_all, cfgs)
    at = 0
    for name, kw in SYNC_LAYOUTS.items():
        per_rank = [rank[at:at + 2 + (name in diloco_too)] for rank in out]
        at += 2 + (name in diloco_too)
        replica_dp = 4 // (kw.get("tp", 1) * kw.get("pp", 1)) // 2
        for flat, rep, *_ in per_rank:
            _check_sync_pair(flat, rep, name, 3, replica_dp)
        if name in diloco_too:
            _check_diloco_trains([r[2] for r in per_rank], _peers(4, **kw), name)


def _check_diloco_trains(runs: list, peers: list, name: str) -> None:
    """A DiLoCo run that ends on a sync step: the loss fell, and the peers across replicas hold equal weights."""
    assert runs[0][0]["losses"][-1] < runs[0][0]["losses"][0], name
    for a, b in peers:
        assert runs[a][1].keys() == runs[b][1].keys(), name
        assert all(torch.equal(runs[a][1][n], runs[b][1][n]) for n in runs[a][1]), name


def test_synchronous_replicas_with_tp2_sp_inside_equal_flat(store):
    """tp 2 with sequence parallelism, dp 4 as 2 replicas (8 ranks): equal to the flat layout, one gradient shard
    across per step; DiLoCo trains there too."""
    kw = dict(tp=2, sequence_parallel=True)
    out = run_on_ranks(8, _train_all, [tiny(store, **kw), tiny(store, replicas=2, **kw),
                                       tiny(store, replicas=2, sync_every=2, steps=4, **kw)])
    for flat, rep, _ in out:
        _check_sync_pair(flat, rep, "tp2_sp_dp4_zero0", 3, 2)
    _check_diloco_trains([r[2] for r in out], _peers(8, **kw), "tp2_sp_dp4")


def test_lora_replicas_sync_only_the_adapters(store, tmp_path):
    """LoRA inside replicas (dp 4, 2 replicas): synchronous equals flat; DiLoCo trains and sends only the adapters
    (sync_every 2 over 4 steps: 2 syncs of the adapters' fp32 values), the frozen base untouched."""
    kw = dict(base=str(tmp_path / "base" / "step_00000001"), lora_rank=4, lr=1e-2)
    out = run_on_ranks(4, _train_all, [tiny(store, steps=1, save=str(tmp_path / "base")),  # the base, first
                                       tiny(store, **kw), tiny(store, replicas=2, **kw),
                                       tiny(store, replicas=2, sync_every=2, steps=4, **kw)])
    out = [rank[1:] for rank in out]
    for flat, rep, _ in out:
        _check_sync_pair(flat, rep, "lora_dp4", 3, 2, lora=True)
    runs = [r[2] for r in out]
    _check_diloco_trains(runs, _peers(4), "lora")
    adapters = _numel(runs[0][1], lora=True)
    assert 0 < adapters < _numel(runs[0][1]) / 4
    for result, weights, counts, _ in runs:
        assert _payload(counts, "all_reduce@cross_replica") == 2 * 4 * adapters
        base = [n for n in weights if not is_lora_param(n)]
        assert all(torch.equal(weights[n], out[0][0][1][n]) for n in base)  # the base: as the flat run's


def test_diloco_under_zero_sends_the_owned_shard(store):
    """DiLoCo at dp 4 as 2 replicas under ZeRO-1 and ZeRO-3: each rank sends its owned segments of the outer
    gradient, so the two ranks of a replica send one model's parameters together per sync (sync_every 2, 4
    steps: 2 syncs); the runs equal DiLoCo at ZeRO-0 (to 1e-6: the same arithmetic, sharded). With 2 fragments
    under ZeRO-1 the first rank of a replica owns none of fragment 1 (layer 1 lies in the other half of the
    bucket): it sends nothing for it and still joins the weights' all-gather; equal to ZeRO-0's streaming run."""
    cfgs = [tiny(store, replicas=2, sync_every=2, steps=4, zero=z) for z in (0, 1, 3)]
    cfgs += [tiny(store, replicas=2, sync_every=2, sync_fragments=2, steps=4, zero=z) for z in (0, 1)]
    out = run_on_ranks(4, _train_all, cfgs)
    numel = _numel(out[0][0][1])
    # tpzoo plan's DiLoCo bytes (one replica: dp 2 under ZeRO-1) are what these ranks sent, per sync
    from tpzoo.models import get_config
    from tpzoo.plan import ClusterSpec, Layout, TrainingSpec, estimate
    from tpzoo.plan import replicas as plan

    model = get_config("nano-gpt").replace(vocab_size=259)  # the byte tokenizer's vocabulary
    training, cluster = TrainingSpec(seq_len=16, global_batch_size=4, zero=1, dtype="fp32"), ClusterSpec(gpus=2)
    est = estimate(model, Layout(dp=2), cluster, training)
    planned = plan.diloco(model, est, cluster, training, plan.ReplicaSpec(2, 1.0), 2)
    assert planned.bytes_per_step * 2 * 2 == 4 * numel  # per step x H, both ranks of the replica = one model
    for z, i in ((0, 0), (1, 1), (3, 2)):
        sent = [_payload(rank[i][2], "all_reduce@cross_replica") for rank in out]
        if z == 0:
            assert sent == [2 * 4 * numel] * 4
        else:
            assert sent[0] + sent[1] == sent[2] + sent[3] == 2 * 4 * numel and sent[0] < 2 * 4 * numel
        for rank in out:
            assert rank[i][0]["losses"] == pytest.approx(rank[0][0]["losses"], abs=1e-6, rel=0), z
            _close(rank[0][1], rank[i][1], 1e-6, f"zero {z}")
    calls = [rank[4][2]["all_reduce@cross_replica"]["calls"] for rank in out]
    assert calls[0] < calls[1] and calls == [calls[0], calls[1]] * 2  # rank 0 skipped fragment 1's exchanges
    for rank in out:
        assert rank[4][0]["losses"] == pytest.approx(rank[3][0]["losses"], abs=1e-6, rel=0)
        _close(rank[3][1], rank[4][1], 1e-6, "streaming, zero 1")


# -- checkpoints -----------------------------------------------------------------------------------------------------

def _state(trainer) -> dict:
    """This rank's replica's weights and AdamW moments, and the outer optimizer's global parameters, momentum and
    received means, per parameter name, full over the replica's dp (collective inside the replica)."""
    from tpzoo.train import diloco_state

    opt, sync = trainer.optimizer, trainer.replica_sync
    fulls = {kind: opt.full_state(kind) for kind in opt.state_kinds()}
    fulls["weights"] = opt.full_weights().float()
    fulls["global"] = diloco_state._full(sync, sync.global_)
    fulls["velocity"] = diloco_state._full(sync, sync.velocity)
    fulls["ready"] = diloco_state._full(sync, diloco_state._ready_vectors(sync))
    out = {}
    for kind, full in fulls.items():
        with opt.params_viewing(full):
            out.update({f"{kind}:{n}": p.detach().clone() for c in trainer.chunks for n, p in c.named_parameters()})
    return out


RESUME = {"diloco": dict(sync_every=10, save_every=15),
          "streaming_in_flight": dict(sync_every=10, sync_fragments=2, sync_overlap=1, sync_dtype="fp8",
                                      save_every=7)}


@pytest.mark.parametrize("form", sorted(RESUME))
def test_resume_mid_interval_is_bit_exact(store, tmp_path, form):
    """20 steps of 2 replicas straight == resumed from a checkpoint mid-interval: step 15 of sync_every 10, or
    step 14 of a streaming run whose fragment-0 exchange (fp8) was in flight (started after step 14, applied
    after 15): identical losses and final weights on both replicas, bit for bit. The checkpoint lists its
    replica and outer-state directories, each an intact model-format checkpoint."""
    from tpzoo.train.checkpointing import checkpoint_problem

    save = str(tmp_path / "run")
    kw = dict(replicas=2, steps=20, save=save, keep_last=0, **RESUME[form])
    at = 15 if form == "diloco" else 14
    straight = run_on_ranks(2, _train, tiny(store, **kw))
    ckpt = Path(save) / f"step_{at:08d}"
    entry = json.loads((ckpt / "train_state.json").read_text())["diloco"]
    assert entry["ready"] == ([] if form == "diloco" else [0]) and checkpoint_problem(ckpt) is None
    assert set(entry["dirs"]) >= {"replicas/r01", "replicas/r01/optim/exp_avg", "diloco/global", "diloco/velocity"}
    resumed = run_on_ranks(2, _train, tiny(store, **{**kw, "resume": str(ckpt), "save": str(tmp_path / "again")}))
    assert resumed[0][0]["start_step"] == at
    assert resumed[0][0]["losses"] == straight[0][0]["losses"][at:]
    for (_, w, _, _), (_, w_straight, _, _) in zip(resumed, straight):
        assert all(torch.equal(w[n], w_straight[n]) for n in w)
    from safetensors.torch import load_file

    shard = "model-tp00-pp00.safetensors"  # mid-interval the replicas hold different weights
    mine, other = load_file(ckpt / shard), load_file(ckpt / "replicas" / "r01" / shard)
    assert mine.keys() == other.keys() and any(not torch.equal(mine[n], other[n]) for n in mine)


def test_diloco_checkpoint_resumes_at_another_dp_and_zero_level(store, tmp_path):
    """A streaming run saved at dp 2 as 2 replicas (ZeRO-0) with an exchange in flight, resumed at dp 4 as 2
    replicas with ZeRO-1 (micro-batches halved: each replica still takes the same rows): each replica's weights and
    moments, the global parameters, the outer momentum and the received mean load exactly, and the run continues
    on the saved run's curve (1e-4: another summation order).
    A resume with another schedule is refused in one line."""
    save = str(tmp_path / "run")
    kw = dict(replicas=2, steps=10, sync_every=4, sync_fragments=2, sync_overlap=1, save=save, keep_last=0)
    (straight, saved), (straight1, saved1) = run_on_ranks(2, _train_capturing_state,
                                                          tiny(store, save_every=5, **kw), 5, _state)
    assert any(saved[k].abs().sum() > 0 for k in saved if k.startswith("ready:"))  # fragment 1 in flight at 5
    # micro-batches of 1 at dp 4 (2 at dp 2): each replica's rows of every step stay the same (tpzoo.data.loader)
    resumed = run_on_ranks(4, _train_capturing_state, tiny(store, zero=1, micro_batch_size=1,
                                                           resume=f"{save}/step_00000005",
                                                           **{**kw, "save": str(tmp_path / "again")}), 0, _state)
    # ranks 0, 1: replica 0 (rank 0 of the saved run), ranks 2, 3: replica 1; each reports its replica's loss
    for (res, loaded), (run, mine) in zip(resumed, [(straight, saved)] * 2 + [(straight1, saved1)] * 2):
        assert loaded.keys() == mine.keys()
        for k, t in mine.items():
            assert torch.equal(loaded[k], t), k
        assert res["losses"] == pytest.approx(run["losses"][5:], abs=1e-4)
    assert straight["losses"] != straight1["losses"]
    with pytest.raises(Exception, match=r"ConfigError: .* DiLoCo checkpoint taken with sync_every 4 \(now 6\)"):
        run_on_ranks(2, _train, tiny(store, **{**kw, "sync_every": 6, "resume": f"{save}/step_00000005",
                                               "save": str(tmp_path / "third")}))


@pytest.mark.faults
def test_a_rank_killed_mid_sync_loses_nothing(store, tmp_path):
    """`tpzoo pretrain --replicas 2 --sync-every 3` (2 self-spawned ranks) whose replica-1 rank is SIGKILLed inside
    its second outer exchange (after step 6, before the step-6 save): the job fails, the step-3 checkpoint stays
    the newest intact one, and --resume continues from it to the same losses as an uninterrupted run."""
    from tpzoo.train.metrics import read_metrics

    save = tmp_path / "run"
    args = ["--model", "nano-gpt", "--tp", "1", "--dp", "2", "--replicas", "2", "--sync-every", "3", "--data", store,
            "--seq-len", "16", "--global-batch-size", "8", "--micro-batch-size", "2", "--steps", "9",
            "--warmup-steps", "2", "--seed", "0", "--eval-fraction", "0", "--eps", "1e-4", "--clip-grad", "0",
            "--prefetch", "0", "--save", str(save), "--save-every", "3", "--sample-prompt", "", "--log-interval", "1"]
    killed = _cli(args, tmp_path, {"TPZOO_TEST_KILL_DURING_SYNC": "1:2"})
    assert killed.returncode != 0 and "rank 1 ended with exit code -9" in killed.stderr, killed.stderr[-2000:]
    assert sorted(p.name for p in save.glob("step_*")) == ["step_00000003"]
    resumed = _cli(args + ["--resume"], tmp_path)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "step_00000003 at step 3" in resumed.stdout and "replicas: 2, DiLoCo every 3 steps" in resumed.stdout
    straight = run_on_ranks(2, _train, tiny(store, dp=2, replicas=2, sync_every=3, steps=9))[0][0]
    rows = read_metrics(str(save))
    assert [r["step"] for r in rows] == list(range(1, 10))
    assert [r["loss"] for r in rows] == pytest.approx(straight["losses"], abs=1e-6)
    assert [r["sync_bytes"] > 0 for r in rows] == [step % 3 == 0 for step in range(1, 10)]


# -- bad input, groups, the emulated link, strict mode's carried handles ----------------------------------------------

BAD = [  # (flags, what the one error line says)
    (["--tp", "1", "--dp", "4", "--replicas", "3"], "replicas=3 does not divide dp=4"),
    (["--tp", "1", "--replicas", "2"], "replicas=2 does not divide dp=1"),
    (["--tp", "1", "--dp", "4", "--replicas", "2", "--ep", "4"], "ep=4 does not divide dp*cp = 4*1 / replicas = 2"),
    (["--tp", "1", "--sync-every", "2", "--sync-fragments", "3"], "sync_fragments=3 is more than sync_every=2"),
    (["--tp", "1", "--sync-every", "12", "--sync-fragments", "5"], "sync_fragments=5 is more than the 4 layers"),
    (["--tp", "1", "--sync-every", "10", "--sync-fragments", "2", "--sync-overlap", "5"],
     "sync_overlap=5 must be less than sync_every / sync_fragments = 10/2"),
    (["--tp", "1", "--sync-overlap", "1"], "sync_overlap=1 must be less than"),
    (["--tp", "1", "--sync-every", "4", "--sync-dtype", "fp4"], "--sync-dtype"),
    (["--tp", "1", "--sync-dtype", "bf16"], "sync_dtype 'bf16' is for DiLoCo's outer gradients"),
    (["--tp", "1", "--emulate-link", "fast"], "emulate_link: expected GBPS[:LATENCY_MS]"),
    (["--tp", "1", "--emulate-link", "0:5"], "emulate_link: expected GBPS[:LATENCY_MS]"),
    (["--tp", "1", "--sync-every", "4", "--dtype", "fp16"], "--dtype fp16 with sync_every > 1"),
]


@pytest.mark.faults
@pytest.mark.parametrize("flags,says", BAD, ids=[str(i) for i in range(len(BAD))])
def test_bad_replica_input_is_one_line_before_any_rank(monkeypatch, capsys, flags, says):
    from preflight_helpers import cli, one_error_line

    one_error_line(*cli(monkeypatch, capsys, "pretrain", "--model", "tiny-gpt", *flags), "pretrain", says)


def test_replica_groups_follow_the_documented_rank_order():
    """tp 2, dp 4 as 2 replicas (rank = tp_rank + 2 dp_rank): replica 0 is dp ranks 0-1 (ranks 0-3); replica_dp
    pairs the dp ranks of a replica at each tp rank, cross_replica the same coordinates in each replica; with
    ep 2 the experts' group inside a replica. A layout without replicas creates exactly the groups it did."""
    from tpzoo.parallel.dims import ParallelDims, ParallelLayoutError

    groups = ParallelDims(tp=2, dp=4, world_size=8, replicas=2).enumerate_groups()
    named = {}
    for name, ranks in groups:
        named.setdefault(name, []).append(ranks)
    assert named["replica"] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert sorted(named["replica_dp"]) == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert sorted(named["cross_replica"]) == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert [g for g in groups if "replica" not in g[0]] == ParallelDims(tp=2, dp=4, world_size=8).enumerate_groups()
    moe = ParallelDims(dp=4, world_size=4, replicas=2, ep=2)
    assert sorted(r for n, r in moe.enumerate_groups() if n == "replica_edp") == [[0], [1], [2], [3]]
    assert moe.group_rank("replica_dp") == 0 and ParallelDims(dp=4, world_size=4, rank=3, replicas=2).replica == 1
    with pytest.raises(ParallelLayoutError, match="replicas=3 does not divide dp=4"):
        ParallelDims(dp=4, world_size=4, replicas=3)


def _emulated_link_times() -> dict:
    """On 2 ranks: a 1 MB fp32 all-reduce over a group emulating 0.1 Gbit/s + 5 ms (sent: 1 MB at 2 ranks =>
    at least 80 + 5 ms), called synchronously, started and waited at once, and started then waited after 0.2 s of
    other work; the sleeps comm owed each, the counter's blocked seconds, the wall time of it all."""
    import time

    import tpzoo
    from tpzoo.parallel import comm

    dims = tpzoo.init_parallel(dp=2)
    group, t = dims.dp_group, torch.ones(250_000)
    out, sleeps, real_sleep = {"sleeps": []}, [], comm.time.sleep
    comm.time.sleep = lambda s: (sleeps.append(s), real_sleep(s))
    comm.emulate_link(group, 0.1, 5.0)
    try:
        begin = time.perf_counter()
        with comm.count_collectives() as c:
            for how in ("sync", "async", "hidden", "plain"):
                if how == "plain":
                    comm.emulate_link(group, None)
                t0 = time.perf_counter()
                if how in ("sync", "plain"):
                    comm.all_reduce(t, group)
                else:
                    pending = comm.all_reduce_start(t, group)
                    if how == "hidden":
                        time.sleep(0.2)  # the transfer overlaps this: the wait owes nothing more
                        real_sleep(0)
                    pending.wait()
                out[how] = time.perf_counter() - t0
                out["sleeps"].append([x for x in sleeps if x != 0.2])
                sleeps.clear()
        out["total"] = time.perf_counter() - begin
        out["blocked"] = c.get("all_reduce", "dp").seconds
    finally:
        comm.emulate_link(group, None)
        comm.time.sleep = real_sleep
    return out


def test_the_emulated_link_is_a_lower_bound_that_overlap_hides():
    """A collective over a group with an emulated link lasts at least bytes / bandwidth + latency, synchronous or
    waited at once (comm sleeps what the transfer did not take); one waited after enough other work owes nothing
    (no sleep), and without the link nothing sleeps. comm's counters credit the seconds blocked."""
    floor = 1e6 * 8 / 0.1e9 + 5e-3
    for r in run_on_ranks(2, _emulated_link_times):
        assert r["sync"] >= floor and r["async"] >= floor, r
        owed = r["sleeps"]
        assert len(owed[0]) == 1 and len(owed[1]) == 1 and owed[2] == [] and owed[3] == [], r
        assert 1.5 * floor <= r["blocked"] <= r["total"], r  # (the async one: blocked from its wait on)


def test_strict_mode_lets_a_carried_handle_cross_steps_but_not_the_call():
    """A started collective declared carried (Streaming DiLoCo's exchange) passes the end-of-step check and
    still fails the harness's check if never waited; an undeclared one fails the step."""
    from tpzoo.parallel import strict
    from tpzoo.parallel.strict import CollectiveMisuse

    with strict.strict_collectives(True):
        kept = strict.Guard("all_reduce", "cross_replica")
        strict.carry(type("Handle", (), {"guard": kept})())
        strict.check_all_waited("the end of training step 1")
        with pytest.raises(CollectiveMisuse, match="1 collective.*never waited by the end of the call"):
            strict.check_all_waited("the end of the call", include_carried=True)
        strict.Guard("all_reduce", "dp")
        with pytest.raises(CollectiveMisuse, match="never waited by the end of training step 2"):
            strict.check_all_waited("the end of training step 2")


def test_low_precision_exchange_round_trips_within_its_format():
    """encode/decode of the outer gradient: bf16 to bf16's rounding, fp8 to e4m3's per block of 128 values (a tiny
    block keeps its own precision beside a large one), the byte count as encoded_bytes says; zeros stay zeros."""
    from tpzoo.parallel import replica_exchange as rx

    g = torch.Generator().manual_seed(0)
    x = torch.randn(300, generator=g)
    x[:128] *= 1e-4  # one block of small changes beside blocks of large ones
    x[250:] = 0.0
    for dtype, rel in (("bf16", 2 ** -8), ("fp8", 2 ** -3)):
        raw = rx.encode(x, dtype)
        assert raw.dtype == torch.uint8 and raw.numel() == rx.encoded_bytes(x.numel(), dtype)
        y = rx.decode(raw, x.numel(), dtype)
        assert y.dtype == torch.float32 and y.shape == x.shape
        err = (y - x).abs()
        assert bool((err <= rel * x.abs() + 1e-12).all()), (dtype, float((err / x.abs().clamp_min(1e-30)).max()))
        assert bool((y[250:] == 0).all())
    # the per-block scale is what keeps the small block: one scale for everything would flush it to zero
    small = rx.decode(rx.encode(x, "fp8"), x.numel(), "fp8")[:128]
    assert bool((small != 0).all())
