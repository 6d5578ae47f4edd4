"""Backend selection for tpzoo.kernels: Triton kernels or the plain torch references.

    auto    (default) for CUDA tensors, whichever of Triton and torch measured faster for this kernel and shape
            class (tpzoo.kernels.autotune: timed once per class and process, kept on disk; torch when Triton
            does not import); the torch reference for CPU tensors, and inside a region torch.compile traces
            (inductor generates fused kernels from the references; tpzoo.train.compile).
    triton  always Triton. CPU tensors then need Triton's interpreter: TRITON_INTERPRET=1 in the environment
            before the first kernel runs in the process (Triton reads it when the kernels are defined).
    torch   always the torch reference.

Chosen, highest priority first, by `use_backend(name, kernel=...)` (process-wide; also a context manager that
restores the previous choice on exit), then the environment variable TPZOO_KERNELS, then "auto". Either may
name one kernel: `use_backend("torch", kernel="layer_norm")`, TPZOO_KERNELS="auto,layer_norm=torch" (a bare
name sets every kernel, `kernel=backend` one of them; the kernel's own setting wins). Inputs a kernel does not
cover (float64, broadcasting operands, mixed dtypes, empty tensors, cos/sin that need a gradient) take the
reference under every backend.

Nothing here imports Triton at import time: the Triton modules load on the first call that needs them.
"""
from __future__ import annotations

import importlib
import os

import torch

from . import autotune

BACKENDS = ("auto", "triton", "torch")
KERNEL_NAMES = ("rms_norm", "layer_norm", "apply_rotary", "swiglu", "geglu", "bias_gelu", "cross_entropy",
                "fp8_cast",
                "gated_delta_rule", "kimi_delta_rule")  # the last two: flash-linear-attention's kernels (gated_delta_fla.py)
ENV_VAR = "TPZOO_KERNELS"

_overrides: dict[str | None, str] = {}  # use_backend's choices: None -> every kernel, name -> that kernel
_triton_ok: bool | None = None


def _check(name: str) -> str:
    if name not in BACKENDS:
        raise ValueError(f"unknown kernel backend {name!r}; choose one of {BACKENDS}")
    return name


def _check_kernel(kernel: str | None) -> str | None:
    if kernel is not None and kernel not in KERNEL_NAMES:
        raise ValueError(f"unknown kernel {kernel!r}; choose one of {KERNEL_NAMES}")
    return kernel


def _env_settings() -> dict[str | None, str]:
    """TPZOO_KERNELS parsed: {None: backend for every kernel, name: backend for that one}."""
    out: dict[str | None, str] = {}
    for item in os.environ.get(ENV_VAR, "").strip().lower().split(","):
        item = item.strip()
        if not item:
            continue
        kernel, _, backend = item.rpartition("=")
        if backend not in BACKENDS or (kernel and kernel not in KERNEL_NAMES):
            raise ValueError(f"{ENV_VAR}={os.environ[ENV_VAR]!r}: {item!r} is not one of {BACKENDS} nor "
                             f"kernel=backend with a kernel of {KERNEL_NAMES}")
        out[kernel or None] = backend
    return out


def get_backend(kernel: str | None = None) -> str:
    """The backend in force (for `kernel`, its own setting first): use_backend's, else $TPZOO_KERNELS's, else
    "auto"."""
    for settings in (_overrides, _env_settings()):
        if kernel is not None and kernel in settings:
            return settings[kernel]
        if None in settings:
            return settings[None]
    return "auto"


class use_backend:
    """Select the kernel backend for the whole process (or for one `kernel`): `use_backend("torch")`, or scoped:

        with tpzoo.kernels.use_backend("triton"):
            y = tpzoo.kernels.rms_norm(x, w, 1e-6)

    `use_backend(None)` drops the override ($TPZOO_KERNELS or "auto" apply again). Not thread-local.
    """

    def __init__(self, name: str | None, kernel: str | None = None):
        self.kernel = _check_kernel(kernel)
        self.previous = _overrides.get(self.kernel)
        self._set(None if name is None else _check(name))

    def _set(self, name: str | None) -> None:
        if name is None:
            _overrides.pop(self.kernel, None)
        else:
            _overrides[self.kernel] = name

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self._set(self.previous)


def triton_available() -> bool:
    """True when `import triton` works (tried once per process, on first need)."""
    global _triton_ok
    if _triton_ok is None:
        try:
            importlib.import_module("triton")
            _triton_ok = True
        except Exception:  # noqa: BLE001 - ImportError, or a broken install
            _triton_ok = False
    return _triton_ok


def interpreter_requested() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0").strip().lower() in ("1", "true", "yes", "on")


def _gpu_with_triton(ts: list) -> bool:
    """`auto` considers Triton: CUDA tensors and Triton importable (the CPU tests replace this)."""
    return all(t.is_cuda for t in ts) and triton_available()


def _compiling() -> bool:
    return getattr(getattr(torch, "compiler", None), "is_compiling", lambda: False)()


def _not_measurable() -> bool:
    """Inside torch.compile tracing or a CUDA-graph capture a trial would be traced or captured."""
    return _compiling() or (torch.cuda.is_available() and torch.cuda.is_current_stream_capturing())


def use_triton(*tensors: torch.Tensor | None, kernel: str | None = None, trial=None) -> bool:
    """Whether a call on these tensors takes the Triton kernel (None entries are skipped). Under `auto` with CUDA
    tensors: `kernel`'s measured choice for the class of the first tensor, `trial()` giving the two closures to
    time when the class is new (autotune.decide); without a trial, Triton."""
    backend = get_backend(kernel)
    if backend == "torch":
        return False
    ts = [t for t in tensors if t is not None]
    if backend == "auto":
        if not _gpu_with_triton(ts) or _compiling():  # compiled regions: inductor fuses the references itself
            return False
        if kernel is None or trial is None or not ts:
            return True
        key = autotune.shape_class(kernel, ts[0])
        if _not_measurable():
            return autotune.decided(key) != "torch"
        return autotune.decide(key, trial) == "triton"
    if not triton_available():
        raise RuntimeError(f"kernel backend 'triton' was forced ({ENV_VAR} or use_backend) but Triton does not "
                           "import; install triton or use the 'torch' backend")
    return True


def load(name: str, *tensors: torch.Tensor):
    """Import the Triton module `tpzoo.kernels.<name>` and check it can run on these tensors."""
    module = importlib.import_module(f"{__package__}.{name}")
    if not module.INTERPRETED and not all(t.is_cuda for t in tensors if t is not None):
        why = ("TRITON_INTERPRET=1 was set only after the Triton kernels were loaded in this process"
               if interpreter_requested() else "set TRITON_INTERPRET=1 before the first kernel call")
        raise RuntimeError("Triton kernels on CPU tensors need Triton's interpreter: " + why +
                           " (or use the 'torch' backend)")
    return module
