"""A CUDA out-of-memory error in training ends the job with one line that says what to do (tpzoo/train/oom.py):
the step, this rank's peak, what `tpzoo plan` estimates for the layout, and the flags that lower it; the last
checkpoint stays the latest and --resume continues from it. The error is injected on CPU (`inject_oom_steps`)
exactly where a GPU would raise it: inside the step."""
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

pytestmark = pytest.mark.faults


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    import sysconfig

    from tpzoo.data import iter_documents, preprocess

    lib = Path(sysconfig.get_paths()["stdlib"])
    return str(preprocess(iter_documents([str(lib / "textwrap.py")]), "byte",
                          tmp_path_factory.mktemp("data") / "store").path)


def test_out_of_memory_is_one_line_naming_the_step_the_plan_and_the_flags(store, tmp_path):
    save = tmp_path / "run"
    args = ["pretrain", "--model", "nano-llama", "--tp", "2", "--data", store, "--seq-len", "32",
            "--global-batch-size", "8", "--micro-batch-size", "4", "--steps", "6", "--warmup-steps", "2", "--seed",
            "0", "--eval-fraction", "0", "--save", str(save), "--save-every", "2", "--sample-prompt", "", "--quiet",
            "--device", "cpu"]
    env = {k: v for k, v in os.environ.items() if k not in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "MASTER_PORT")}
    run = subprocess.run([sys.executable, "-m", "tpzoo", *args, "--inject-oom-steps", "3"], capture_output=True,
                         text=True, cwd=tmp_path, env=env, timeout=300)
    assert run.returncode == 2 and "Traceback" not in run.stderr, run.stderr[-3000:]
    errors = [line for line in run.stderr.splitlines() if line.startswith("tpzoo pretrain: error:")]
    assert len(errors) == 1, run.stderr[-3000:]  # both ranks hit it: reported once
    line = errors[0]
    assert "step 3: out of GPU memory on rank" in line and "tpzoo plan estimates" in line, line
    assert "micro-batch 4 x 32, recompute none, zero 0" in line
    assert "--micro-batch-size 2" in line and "--recompute selective" in line and "--tp 4 or --pp 2" in line
    assert "The last checkpoint is intact: --resume continues from it" in line
    assert (save / "latest").read_text().strip() == "step_00000002"
    before = {p.name: p.read_bytes() for p in (save / "step_00000002").iterdir() if p.is_file()}
    resumed = subprocess.run([sys.executable, "-m", "tpzoo", *args, "--resume"], capture_output=True, text=True,
                             cwd=tmp_path, env=env, timeout=300)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert {p.name: p.read_bytes() for p in (save / "step_00000002").iterdir() if p.is_file()} == before
    assert (save / "latest").read_text().strip() == "step_00000006"


def test_the_flags_offered_follow_the_run():
    from tpzoo.train.oom import lowering_flags

    cfg = SimpleNamespace(micro_batch_size=1, global_batch_size=8, recompute="full", zero_level=3,
                          fused_linear_cross_entropy=False)
    dims = SimpleNamespace(tp=2, pp=1, dp=4, cp=1)
    flags = lowering_flags(cfg, dims)
    assert not any(f.startswith(("--micro-batch-size", "--recompute", "--zero")) for f in flags)
    assert flags[0].startswith("--tp 4 or --pp 2") and flags[-1].startswith("--fused-linear-cross-entropy")


def test_the_plan_estimate_in_the_message_is_the_plans_own():
    import tpzoo
    from tpzoo.models import get_config
    from tpzoo.plan import Layout, TrainingSpec
    from tpzoo.plan.memory import stage_memory
    from tpzoo.train import load_config
    from tpzoo.train.oom import plan_peak_gib

    cfg = load_config(None, dict(model="llama-3.2-1b", seq_len=2048, global_batch_size=8, micro_batch_size=4, tp=1,
                                 pp=1, dtype="bf16", data=["x"]))
    dims = tpzoo.parallel.ParallelDims.for_rank(device="cpu")
    want = stage_memory(get_config("llama-3.2-1b"), Layout(micro_batch_size=4),
                        TrainingSpec(seq_len=2048, global_batch_size=8, dtype="bf16", kernels="reference"), 0)
    assert plan_peak_gib(cfg, get_config("llama-3.2-1b"), dims) == pytest.approx(want.total / 2 ** 30)
