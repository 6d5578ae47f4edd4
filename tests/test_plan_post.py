"""The plan counts post-training's frozen models (tpzoo.plan.post): DPO's reference copy of a fully fine-tuned
model and a live distillation teacher, each at the trained model's layout, in its dtype, split by its own layers;
none for LoRA-DPO (the base without adapters), --dpo-precompute-ref or a teacher cache."""
import dataclasses
import json

from tpzoo.models import get_config
from tpzoo.plan import Layout, TrainingSpec
from tpzoo.plan.memory import stage_memory, stage_params


def test_frozen_models_add_their_stage_weights():
    student, teacher = get_config("llama-3-8b"), get_config("tiny-llama")
    layout = Layout(tp=2, pp=2, dp=2, micro_batch_size=1, virtual_stages=2, schedule="interleaved")
    plain = TrainingSpec(seq_len=2048, global_batch_size=16)
    for stage in (0, 1):
        base = stage_memory(student, layout, plain, stage)
        for frozen in ((student,), (teacher,), (student, teacher)):
            got = stage_memory(student, layout, dataclasses.replace(plain, frozen=frozen), stage)
            own = dataclasses.replace(layout, virtual_stages=1)  # a frozen model: one chunk per rank
            want = sum(2 * stage_params(cfg, own, stage).numel for cfg in frozen)  # bf16
            assert got.params - base.params == want > 0
            assert got.total - base.total == want


def _plan(capsys, *extra) -> dict:
    from tpzoo.cli import main

    assert main(["plan", "--model", "llama-3-8b", "--gpus", "8", "--gpu-memory", "80", "--seq-len", "4096",
                 "--global-batch-size", "64", "--tp", "2", "--pp", "2", "--recompute", "none", "--max-micro-batch", "1",
                 "--json", *extra]) == 0
    return json.loads(capsys.readouterr().out)


def test_plan_cli_holds_a_reference_only_where_dpo_needs_one(capsys):
    def params(*extra):  # the parameters' GiB of one layout (tp 2, pp 2, one chunk per rank)
        plan = _plan(capsys, "--top", "1000", *extra)
        return next(e["memory_gib"]["params"] for e in plan["recommended"] if e["layout"]["virtual_stages"] == 1)

    lm, dpo = params(), params("--objective", "dpo")
    assert dpo > lm
    assert params("--objective", "dpo", "--dpo-precompute-ref") == lm
    lora = params("--lora-rank", "16")
    assert params("--objective", "dpo", "--lora-rank", "16") == lora
    assert params("--objective", "distill") == lm  # a cache: no teacher held
    assert lm < params("--objective", "distill", "--teacher", "llama-3-8b") == dpo
