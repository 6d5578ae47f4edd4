"""What a training run reports: throughput, TFLOP/s and MFU, peak memory, and where the numbers go (a progress bar
and log lines on rank 0, metrics.jsonl, TensorBoard events when tensorboard is installed)."""
from __future__ import annotations

import json
import math
import os
import sys
import time
from pathlib import Path

import torch

from tpzoo.progress import bars_disabled, human_count, progress_bar

# Dense peak TFLOP/s per device (no sparsity), by a substring of torch.cuda.get_device_name(); first match wins,
# so more specific names come first. bf16 = tensor-core bf16; fp32 = what fp32 matmuls get by default (TF32
# tensor cores are off by default in PyTorch, so plain fp32 FMA throughput).
KNOWN_PEAK_TFLOPS = [
    ("H200", {"bf16": 989.0, "fp32": 67.0}),
    ("H100 PCIe", {"bf16": 756.0, "fp32": 51.0}),
    ("H100", {"bf16": 989.0, "fp32": 67.0}),
    ("GH200", {"bf16": 989.0, "fp32": 67.0}),
    ("B200", {"bf16": 2250.0, "fp32": 80.0}),
    ("A100", {"bf16": 312.0, "fp32": 19.5}),
    ("A10G", {"bf16": 70.0, "fp32": 35.0}),
    ("A10", {"bf16": 125.0, "fp32": 31.2}),
    ("L40S", {"bf16": 362.0, "fp32": 91.6}),
    ("L4", {"bf16": 121.0, "fp32": 30.3}),
    ("RTX 4090", {"bf16": 165.2, "fp32": 82.6}),
    ("RTX 3090", {"bf16": 71.0, "fp32": 35.6}),
    ("V100", {"bf16": 0.0, "fp32": 15.7}),   # no bf16 tensor cores
    ("T4", {"bf16": 0.0, "fp32": 8.1}),
]


def device_name(device: torch.device | None = None) -> str:
    device = torch.device(device) if device is not None else torch.device("cpu")
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return device.type


def peak_tflops(dtype: str, name: str | None = None) -> float | None:
    """The device's dense peak for `dtype` ('bf16' | 'fp16' | 'fp32'), or None when unknown (every CPU). fp16
    tensor cores run at the bf16 rate on the GPUs listed (V100, which has no bf16, is fp32-only here)."""
    dtype = "bf16" if dtype == "fp16" else dtype
    name = name if name is not None else device_name()
    for key, peaks in KNOWN_PEAK_TFLOPS:
        if key in name:
            return peaks.get(dtype) or None
    return None


def peak_memory_gb(device: torch.device | None = None) -> float:
    """Peak memory of this rank: the CUDA allocator's peak on its GPU, else the process's peak resident set."""
    if device is not None and torch.device(device).type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2 ** 30
    try:
        import resource

        kb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux
        return kb / 2 ** 20 if sys.platform != "darwin" else kb / 2 ** 30
    except ImportError:  # Windows
        return float("nan")


class Throughput:
    """Tokens/s, TFLOP/s per device and MFU over a window of steps."""

    def __init__(self, flops_per_token: float, world_size: int, dtype: str, device: torch.device | None = None):
        self.flops_per_token, self.world_size = flops_per_token, world_size
        self.peak = peak_tflops(dtype, device_name(device))
        self.reset()

    def reset(self) -> None:
        self.tokens, self.seconds = 0, 0.0

    def add(self, tokens: int, seconds: float) -> None:
        self.tokens += tokens
        self.seconds += seconds

    def summary(self) -> dict:
        tps = self.tokens / self.seconds if self.seconds > 0 else 0.0
        tflops = tps * self.flops_per_token / self.world_size / 1e12
        return {"tokens_per_s": tps, "tflops_per_device": tflops,
                "mfu": (tflops / self.peak) if self.peak else None}


def format_line(m: dict) -> str:
    """One human-readable log line from a metrics dict."""
    mfu = f"{100 * m['mfu']:.1f}%" if m.get("mfu") is not None else "n/a"
    parts = [f"step {m['step']:>6d}", f"loss {m['loss']:.4f}", f"grad_norm {m['grad_norm']:.3f}",
             f"lr {m['lr']:.2e}", f"tok/s {m['tokens_per_s']:,.0f}", f"TFLOP/s/dev {m['tflops_per_device']:.3f}",
             f"MFU {mfu}", f"mem {m['peak_mem_gb']:.2f}GB", f"data_wait {100 * m['data_wait']:.1f}%"]
    if m.get("mtp_loss") is not None:  # multi-token prediction (tpzoo.models.mtp): its depths' mean loss
        parts.insert(2, f"mtp_loss {m['mtp_loss']:.4f}")
    if "rewards/accuracies" in m:  # DPO (tpzoo.post.dpo): TRL's reward accuracy and margin
        parts.append(f"acc {m['rewards/accuracies']:.3f} margin {m['rewards/margins']:.4f}")
    if "distill/kl" in m:  # distillation (tpzoo.post.distill): the sparse KL and the next-token loss per token
        parts.append(f"kl {m['distill/kl']:.4f} ce {m['distill/ce']:.4f}")
    if "dsa_indexer_loss" in m:  # DeepSeek Sparse Attention's indexers trained (models/kinds/sparse_mla_indexer.py)
        parts.append(f"indexer_kl {m['dsa_indexer_loss']:.4f}")
    if m.get("max_attn_logit") is not None:  # MuonClip (tpzoo.train.qk_clip): the step's largest logit
        parts.append(f"max_logit {m['max_attn_logit']:.2f}")
    if "sync_bytes" in m:  # replicas (tpzoo.train.diloco): sent across them by this rank, seconds blocked on it
        parts.append(f"sync {m['sync_bytes'] / 1e6:.3f} MB {m['sync_s']:.3f}s")
    seen = {k.split("/", 1)[1]: v for k, v in m.items() if k.startswith("tokens_seen/")}
    if seen:  # a mixture's tokens per source so far
        parts.append("seen " + " ".join(f"{name} {human_count(v, 1)}" for name, v in seen.items()))
    if m.get("skipped"):
        parts.append(f"SKIPPED({m['skipped']})")
    return " | ".join(parts)


WINDOW_MEANS = ("loss", "mtp_loss", "sync_bytes", "sync_s", "rewards/accuracies", "rewards/margins", "distill/kl",
                "distill/ce")


def window_means(window: list[dict]) -> dict:
    """The metrics a log line averages over its interval (the others are the last step's)."""
    return {k: sum(w[k] for w in window) / len(window) for k in WINDOW_MEANS if k in window[-1]}


def eval_text(m: dict) -> str:
    """' | eval 2.3456' (and a mixture's per-source losses) for a log line; '' without an evaluation."""
    if m.get("eval_loss") is None:
        return ""
    per = [f"{k.split('/', 1)[1]} {v:.4f}" for k, v in m.items() if k.startswith("eval_loss/") and v is not None]
    mtp = f" mtp {m['eval_mtp_loss']:.4f}" if m.get("eval_mtp_loss") is not None else ""
    return f" | eval {m['eval_loss']:.4f}{mtp}" + (f" ({', '.join(per)})" if per else "")


class MetricsLogger:
    """Rank 0 only (other ranks get a logger whose methods do nothing): progress bar, lines, jsonl, TensorBoard."""

    def __init__(self, enabled: bool, log_dir: str | None, total_steps: int, start_step: int, progress: bool,
                 resume: bool = False, quiet: bool = False):
        self.enabled, self.quiet = enabled, quiet
        self.jsonl = self.tb = self.bar = None
        if not enabled:
            return
        if log_dir:
            Path(log_dir).mkdir(parents=True, exist_ok=True)
            # Always appended, never truncated: a resumed run continues the curve (rows of steps after the
            # checkpoint, from the interrupted run, are superseded by later rows of that step), and a fresh run
            # only gets here once tpzoo.train.rundir has made sure the directory holds no other run's metrics.
            self.jsonl = JsonlAppender(os.path.join(log_dir, "metrics.jsonl"))
            try:
                from torch.utils.tensorboard import SummaryWriter

                self.tb = SummaryWriter(log_dir=log_dir, purge_step=start_step + 1 if resume else None)
            except ImportError:  # tensorboard is optional
                self.tb = None
        if progress and sys.stderr.isatty() and not bars_disabled():  # \r redraws need a terminal
            self.bar = progress_bar(total=total_steps, initial=start_step, desc="train", unit="step",
                                    dynamic_ncols=True, file=sys.stderr, mininterval=0.5)
        self._t0 = time.perf_counter()

    def step(self, m: dict) -> None:
        if not self.enabled:
            return
        if self.jsonl:
            self.jsonl.write_row({k: _jsonable(v) for k, v in m.items()})
        if self.tb:
            for k in ("loss", "mtp_loss", "lr", "grad_norm", "tokens_per_s", "tflops_per_device", "eval_loss",
                      "eval_mtp_loss", "max_attn_logit", "dsa_indexer_loss",
                      *(k for k in m if k.startswith(("eval_loss/", "tokens_seen/", "rewards/", "logps/", "distill/",
                                                      "eval_rewards/", "eval_logps/")))):
                if m.get(k) is not None and isinstance(m[k], (int, float)) and math.isfinite(m[k]):
                    self.tb.add_scalar(_tb_tag(k), m[k], m["step"])
        if self.bar:
            self.bar.update(1)
            self.bar.set_postfix(loss=f"{m['loss']:.4f}", lr=f"{m['lr']:.2e}", tok_s=f"{m['tokens_per_s']:,.0f}",
                                 refresh=False)

    def close_bar(self) -> None:
        if self.bar:
            self.bar.close()
            self.bar = None

    def print(self, text: str) -> None:
        if not self.enabled or self.quiet:
            return
        if self.bar:
            self.bar.write(text, file=sys.stdout)
        else:
            print(text, flush=True)
        sys.stdout.flush()

    def close(self) -> None:
        if self.bar:
            self.bar.close()
        if self.jsonl:
            self.jsonl.close()
        if self.tb:
            self.tb.close()
        self.bar = self.jsonl = self.tb = None


class JsonlAppender:
    """A JSON-lines file written one whole line per write() system call, in append mode: a crash can tear at
    most the last line, and a reader never sees half of a line that was written before. On open, a torn last
    line left by an earlier writer is ended with a newline, so that the new rows start on a line of their own
    (the torn bytes stay, and readers skip them with a warning)."""

    def __init__(self, path: str):
        self.path = path
        self.fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        size = os.path.getsize(path)
        if size:
            with open(path, "rb") as f:
                f.seek(size - 1)
                torn = f.read(1) != b"\n"
            if torn:
                self._write(b"\n")

    def _write(self, data: bytes) -> None:
        view = memoryview(data)
        while view:  # a regular file takes it all at once unless the disk is full (then write raises)
            view = view[os.write(self.fd, view):]

    def write_row(self, row: dict) -> None:
        self._write((json.dumps(row) + "\n").encode())

    def close(self) -> None:
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None


def _tb_tag(key: str) -> str:
    if key.startswith("eval_"):  # eval_loss -> eval/loss, eval_loss/web -> eval/loss/web, eval_rewards/chosen ...
        return "eval/" + key[len("eval_"):]
    return f"data/{key}" if key.startswith("tokens_seen/") else f"train/{key}"


def _jsonable(v):
    if isinstance(v, float) and not math.isfinite(v):
        return str(v)  # JSON has no NaN/inf
    return v


def read_metrics(log_dir: str) -> list[dict]:
    """The rows of metrics.jsonl, one per step; for a step logged twice (a run resumed from an earlier
    checkpoint) the later row wins. A line that is not a row (a torn last line from a crash or from a run still
    writing, or one an earlier crash tore) is skipped with a warning naming the file and the line."""
    from .rundir import warn

    path = os.path.join(log_dir, "metrics.jsonl")
    with open(path, "rb") as f:
        lines = f.read().split(b"\n")  # the last item is b"" when the file ends with a newline, else torn
    rows: dict[int, dict] = {}
    for number, raw in enumerate(lines, 1):
        if not raw.strip():
            continue
        try:
            r = json.loads(raw)
            rows[int(r["step"])] = r
        except (ValueError, KeyError, TypeError):
            what = "a torn last line (an interrupted write)" if number == len(lines) else "not a metrics row"
            warn(f"{path} line {number}: {what}: skipped")
    return [rows[s] for s in sorted(rows)]
