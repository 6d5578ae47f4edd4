"""Training the frontier families (tests/frontier_models.py: DeepSeek-V3 with q_lora_rank set, GLM-4.5, gpt-oss,
tiny random models written by transformers, loaded from their HF directories) against one process, fp32:

three SGD steps at tp 2 + SP, pp 2 (a dense stage 0, a MoE stage 1), ep 2 (dp 2), cp 2 (ring), tp 2 + SP with full
recomputation and pp 2 with selective recomputation on 2 gloo ranks (one pool call for every layout): the loss of every step, every gradient of the first step (tp shards and ep
experts gathered) and every parameter after the last step equal the single-process model on the same
micro-batches within 1e-5 of each tensor's largest entry. With the auxiliary-loss-free balancing on (a larger
rate than the default 1e-3, so that three steps move the routing) every rank's selection biases are equal after
every step and equal the single-process run's (the step's expert loads summed over every rank, each pipeline
stage for its own layers). DeepSeek-V3 also trains Megatron-Core's sequence-wise auxiliary loss
(router_aux_loss_coef > 0), whose per-sequence counts are summed over the ranks of a sequence (tp under SP, cp).

Can fail: with the loads left unsummed (each rank moving its bias by its own tokens) the biases differ from the
single-process run's.

The default run trains DeepSeek-V3 (MLA, group-limited sigmoid routing, shared experts, a dense first layer) at every
layout; GLM-4.5 and gpt-oss are marked slow."""
import dataclasses

import pytest
import torch
from frontier_models import VOCAB, make_hf_model
from test_3d_parity import assert_close
from test_moe_training import ExpertGrads, _full

import tpzoo
from tpzoo.checkpoint import load_weights_into
from tpzoo.models import Inputs, ModelLayout, Transformer, from_hf_config
from tpzoo.models.aux import after_optimizer_step
from tpzoo.parallel import grad_of
from tpzoo.pipeline import build_model_chunks
from tpzoo.testing import run_on_ranks

GLOBAL_BATCH, SEQ, STEPS, RATE = 4, 8, 3, 0.02
# cp 2 trains in float64: in fp32 the ring's log-sum-exp merges round differently from one softmax, and a few
# cancellation-heavy gradients (the MLA query norm's) then differ by 2e-5 of their largest entry; in float64 every
# gradient agrees to 1e-7 (the fp32 main gradients' rounding), so a real defect still shows at 1e-5.
LAYOUTS = [dict(tp=2, sp=True), dict(pp=2), dict(ep=2, dp=2), dict(cp=2, dtype=torch.float64),
           # recomputed: the MLA core (selective), whole blocks (full: the routing runs again in the backward)
           dict(tp=2, sp=True, recompute="full"), dict(pp=2, recompute="selective")]
BIAS = "e_score_correction_bias"


@pytest.fixture(scope="module")
def hf_dirs(tmp_path_factory):
    out = {}
    for kind in ("deepseek_v3", "glm4_moe", "gpt_oss"):
        path = tmp_path_factory.mktemp(kind)
        make_hf_model(kind).save_pretrained(path)
        out[kind] = str(path)
    return out


def make_optimizer(params):
    # SGD with momentum (linear in the gradients: rounding stays rounding), at a rate small enough for these
    # confidently routed models: at 0.5 (tests/test_3d_parity.py's) gpt-oss's parameters amplify the rounding of
    # the fp32 main gradients (1e-7) about 40-fold per step, in float64 as in fp32
    return torch.optim.SGD(params, lr=0.1, momentum=0.9, weight_decay=0.01)


def config(path: str, kind: str):
    cfg = from_hf_config(path)
    moe = dataclasses.replace(cfg.moe, bias_update_rate=RATE,
                              router_aux_loss_coef=0.01 if kind == "deepseek_v3" else cfg.moe.router_aux_loss_coef)
    return cfg.replace(moe=moe)


def global_batch(step: int):
    g = torch.Generator().manual_seed(70 + step)
    ids = torch.randint(0, VOCAB, (GLOBAL_BATCH, SEQ), generator=g)
    labels = torch.cat([ids[:, 1:], torch.full((GLOBAL_BATCH, 1), -100)], dim=1)
    labels[torch.rand(labels.shape, generator=g) < 0.15] = -100
    return ids, labels


def _biases(modules) -> dict:
    return {n: b.detach().clone() for m in modules for n, b in m.named_buffers() if n.endswith(BIAS)}


def reference(path: str, kind: str, dtype=torch.float32) -> dict:
    """One process, micro-batches of one sequence (as every layout below runs them)."""
    model = Transformer(config(path, kind), ModelLayout(dtype=dtype))
    load_weights_into(model, path)
    model.train()
    opt = make_optimizer(model.parameters())
    losses, grads, biases = [], {}, [_biases([model])]
    for step in range(STEPS):
        ids, labels = global_batch(step)
        tokens = (labels != -100).sum()
        opt.zero_grad(set_to_none=True)
        total = 0.0
        for i in range(GLOBAL_BATCH):
            per_token = model(Inputs(ids[i:i + 1], labels=labels[i:i + 1]))
            (per_token.sum() / tokens).backward()
            total += per_token.sum().item()
        losses.append(total)
        if step == 0:
            grads = {n: p.grad.clone() for n, p in model.named_parameters()}
        opt.step()
        model.after_optimizer_step()
        biases.append(_biases([model]))
    return {"loss_sum": losses, "grads": grads, "biases": biases,
            "params": {n: p.detach().clone() for n, p in model.named_parameters()}}


def train(path: str, kind: str, layout: dict, local_loads: bool = False) -> dict:
    dims = tpzoo.init_parallel(tp=layout.get("tp", 1), pp=layout.get("pp", 1), dp=layout.get("dp", 1),
                               ep=layout.get("ep", 1), cp=layout.get("cp", 1))
    try:
        chunks = build_model_chunks(config(path, kind), dims, sequence_parallel=layout.get("sp", False),
                                    dtype=layout.get("dtype", torch.float32),
                                    recompute=layout.get("recompute", "none"))
        load_weights_into(chunks, path)
        for c in chunks:
            c.train()
        params = list({id(p): p for c in chunks for p in c.parameters()}.values())
        reducer = ExpertGrads(params, dims)
        opt = make_optimizer(params)
        losses, grads, biases = [], {}, [_biases(chunks)]
        for step in range(STEPS):
            ids, labels = global_batch(step)
            out = reducer.step(chunks, ids, labels, layout.get("sp", False))
            losses.append(out["loss_sum"])
            if step == 0:
                grads = {n: _full(p, grad_of(p), dims) for c in chunks for n, p in c.named_parameters()}
            opt.step()
            if local_loads:  # the defect the can-fail check plants: each rank's own loads, never summed
                for c in chunks:
                    for layer in c.layers.values():
                        if hasattr(layer.mlp, "apply_step_sums"):
                            layer.mlp.apply_step_sums(layer.mlp.step_sums())
            else:
                after_optimizer_step(chunks)
            biases.append(_biases(chunks))
        return {"coords": (dims.tp_rank, dims.pp_rank, dims.dp_rank), "loss_sum": losses, "grads": grads,
                "biases": biases,
                "params": {n: _full(p, p.detach(), dims) for c in chunks for n, p in c.named_parameters()}}
    finally:
        tpzoo.destroy_parallel()


def run_all(jobs):
    return [train(*job) for job in jobs]


def _unpadded(name, t):
    return t[:VOCAB] if name in ("embed.weight", "lm_head.weight") else t  # (the vocabulary padding at tp 2)


def check(ref: dict, ranks: list[dict], what) -> None:
    for r in ranks:
        for name, g in r["grads"].items():
            want = ref["grads"][name]  # (the main gradients are fp32: compared in the reference's dtype)
            assert_close(_unpadded(name, g).to(want.dtype), want, f"{what} rank {r['coords']} grad {name}")
        for name, p in r["params"].items():
            assert_close(_unpadded(name, p), ref["params"][name], f"{what} rank {r['coords']} param {name}")
        for step, (mine, want) in enumerate(zip(r["biases"], ref["biases"])):
            for name, b in mine.items():  # (each pipeline stage holds its own layers' biases)
                assert torch.equal(b, want[name]), (what, r["coords"], step, name)
    for step, ref_loss in enumerate(ref["loss_sum"]):
        for pp_rank in {r["coords"][1] for r in ranks}:
            total = sum(r["loss_sum"][step] for r in ranks if r["coords"][:2] == (0, pp_rank))
            assert abs(total - ref_loss) <= 1e-5 * abs(ref_loss), (what, step, total, ref_loss)


def _run(hf_dirs, kinds, local_check: bool = False):
    # gpt-oss trains in float64 at every layout: in fp32 its differences of the first step (4e-6 of the largest
    # gradient) grow 10- to 20-fold per step (the clamped SwiGLU's and the sliding window's sharp edges on these
    # random weights); in float64 the three steps agree to 1e-6
    jobs = [(hf_dirs[k], k, {**layout, "dtype": torch.float64} if k == "gpt_oss" else layout)
            for k in kinds for layout in LAYOUTS]
    if local_check:
        jobs.append((hf_dirs["deepseek_v3"], "deepseek_v3", dict(ep=2, dp=2), True))
    per_rank = run_on_ranks(2, run_all, jobs)
    refs = {(k, dt): reference(hf_dirs[k], k, dt) for k in kinds for dt in (torch.float32, torch.float64)}
    for k in kinds:
        biases = refs[k, torch.float32]["biases"]
        assert any(not torch.equal(b, biases[0][n]) for n, b in biases[-1].items()) \
            or k == "gpt_oss"  # the update ran (gpt-oss has no selection bias)
    for j, (_, k, layout, *_) in enumerate(jobs[:len(kinds) * len(LAYOUTS)]):
        check(refs[k, layout.get("dtype", torch.float32)], [r[j] for r in per_rank], (k, layout))
    return refs, jobs, per_rank


def test_deepseek_v3_trains_like_one_process_at_every_layout(hf_dirs):
    refs, jobs, per_rank = _run(hf_dirs, ["deepseek_v3"], local_check=True)
    ref_bias = refs["deepseek_v3", torch.float32]["biases"]
    # can fail: biases moved by each rank's own loads are not the single-process run's
    assert any(not torch.equal(b, ref_bias[step][n]) for r in per_rank for step, mine in enumerate(r[-1]["biases"])
               for n, b in mine.items())


@pytest.mark.slow
def test_glm4_moe_and_gpt_oss_train_like_one_process_at_every_layout(hf_dirs):
    _run(hf_dirs, ["glm4_moe", "gpt_oss"])


# -- the trainer --------------------------------------------------------------------------------------------------

def _train(cfg):
    from tpzoo.train import train

    return train(cfg)


def _state(path) -> dict:
    from tpzoo.checkpoint import load_model

    return load_model(str(path)).state_dict()  # the weights and the persistent buffers (the selection biases)


def test_trainer_moves_saves_and_resumes_the_selection_bias(tmp_path):
    """`tpzoo pretrain --base <DeepSeek-V3 HF directory>` at tp 2 + SP with --router-bias-update-rate and
    --router-aux-loss-coef: the biases move, are saved in the checkpoints, and a run resumed from step 2 ends with
    the uninterrupted run's weights and biases bit for bit."""
    import sysconfig
    from pathlib import Path

    from tpzoo.data import iter_documents, preprocess
    from tpzoo.train import load_config

    hf = tmp_path / "hf"
    make_hf_model("deepseek_v3", vocab=259).save_pretrained(hf)  # (the byte tokenizer's vocabulary)
    lib = Path(sysconfig.get_paths()["stdlib"])
    store = str(preprocess(iter_documents([str(lib / "textwrap.py")]), "byte", tmp_path / "store").path)
    base = dict(base=str(hf), data=[store], seq_len=8, global_batch_size=4, micro_batch_size=1, steps=3, lr=1e-3,
                warmup_steps=1, tp=2, sequence_parallel=True, save_every=2, keep_last=0, sample_prompt="",
                quiet=True, eval_fraction=0.0, seed=0, prefetch=1, router_bias_update_rate=0.01,
                router_aux_loss_coef=0.01)
    full = run_on_ranks(2, _train, load_config(None, {**base, "save": str(tmp_path / "a")}))[0]
    resumed = run_on_ranks(2, _train, load_config(None, {**base, "save": str(tmp_path / "b"),
                                                         "resume": str(tmp_path / "a" / "step_00000002")}))[0]
    assert resumed["losses"][-1] == full["losses"][-1]
    start, mid, end = _state(hf), _state(tmp_path / "a" / "step_00000002"), _state(tmp_path / "a" / "step_00000003")
    biases = [n for n in end if n.endswith(BIAS)]
    assert biases and all(not torch.equal(mid[n], start[n]) and not torch.equal(end[n], mid[n]) for n in biases)
    # the checkpoint holds the moved bias (two steps of +-0.01 at most from HF's), not a fresh one
    assert all(((mid[n] - start[n]).abs() <= 0.02 + 1e-6).all() for n in biases)
    again = _state(tmp_path / "b" / "step_00000003")
    assert sorted(again) == sorted(end) and all(torch.equal(again[n], end[n]) for n in end)


def test_pp_boundaries_put_the_stages_where_asked(tmp_path):
    """`--pp-boundaries 0 3 4` at pp 2 (the cut DeepSeek-V3: a dense layer and three MoE layers; the split balanced
    by parameters would be 0 2 4) trains the same losses as the balanced split, and the checkpoint records those
    stages; boundaries that do not cover the layers fail before any rank starts, in one line."""
    import json
    import sysconfig
    from pathlib import Path

    from tpzoo.data import iter_documents, preprocess
    from tpzoo.pipeline.partition import PartitionError
    from tpzoo.train import load_config
    from tpzoo.train.preflight import check_train

    lib = Path(sysconfig.get_paths()["stdlib"])
    store = str(preprocess(iter_documents([str(lib / "textwrap.py")]), "byte", tmp_path / "store").path)
    base = dict(model="tiny-deepseek-v3", data=[store], seq_len=8, global_batch_size=4, micro_batch_size=1,
                steps=2, lr=1e-3, warmup_steps=1, tp=1, pp=2, sample_prompt="", quiet=True, eval_fraction=0.0,
                seed=0, prefetch=1)
    balanced = run_on_ranks(2, _train, load_config(None, {**base, "save": ""}))[0]
    cut = run_on_ranks(2, _train, load_config(None, {**base, "pp_boundaries": [0, 3, 4],
                                                     "save": str(tmp_path / "run")}))[0]
    assert cut["losses"] == pytest.approx(balanced["losses"], rel=1e-5)
    manifest = json.loads((Path(cut["checkpoint"]) / "manifest.json").read_text())
    assert [s["layers"] for s in manifest["stages"]] == [[0, 3], [3, 4]]
    with pytest.raises(PartitionError, match="must start at 0 and end at num_layers=4"):
        check_train(load_config(None, {**base, "pp_boundaries": [0, 2, 3], "save": ""}))
