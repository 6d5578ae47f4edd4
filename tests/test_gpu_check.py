"""scripts/gpu_check.sh --cpu: every phase of the GPU acceptance check at toy sizes on the CPU (the kernels in
Triton's interpreter against their references, a pretrain whose loss falls, tp=2 on two ranks sharing the
device with tp=1's losses, with and without SP; a LoRA fine-tune exported to PEFT; the training step against
transformers, scripts/bench/gpu_step.py), so the script a user runs on a GPU node is exercised in CI."""
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_gpu_check_cpu_mode_passes_every_phase(tmp_path):
    proc = subprocess.run(["bash", "scripts/gpu_check.sh", "--cpu", "--out", str(tmp_path)], cwd=ROOT,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = (tmp_path / "gpu_check.md").read_text()
    for phase in ("env", "tests", "kernels", "pretrain", "step", "tp2", "lora"):
        assert f"**{phase}** (ok," in report, report
    assert "CPU sanity check passed" in report and "tp2-sp (2 ranks" in report and "PEFT adapter" in report
    assert "| tpzoo |" in report and "| hf-bf16 |" in report  # the step side by side with transformers
