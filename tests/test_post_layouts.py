"""The rest of the post-training layout matrix (slow tier), through the trainer (`tpzoo.train.train`, what
`tpzoo finetune` runs on each rank): every layout's per-step losses and gradient norms equal one process's (1e-5),
over 3 AdamW steps, so the objective's gradients, not only its first loss, agree:

- DPO with LoRA (reference: the base without adapters) at tp 2 + SP, pp 2 with GPipe and zero-bubble, dp 2 with
  ZeRO-2, cp 2;
- DPO of the full model with its frozen reference copy at dp 2 with ZeRO-3 and the interleaved schedule (the
  policy in 2 chunks per rank, the reference in one); --dpo-precompute-ref gives the frozen copy's losses; a
  mixture of experts at dp 2 with ep 2;
- distillation from a live teacher of another size (saved at tp 2, loaded at the student's layout) at tp 2 + SP,
  pp 2 with zero-bubble, dp 2 with ZeRO-1, cp 2; a LoRA student at dp 2 with ZeRO-2; a mixture-of-experts
  student at dp 2 with ep 2;
- resuming is exact: DPO with LoRA at tp 2, DPO with a precomputed reference at dp 2 (read back from the
  checkpoint: the model resumed is no longer the reference) and distillation at pp 2: steps 3 and 4 of a run
  resumed at step 2 equal the run's own.
"""
import json
from pathlib import Path

import pytest

from tpzoo.testing import run_on_ranks
from tpzoo.train import load_config, train

from post_helpers import cli_on_rank

pytestmark = pytest.mark.slow

W = ["apple", "river", "stone", "cloud", "green", "tiger", "piano", "lemon", "north", "sugar"]


def _cfg(**kw):
    base = dict(task="sft", seq_len=96, global_batch_size=8, micro_batch_size=2, lr=3e-3, min_lr=3e-4,
                warmup_steps=0, weight_decay=0.0, tp=1, pp=1, dp=0, save="", sample_prompt="", quiet=True,
                eval_fraction=0.0, seed=0, prefetch=1, steps=3, dpo_beta=0.5)
    base.update(kw)
    return load_config(None, base)


def _runs(cfgs) -> list:
    out = []
    for cfg in cfgs:
        r = train(cfg)
        out.append({"losses": r["losses"], "grad_norms": r["grad_norms"], "checkpoint": r["checkpoint"]})
    return out


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    """Seeded nano-llama, tiny-llama (4 layers: interleaving; a teacher, resharded to tp 2) and nano-mixtral
    checkpoints with the byte tokenizer; preference pairs and SFT records in its reach."""
    import torch

    from tpzoo.checkpoint import reshard, save_model_shards
    from tpzoo.data import load_tokenizer
    from tpzoo.models import ModelLayout, Transformer, get_config

    root = tmp_path_factory.mktemp("post")
    bases = {}
    for model in ("nano-llama", "tiny-llama", "nano-mixtral"):
        cfg = get_config(model).replace(vocab_size=259)
        path = root / model
        path.mkdir()
        save_model_shards(Transformer(cfg, ModelLayout(dtype=torch.float32), seed=3), path, cfg,
                          tokenizer=load_tokenizer("byte"))
        bases[model] = str(path)
    reshard(bases["tiny-llama"], root / "tiny-llama-tp2", tp=2, pp=1, progress=False)
    bases["tiny-llama"] = str(root / "tiny-llama-tp2")  # a teacher saved at another layout than the student's
    prefs, sft = root / "prefs.jsonl", root / "sft.jsonl"
    with prefs.open("w") as f, sft.open("w") as g:
        for i in range(32):
            a, b = W[i % 10], W[(3 * i + 1) % 10]
            f.write(json.dumps({"prompt": f"{a} {b}", "chosen": f"{a}-{b}", "rejected": f"{b} {a}!"}) + "\n")
            g.write(json.dumps({"prompt": f"{a} {b}", "response": f"{a}-{b} {b}"}) + "\n")
    return {**bases, "prefs": str(prefs), "sft": str(sft), "root": root}


def _close(got, want, what):
    for key in ("losses", "grad_norms"):
        assert got[key] == pytest.approx(want[key], rel=1e-5), (what, key, got[key], want[key])


def _matrix(kw: dict, layouts: list) -> dict:
    """Each layout (2 ranks) against the one-process run of the config `kw`."""
    want = run_on_ranks(1, _runs, [_cfg(**kw)])[0][0]
    got = run_on_ranks(2, _runs, [_cfg(**{**kw, **lay}) for lay in layouts])[0]
    for lay, res in zip(layouts, got):
        _close(res, want, lay)
    return want


def test_dpo_with_lora_at_every_layout(data):
    ref = dict(base=data["nano-llama"], data=[data["prefs"]], objective="dpo", lora_rank=4)
    _matrix(ref, [dict(tp=2, sequence_parallel=True), dict(pp=2, schedule="gpipe"), dict(pp=2, schedule="zb"),
                  dict(dp=2, zero=2), dict(cp=2)])


def test_dpo_of_the_full_model_frozen_reference_precompute_and_experts(data):
    ref = dict(base=data["tiny-llama"], data=[data["prefs"]], objective="dpo")
    want = _matrix(ref, [dict(dp=2, zero=3), dict(pp=2, schedule="interleaved", virtual_stages=2),
                         dict(dp=2, zero=1, dpo_precompute_ref=True)])
    assert want["losses"][-1] < want["losses"][0]
    moe = dict(base=data["nano-mixtral"], data=[data["prefs"]], objective="dpo")
    _matrix(moe, [dict(dp=2, ep=2)])


def test_distillation_from_a_live_teacher_at_every_layout(data):
    ref = dict(base=data["nano-llama"], data=[data["sft"]], objective="distill", teacher=data["tiny-llama"],
               distill_topk=4, distill_temperature=2.0, distill_alpha=0.7, seq_len=64)
    _matrix(ref, [dict(tp=2, sequence_parallel=True), dict(pp=2, schedule="zb"), dict(dp=2, zero=1), dict(cp=2)])
    _matrix({**ref, "lora_rank": 4}, [dict(dp=2, zero=2)])  # a LoRA student
    _matrix({**ref, "base": data["nano-mixtral"], "teacher": data["nano-llama"]}, [dict(dp=2, ep=2)])  # experts


def test_resume_is_exact(data, tmp_path):
    distill = dict(objective="distill", data=[data["sft"]], teacher=data["tiny-llama"], seq_len=64, pp=2)
    for name, kw, world in (("lora", dict(lora_rank=4, tp=2), 2),
                            ("precompute", dict(dpo_precompute_ref=True, dp=2, zero=1), 2),
                            ("distill", distill, 2)):
        save = str(tmp_path / name)
        base = dict(base=data["nano-llama"], data=[data["prefs"]], objective="dpo", steps=4, save=save)
        base.update(kw)
        straight = run_on_ranks(world, _runs, [_cfg(**base, save_every=2)])[0][0]
        # a new run resumes from step 2's checkpoint
        resumed = run_on_ranks(world, _runs, [_cfg(**base, resume=f"{save}/step_00000002")])[0][0]
        assert resumed["losses"] == straight["losses"][2:], name
        if name == "precompute":
            assert (Path(save) / "step_00000002" / "dpo_reference.safetensors").is_file()


def test_distill_cache_at_tp2_and_dp2_equals_one_rank(data, tmp_path):
    """`tpzoo distill-cache` on 2 ranks, as tp 2 (the vocabulary split) and as dp 2 (each rank every other packed
    sequence, both writing into the same arrays): the same ids and log-probabilities as one rank."""
    import numpy as np

    common = ["distill-cache", "--teacher", data["tiny-llama"], "--data", data["sft"], "--distill-topk", 5,
              "--seq-len", 64, "--micro-batch-size", 2]
    def ok(world, *argv):
        return [rc for rc, _ in run_on_ranks(world, cli_on_rank, [*common, *argv])] == [0] * world

    assert ok(1, "--out", tmp_path / "one") and ok(2, "--out", tmp_path / "tp2", "--tp", 2)
    assert ok(2, "--out", tmp_path / "dp2")
    want = {f: np.load(tmp_path / "one" / f) for f in ("ids.npy", "logprobs.npy", "offsets.npy", "hashes.npy")}
    assert want["offsets.npy"][-1] > 0 and (want["logprobs.npy"] < 0).all()
    for other in ("tp2", "dp2"):
        for f, a in want.items():
            b = np.load(tmp_path / other / f)
            if f == "logprobs.npy":
                np.testing.assert_allclose(b, a, rtol=1e-5, atol=1e-6, err_msg=other)
            else:
                assert np.array_equal(a, b), (other, f)


def test_every_tensor_is_on_the_runtime_device(data, tmp_path):
    """Under `torch.set_default_device("meta")` with the runtime's device cpu (tests/test_device_placement.py's
    proof), DPO with LoRA and a precomputed reference at tp 2 + SP, DPO with a frozen copy at pp 2, distillation
    from a live teacher at pp 2 and a teacher cache written at tp 2 give exactly a normal run's results."""
    from test_device_placement import _under_meta

    runs = [_cfg(base=data["nano-llama"], data=[data["prefs"]], objective="dpo", lora_rank=4, tp=2,
                 sequence_parallel=True, dpo_precompute_ref=True, steps=2, eval_fraction=0.25),
            _cfg(base=data["nano-llama"], data=[data["prefs"]], objective="dpo", pp=2, steps=2),
            _cfg(base=data["nano-llama"], data=[data["sft"]], objective="distill", teacher=data["tiny-llama"], pp=2,
                 steps=2, seq_len=64)]
    normal, meta = (run_on_ranks(2, _under_meta, m, _runs, runs)[0] for m in (False, True))
    for a, b in zip(normal, meta):
        assert a["losses"] == b["losses"] and a["grad_norms"] == b["grad_norms"]
    cache = ["distill-cache", "--teacher", data["tiny-llama"], "--data", data["sft"], "--distill-topk", 4,
             "--seq-len", 64, "--tp", 2]
    import numpy as np

    for m, out in ((False, "normal"), (True, "meta")):
        assert [rc for rc, _ in run_on_ranks(2, _under_meta, m, cli_on_rank, [*cache, "--out", tmp_path / out])] \
            == [0, 0]
    for f in ("ids.npy", "logprobs.npy"):
        assert np.array_equal(np.load(tmp_path / "normal" / f), np.load(tmp_path / "meta" / f))
