"""`auto` by measurement: which implementation of a kernel runs, decided per kernel and shape class by timing both.

A name says nothing about speed: issue 24 measured the Triton LayerNorm 4x slower than torch's own on an H200,
and `auto` picked it by name. Under `auto`, the first time a kernel meets a *shape class* on CUDA,

    class = (kernel, dtype, last dim rounded up to a power of two, rows rounded up to a power of two, grad mode)

both implementations run forward + backward on random inputs of the call's shapes (rows capped so the trial
allocates at most CAP_ELEMENTS per input) for WARMUP + ITERS iterations, timed with CUDA events (median), and
the faster one is used for every later call of that class in the process (a Triton kernel whose trial raises,
e.g. one that needs more shared memory than this GPU has, loses it, with a warning). Decisions are also kept on disk (a
JSON file per GPU name, torch and Triton versions under $TPZOO_KERNEL_CACHE, default ~/.cache/tpzoo;
TPZOO_KERNEL_CACHE=off disables it), so a later process skips the trials.

Ranks must agree: tensor-parallel ranks compute replicated parts (norms of a replicated activation) whose
gradients are never synchronized, so two TP ranks taking different kernels would drift apart by rounding.
Each new decision therefore goes through `consensus` (by default: Triton only if every rank of the default
ParallelDims' TP group found it faster; one small all-reduce, issued on first sight of a class, which the TP
ranks of a stage reach in the same order since they run the same layers), whether it came from a trial or
the disk.

Not measured: CPU tensors (the reference runs), calls under torch.compile tracing or CUDA-graph capture (the
cached decision, or Triton), kernels whose call runs collectives (cross_entropy). Tests inject `timer` and
`consensus` (set_timer, set_consensus) to check the logic on CPU.
"""
from __future__ import annotations

import json
import os
import pathlib
import re
import statistics
import tempfile
import warnings
from typing import Callable

import torch

from tpzoo.errors import brief

WARMUP, ITERS = 2, 5
CAP_ELEMENTS = 1 << 25  # per trial input: 64 MiB in bf16

_decisions: dict[str, str] = {}  # class key -> "triton" | "torch", for this process
_trials = 0  # trials run in this process (tests, benchmarks)


def _cuda_timer(fn: Callable[[], None]) -> float:
    """Median seconds of fn() over ITERS calls after WARMUP, with CUDA events."""
    for _ in range(WARMUP):
        fn()
    times = []
    for _ in range(ITERS):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return statistics.median(times)


def _tp_consensus(key: str, triton: bool) -> bool:
    """Triton only if every rank of the default dims' TP group chose it (module docstring)."""
    from tpzoo.parallel import comm, state

    if not state.is_initialized():
        return triton
    dims = state.get_dims()
    if dims.tp == 1:
        return triton
    votes = torch.tensor([int(triton)], dtype=torch.int32, device=dims.device)
    return int(comm.all_reduce(votes, dims.tp_group).item()) == dims.tp


_timer: Callable[[Callable[[], None]], float] = _cuda_timer
_consensus: Callable[[str, bool], bool] = _tp_consensus


def set_timer(timer) -> Callable:
    """Replace how a trial is timed (timer(fn) -> seconds); returns the previous one. For tests."""
    global _timer
    previous, _timer = _timer, timer
    return previous


def set_consensus(fn) -> Callable:
    """Replace how ranks agree on a decision (fn(key, triton: bool) -> bool; None: no agreement); returns the
    previous one."""
    global _consensus
    previous, _consensus = _consensus, fn or (lambda key, triton: triton)
    return previous


def forget() -> None:
    """Drop this process's decisions (tests, benchmarks that want fresh trials)."""
    global _trials
    _decisions.clear()
    _trials = 0


def trials_run() -> int:
    return _trials


def _pow2(n: int) -> int:
    return 1 << max(0, int(n) - 1).bit_length()


def shape_class(kernel: str, x: torch.Tensor) -> str:
    """The class a call belongs to, from its main input: kernel, dtype, last dim and rows, both rounded up to a
    power of two; "|forward" without grad mode (inference is timed forward only, training forward + backward)."""
    n = x.shape[-1] if x.dim() else 1
    rows = x.numel() // max(n, 1)
    mode = "" if torch.is_grad_enabled() else "|forward"
    return f"{kernel}|{str(x.dtype).replace('torch.', '')}|n{_pow2(n)}|rows{_pow2(rows)}{mode}"


def _cache_file() -> pathlib.Path | None:
    where = os.environ.get("TPZOO_KERNEL_CACHE", "").strip()
    if where.lower() in ("off", "0", "none", "false"):
        return None
    if not torch.cuda.is_available():
        return None
    try:
        import triton

        triton_version = triton.__version__
    except Exception:  # noqa: BLE001 - no Triton: nothing to decide
        return None
    gpu = re.sub(r"[^A-Za-z0-9]+", "-", torch.cuda.get_device_name()).strip("-")
    base = pathlib.Path(where) if where else pathlib.Path.home() / ".cache" / "tpzoo"
    return base / f"kernel-dispatch-{gpu}-torch{torch.__version__}-triton{triton_version}.json"


def _read_disk(path: pathlib.Path | None) -> dict:
    if path is None:
        return {}
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}


def _write_disk(path: pathlib.Path | None, key: str, choice: str) -> None:
    """Merge one decision into the cache file, atomically (several ranks may write it at once)."""
    if path is None:
        return
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        data = {**_read_disk(path), key: choice}
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name, suffix=".tmp")
        with os.fdopen(fd, "w") as f:
            json.dump(data, f, indent=1, sort_keys=True)
        os.replace(tmp, path)
    except OSError:
        pass  # a read-only home: the process keeps its decisions in memory


def decided(key: str) -> str | None:
    """This process's decision for class `key`, if any."""
    return _decisions.get(key)


def decide(key: str, make_runs: Callable[[], tuple], cache_file=...) -> str:
    """"triton" or "torch" for class `key`: this process's decision, else the disk's, else a trial (time the two
    closures make_runs() returns: (run Triton, run torch), each forward + backward); every new decision passes
    the consensus and is remembered. cache_file: the disk cache's path (None: none; default: _cache_file())."""
    global _trials
    choice = _decisions.get(key)
    if choice is not None:
        return choice
    path = _cache_file() if cache_file is ... else cache_file
    choice = _read_disk(path).get(key)
    if choice not in ("triton", "torch"):
        _trials += 1
        run_triton, run_torch = make_runs()
        try:
            t_triton = _timer(run_triton)
        except Exception as exc:  # noqa: BLE001 - e.g. a block that needs more shared memory than this GPU has
            warnings.warn(f"tpzoo kernels: the Triton kernel failed its trial for {key} ({brief(exc)}); torch's op "
                          f"runs instead")
            t_triton = float("inf")
        t_torch = _timer(run_torch)
        choice = "triton" if t_triton <= t_torch else "torch"
        _write_disk(path, key, choice)
    choice = "triton" if _consensus(key, choice == "triton") else "torch"
    _decisions[key] = choice
    return choice


def trial_inputs(tensors: list, cut=()) -> list:
    """Random stand-ins for a call's tensor arguments, requires_grad as the originals (None and non-float
    tensors kept as they are): those at positions `cut` (row-shaped, all alike) cut along dim 0 to at most
    CAP_ELEMENTS each, the rest (weights, cos/sin) full."""
    out = []
    for i, t in enumerate(tensors):
        if not isinstance(t, torch.Tensor) or not t.is_floating_point():
            out.append(t)
            continue
        shape = list(t.shape)
        if i in cut and t.dim() > 1 and t.numel() > CAP_ELEMENTS:
            shape[0] = max(1, shape[0] * CAP_ELEMENTS // t.numel())
        out.append(torch.randn(shape, dtype=t.dtype, device=t.device).requires_grad_(t.requires_grad))
    return out


def fwd_bwd(fn: Callable, inputs: list) -> Callable[[], None]:
    """A closure running fn(*inputs) forward and, when some input requires a gradient (and grad mode is on),
    backward with an all-ones output gradient."""
    want = [t for t in inputs if isinstance(t, torch.Tensor) and t.requires_grad]
    grad_on = torch.is_grad_enabled()

    def run():
        # identity saved-tensor hooks: inside an activation-checkpointed forward the checkpoint's hooks would
        # otherwise drop the trial's saved tensors and recompute its forward within its own backward
        with torch.set_grad_enabled(grad_on), torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t):
            out = fn(*inputs)
            if want and grad_on:
                torch.autograd.grad(out, want, torch.ones_like(out))
    return run
