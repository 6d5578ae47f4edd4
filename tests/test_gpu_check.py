"""scripts/gpu_check.sh --cpu: every phase of the GPU acceptance check at toy sizes on the CPU (the kernels in
Triton's interpreter against their references, a pretrain whose loss falls, tp=2 on two ranks sharing the
device with tp=1's losses, with and without SP; a LoRA fine-tune exported to PEFT; the training step against
transformers, scripts/bench/gpu_step.py; the multi-GPU phase's layouts on 2 gloo ranks), so the script a user runs
on a GPU node is exercised in CI. With one GPU the multi-GPU phase is reported as skipped, never as passed."""
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
EVERY_LAYOUT = ("tp2", "tp2-sp", "pp2-1f1b", "pp2-zero-bubble", "dp2-zero1", "dp2-zero3", "cp2-ring", "cp2-a2a",
                "ep2-moe")


def _gpu_check_cpu(tmp_path, *args: str) -> str:
    proc = subprocess.run(["bash", "scripts/gpu_check.sh", "--cpu", "--out", str(tmp_path), *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return (tmp_path / "gpu_check.md").read_text()


def test_gpu_check_cpu_mode_passes_every_phase(tmp_path):
    """Every phase; the multi-GPU phase at two of its layouts (each layout is the parallelism tests' own; every
    layout runs in the slow tier below, that phase alone)."""
    report = _gpu_check_cpu(tmp_path, "--layouts", "tp2-sp", "ep2-moe")
    for phase in ("env", "kernels", "pretrain", "step", "tp2", "lora"):
        assert f"**{phase}** (ok," in report, report
    assert "**tests** (skipped," in report and "need a GPU" in report  # the CUDA tests: never reported as passed
    assert "CPU sanity check passed" in report and "tp2-sp (2 ranks" in report and "PEFT adapter" in report
    assert "| tpzoo |" in report and "| hf-bf16 |" in report  # the step side by side with transformers
    _check_nccl_phase(report, ("tp2-sp", "ep2-moe"))
    assert "| tp2 | plain |" not in report  # the phase ran the layouts it was given, no others


@pytest.mark.slow
def test_gpu_check_cpu_mode_runs_every_layout(tmp_path):
    """The multi-GPU phase alone, every layout."""
    _check_nccl_phase(_gpu_check_cpu(tmp_path, "--only", "nccl"), EVERY_LAYOUT)


def _check_nccl_phase(report: str, layouts) -> None:
    assert "**nccl** (ok," in report, report
    # the multi-GPU phase's runs, on 2 gloo ranks: each layout, plain and strict, equal to one rank
    for layout in (*layouts, "generate tp2"):
        for mode in ("plain", "strict"):
            assert f"| {layout} | {mode} | 2 |" in report, (layout, mode, report)
    assert "FAILED" not in report and "all-reduce bus bandwidth on the tp group" in report


def test_gpu_check_reports_the_nccl_phase_as_skipped_with_one_gpu(tmp_path, monkeypatch):
    import sys

    sys.path.insert(0, str(ROOT / "scripts"))
    import gpu_check
    import torch

    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(gpu_check, "_device_name", lambda: "one test GPU")
    assert gpu_check.main(["--only", "nccl", "--out", str(tmp_path)]) == 0
    report = (tmp_path / "gpu_check.md").read_text()
    assert "**nccl** (skipped," in report and "need 2 GPUs (1 visible)" in report and "(ok," not in report
