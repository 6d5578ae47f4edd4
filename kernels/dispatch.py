"""Backend selection for tpzoo.kernels: Triton kernels or the plain torch references.

    auto    (default) Triton for CUDA tensors when `import triton` works; the torch reference otherwise.
    triton  always Triton. CPU tensors then need Triton's interpreter: TRITON_INTERPRET=1 in the environment
            before the first kernel runs in the process (Triton reads it when the kernels are defined).
    torch   always the torch reference.

Chosen, highest priority first, by `use_backend(name)` (process-wide; also a context manager that restores the
previous choice on exit), then the environment variable TPZOO_KERNELS, then "auto". Inputs a kernel does not
cover (float64, broadcasting operands, mixed dtypes, empty tensors, cos/sin that need a gradient) take the
reference under every backend.

Nothing here imports Triton at import time: the Triton modules load on the first call that needs them.
"""
from __future__ import annotations

import importlib
import os

import torch

BACKENDS = ("auto", "triton", "torch")
ENV_VAR = "TPZOO_KERNELS"

_override: str | None = None
_triton_ok: bool | None = None


def _check(name: str) -> str:
    if name not in BACKENDS:
        raise ValueError(f"unknown kernel backend {name!r}; choose one of {BACKENDS}")
    return name


def get_backend() -> str:
    """The backend in force: use_backend's choice, else $TPZOO_KERNELS, else "auto"."""
    if _override is not None:
        return _override
    env = os.environ.get(ENV_VAR, "").strip().lower()
    if not env:
        return "auto"
    if env not in BACKENDS:
        raise ValueError(f"{ENV_VAR}={env!r} is not one of {BACKENDS}")
    return env


class use_backend:
    """Select the kernel backend for the whole process: `use_backend("torch")`, or scoped:

        with tpzoo.kernels.use_backend("triton"):
            y = tpzoo.kernels.rms_norm(x, w, 1e-6)

    `use_backend(None)` drops the override ($TPZOO_KERNELS or "auto" apply again). Not thread-local.
    """

    def __init__(self, name: str | None):
        global _override
        self.previous = _override
        _override = None if name is None else _check(name)

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        global _override
        _override = self.previous


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


def use_triton(*tensors: torch.Tensor | None) -> bool:
    """Whether a call on these tensors takes the Triton kernel (None entries are skipped)."""
    backend = get_backend()
    if backend == "torch":
        return False
    ts = [t for t in tensors if t is not None]
    if backend == "auto":
        return all(t.is_cuda for t in ts) and triton_available()
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
