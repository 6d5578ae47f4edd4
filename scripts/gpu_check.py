"""GPU acceptance check: prove a tpzoo install on a fresh GPU node in one command (scripts/gpu_check.sh).

Phases (each timed; a failing phase is reported and the others still run; the exit code is non-zero if any failed):
  env       torch / CUDA / Triton versions and the device
  tests     the test suite's CUDA tests (pytest -m cuda; skipped with --cpu): compiled Triton kernels against their
            references, a training step with every buffer on the GPU, load + generate on the GPU against transformers
  kernels   scripts/bench/kernels.py: every Triton kernel against eager torch (bf16, time and bandwidth)
  pretrain  a short bf16 pretrain of a ~1B Llama-class model (llama-3.2-1b shapes) with the Triton kernels on:
            tokens/s, TFLOP/s per GPU and MFU from the steady-state steps
  step      scripts/bench/gpu_step.py, short: the 1B step of tpzoo against transformers (bf16, + autocast,
            + torch.compile, + Liger when installed) side by side, tokens/s, MFU, peak memory, and tpzoo's step
            split by category
  tp2       tp=2 on two ranks sharing the GPU(s) (gloo, tensors staged through the host when one GPU is shared)
            against tp=1 on the same data: equal losses, with and without sequence parallelism (the column
            layers' asynchronous re-gather in backward)
  lora      LoRA fine-tuning of a small HF Llama at tp=2 + SP (bf16 on the GPU): the loss falls, the checkpoint
            holds only the adapters, and `convert to-hf` writes a PEFT adapter directory
  nccl      with 2 or more GPUs, one rank per GPU on NCCL (scripts/multi_gpu_check.py): tp=2, tp=2 + SP, pp=2
            (1F1B, zero-bubble), dp=2 at ZeRO-1 and ZeRO-3 (overlapped reduction, prefetch), cp=2 (ring,
            all-to-all), ep=2 (tiny mixture of experts) against one rank's losses, generate at tp=2 against tp=1,
            each also in strict collective mode; and the all-reduce bus bandwidth. With one GPU: skipped (never
            reported as passed). With --cpu: the same runs on 2 gloo ranks.

    bash scripts/gpu_check.sh                      # on a GPU node (about 5-8 minutes on one H100/H200)
    bash scripts/gpu_check.sh --cpu                # the same phases at toy sizes on CPU (CI runs this)
    python scripts/gpu_check.py --only pretrain --steps 40

Results: a markdown summary printed at the end and written to OUT/gpu_check.md (default OUT: runs/gpu_check), to
paste into docs/benchmarks.md with the GPU named.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PHASES = ("env", "tests", "kernels", "pretrain", "step", "tp2", "lora", "nccl")


class Skipped(Exception):
    """A phase this machine cannot run (reported as skipped, never as passed)."""


def _run(cmd: list[str], log: Path, env: dict | None = None, timeout: float = 900) -> str:
    """Run a command (from the repository root), tee its output to `log`; raise with the tail if it fails."""
    print("  $ " + " ".join(cmd), flush=True)
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, **(env or {})})
    out = proc.stdout + proc.stderr
    log.write_text(out)
    if proc.returncode != 0:
        raise RuntimeError(f"exit code {proc.returncode}; last lines of {log}:\n" + "\n".join(out.splitlines()[-25:]))
    return out


def _tpzoo(*args: str) -> list[str]:
    return [sys.executable, "-m", "tpzoo", *args]


def phase_env(a, out: Path) -> list[str]:
    import torch

    lines = [f"torch {torch.__version__}, CUDA {torch.version.cuda}, Python {sys.version.split()[0]}"]
    try:
        import triton

        lines.append(f"triton {triton.__version__}")
    except ImportError:
        lines.append("triton: not installed (the Triton kernels fall back to torch)")
    if a.cpu:
        lines.append("device: cpu (--cpu: toy sizes)")
    else:
        if not torch.cuda.is_available():
            raise RuntimeError("CUDA is not available: run with --cpu for the CPU version of this check")
        for i in range(torch.cuda.device_count()):
            p = torch.cuda.get_device_properties(i)
            lines.append(f"cuda:{i}: {p.name}, {p.total_memory / 2**30:.0f} GiB, {p.multi_processor_count} SMs")
    return lines


def phase_tests(a, out: Path) -> list[str]:
    if a.cpu:
        raise Skipped("the CUDA tests need a GPU (CI runs the rest of the suite)")
    text = _run([sys.executable, "-m", "pytest", "-q", "-m", "cuda", "-p", "no:cacheprovider", "tests"],
                out / "tests.log")
    return [text.strip().splitlines()[-1]]


def phase_kernels(a, out: Path) -> list[str]:
    cmd = [sys.executable, "scripts/bench/kernels.py"]
    if not a.cpu:  # moderate shapes: every kernel compiled and timed in about a minute
        cmd += ["--no-compile", "--tokens", "8192", "--seq", "2048"]
    text = _run(cmd, out / "kernels.log", env={"TRITON_INTERPRET": "1"} if a.cpu else None)
    if a.cpu:
        if "CPU sanity check passed" not in text and "Triton is not installed" not in text:
            raise RuntimeError("the Triton kernels (interpreter) do not match their references:\n" + text)
        return [line.strip() for line in text.splitlines() if "max |triton" in line or "sanity check" in line]
    rows = [line for line in text.splitlines() if line.startswith(("|", "#"))]
    if any("failed" in r for r in rows):
        raise RuntimeError("a kernel failed:\n" + "\n".join(rows))
    return rows


def _pretrain_args(a, model: str, dtype: str, seq: int, micro: int, steps: int, log_dir: Path) -> list[str]:
    """A pretrain on the byte tokenizer: the stdlib corpus on a GPU, one stdlib file on the CPU (quicker)."""
    import sysconfig

    data = ["--data", str(Path(sysconfig.get_paths()["stdlib"]) / "textwrap.py")] if a.cpu else []
    return ["pretrain", "--model", model, "--dtype", dtype, "--seq-len", str(seq), "--micro-batch-size", str(micro),
            "--global-batch-size", str(micro), "--steps", str(steps), "--warmup-steps", "2", "--save", "",
            "--sample-prompt", "", "--log-dir", str(log_dir), "--log-interval", "5", "--eval-fraction", "0",
            "--no-progress", "--data-cache", str(log_dir.parent / "data"), "--seed", "0", "--overwrite", *data]


def _metrics(log_dir: Path) -> list[dict]:
    with open(log_dir / "metrics.jsonl") as f:
        return [json.loads(line) for line in f if line.strip()]


def phase_pretrain(a, out: Path) -> list[str]:
    from tpzoo.data import load_tokenizer
    from tpzoo.models import get_config
    from tpzoo.train.metrics import peak_tflops

    if a.cpu:
        model, dtype, seq, micro, steps, vocab = "tiny-llama", "fp32", 64, 2, 6, 0
    else:
        model, dtype, seq, micro, steps, vocab = "llama-3.2-1b", "bf16", 2048, 4, a.steps, 128256
    log_dir = out / "pretrain"
    args = _pretrain_args(a, model, dtype, seq, micro, steps, log_dir) + ["--tp", "1"]
    if vocab:  # the byte tokenizer's ids fit any vocabulary; keep the real one for a realistic head and loss
        args += ["--vocab-size", str(vocab)]
    env = {} if a.cpu else {"TPZOO_KERNELS": "triton"}  # the Triton kernels must really run
    _run(_tpzoo(*args), out / "pretrain.log", env=env)
    rows = _metrics(log_dir)
    steady = rows[min(3, len(rows) - 1):]  # the first steps pay compilation and allocation
    step_time = statistics.median(r["step_time"] for r in steady)
    tokens_per_s = micro * seq / step_time
    cfg = get_config(model).replace(vocab_size=vocab or load_tokenizer("byte").vocab_size)
    tflops = tokens_per_s * cfg.flops_per_token(seq) / 1e12
    peak = None if a.cpu else peak_tflops(dtype, _device_name())
    mfu = f"{100 * tflops / peak:.1f} %" if peak else "n/a"
    losses = [r["loss"] for r in rows]
    if not all(map(_finite, losses)) or losses[-1] >= losses[0]:
        raise RuntimeError(f"the loss did not fall: {losses}")
    n = cfg.num_parameters()
    size = f"{n / 1e9:.2f}B" if n >= 1e9 else f"{n / 1e6:.1f}M"
    return [f"{model} ({size} params) {dtype}, seq {seq}, micro-batch {micro}, "
            f"{len(rows)} steps: loss {losses[0]:.3f} -> {losses[-1]:.3f}",
            f"steady state (median of {len(steady)} steps): {step_time * 1e3:.0f} ms/step, {tokens_per_s:,.0f} "
            f"tokens/s, {tflops:.1f} TFLOP/s per GPU, MFU {mfu}, peak memory {rows[-1]['peak_mem_gb']:.1f} GB"]


def phase_step(a, out: Path) -> list[str]:
    cmd = [sys.executable, "scripts/bench/gpu_step.py", "--profile"]
    cmd += (["--device", "cpu", "--model", "nano-llama", "--micro", "2", "--seq", "64", "--steps", "2", "--warmup", "1",
             "--impls", "tpzoo", "hf-bf16"] if a.cpu else ["--steps", "5", "--warmup", "3"])
    text = _run(cmd, out / "step.log", timeout=1800)
    return [line for line in text.splitlines() if line.startswith(("|", "tpzoo"))]


def phase_tp2(a, out: Path) -> list[str]:
    model, steps = ("tiny-llama", 4) if a.cpu else ("tiny-llama", 8)
    device = ["--device", "cpu"] if a.cpu else []
    losses = {}
    for name, flags in (("tp1", ["--tp", "1"]), ("tp2", ["--tp", "2"]), ("tp2-sp", ["--tp", "2", "--sequence-parallel"])):
        log_dir = out / name
        args = _pretrain_args(a, model, "fp32", 64, 2, steps, log_dir) + flags + device
        _run(_tpzoo(*args), out / f"{name}.log")  # tp=2 self-spawns 2 ranks sharing the device
        losses[name] = [r["loss"] for r in _metrics(log_dir)]
    lines = []
    for name in ("tp2", "tp2-sp"):
        worst = max(abs(x - y) for x, y in zip(losses["tp1"], losses[name]))
        if len(losses["tp1"]) != len(losses[name]) or worst > 1e-4:
            raise RuntimeError(f"{name} and tp=1 disagree (max |diff| {worst:.2e}): {losses}")
        lines.append(f"{name} (2 ranks on one device) vs tp=1, {model} fp32, {steps} steps: max |loss diff| "
                     f"{worst:.1e}")
    return lines


def phase_lora(a, out: Path) -> list[str]:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    base, sft, save = out / "lora-base", out / "lora-sft.jsonl", out / "lora-run"
    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(vocab_size=272, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                 num_attention_heads=4, num_key_value_heads=2)).save_pretrained(base)
    words = ["apple", "river", "stone", "cloud", "green", "tiger", "piano", "lemon"]
    sft.write_text("".join(json.dumps({"prompt": f"Join {a} and {b}.", "response": f"{a}-{b}"}) + "\n"
                           for a in words for b in words))
    dtype = "fp32" if a.cpu else "bf16"
    args = ["finetune", "--base", str(base), "--data", str(sft), "--lora-rank", "8", "--lora-alpha", "16",
            "--tp", "2", "--sequence-parallel", "--seq-len", "64", "--micro-batch-size", "4",
            "--global-batch-size", "8", "--steps", "8", "--lr", "3e-3", "--dtype", dtype, "--save", str(save),
            "--log-dir", str(save / "logs"), "--no-progress", "--overwrite", "--seed", "0"] + (
                ["--device", "cpu"] if a.cpu else [])
    _run(_tpzoo(*args), out / "lora.log")
    rows = _metrics(save / "logs")
    losses = [r["loss"] for r in rows]
    if not all(map(_finite, losses)) or losses[-1] >= losses[0]:
        raise RuntimeError(f"the LoRA loss did not fall: {losses}")
    ckpt = sorted(save.glob("step_*"))[-1]
    tensors = json.loads((ckpt / "manifest.json").read_text())["tensors"]
    if not tensors or not all(".lora." in n for n in tensors):
        raise RuntimeError(f"the LoRA checkpoint holds more than adapters: {sorted(tensors)[:4]}")
    _run(_tpzoo("convert", "to-hf", str(ckpt), str(out / "lora-peft"), "--force"), out / "lora-export.log")
    if not (out / "lora-peft" / "adapter_model.safetensors").is_file():
        raise RuntimeError("convert to-hf wrote no PEFT adapter")
    return [f"LoRA r=8 at tp=2 + SP, {dtype}, {len(rows)} steps: loss {losses[0]:.3f} -> {losses[-1]:.3f}, "
            f"{len(tensors)} adapter tensors saved, exported as a PEFT adapter; peak memory "
            f"{rows[-1]['peak_mem_gb']:.2f} GB"]


def phase_nccl(a, out: Path) -> list[str]:
    import torch

    gpus = 0 if a.cpu else torch.cuda.device_count()
    if not a.cpu and gpus < 2:
        raise Skipped(f"the NCCL phases need 2 GPUs ({gpus} visible): tp/pp/dp/cp/ep on NCCL not checked")
    cmd = [sys.executable, "scripts/multi_gpu_check.py", "--out", str(out / "nccl")] + (["--cpu"] if a.cpu else [])
    cmd += ["--layouts", *a.layouts] if a.layouts else []
    try:
        text = _run(cmd, out / "nccl.log", timeout=1200)
    except RuntimeError as e:  # the table says which layouts failed
        table = (out / "nccl.log").read_text() if (out / "nccl.log").exists() else ""
        raise RuntimeError(str(e).splitlines()[0] + "\n" + "\n".join(
            line for line in table.splitlines() if line.startswith("|") and "FAILED" in line)) from None
    return [line for line in text.splitlines() if line.startswith(("|", "all-reduce")) or "against one rank" in line]


def _device_name() -> str:
    import torch

    return torch.cuda.get_device_name(0)


def _finite(x) -> bool:
    return isinstance(x, (int, float)) and x == x and abs(x) != float("inf")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--cpu", action="store_true", help="run every phase at toy sizes on the CPU")
    p.add_argument("--out", default="runs/gpu_check", help="logs and gpu_check.md go here")
    p.add_argument("--steps", type=int, default=30, help="pretrain steps on the GPU")
    p.add_argument("--only", nargs="+", choices=PHASES, help="run only these phases")
    p.add_argument("--layouts", nargs="+", help="the nccl phase: only these layouts (scripts/multi_gpu_check.py)")
    a = p.parse_args(argv)
    out = Path(a.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    results, failed, skipped = [], [], []
    start = time.perf_counter()
    for name in a.only or PHASES:
        print(f"== {name}", flush=True)
        t0 = time.perf_counter()
        try:
            lines, status = globals()[f"phase_{name}"](a, out), "ok"
        except Skipped as e:
            lines, status = [str(e)], "skipped"
            skipped.append(name)
        except Exception as e:  # noqa: BLE001 - reported; the other phases still run
            lines, status = [f"{type(e).__name__}: {e}"], "FAILED"
            failed.append(name)
            traceback.print_exc()
        results.append((name, status, time.perf_counter() - t0, lines))
        print("\n".join(f"  {line}" for line in lines), flush=True)
    title = "CPU (toy sizes)" if a.cpu else _device_name()
    md = [f"## scripts/gpu_check.sh on {title}", "", f"Total {time.perf_counter() - start:.0f} s.", ""]
    for name, status, secs, lines in results:
        md.append(f"- **{name}** ({status}, {secs:.0f} s)")
        md += [f"    {line}" for line in lines]
    text = "\n".join(md) + "\n"
    (out / "gpu_check.md").write_text(text)
    print("\n" + text)
    passed = len(results) - len(failed) - len(skipped)
    print(f"gpu_check: {passed} phases passed" + (f", FAILED: {', '.join(failed)}" if failed else "")
          + (f", skipped: {', '.join(skipped)} (see above)" if skipped else ""))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
