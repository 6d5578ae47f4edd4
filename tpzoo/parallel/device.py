"""The one place that chooses the device a rank computes on, and the backend its collectives use.

    auto (default)  cuda:LOCAL_RANK when CUDA is available (modulo the visible GPUs: several ranks may share
                    one), else cpu
    cpu | cuda | cuda:N   as asked (a CUDA request without CUDA is an error, not a silent CPU run)

Backend: nccl for CUDA devices, gloo for CPU. When several local ranks share one GPU (more ranks on the node
than visible GPUs; NCCL refuses two ranks on one device), gloo is used for CUDA tensors too: tpzoo's collectives
then stage them through host memory (`tpzoo.parallel.comm`). That is slow and meant for checks like
scripts/gpu_check.sh's "tp=2 on one GPU", not for training.
"""
from __future__ import annotations

import os

import torch

from tpzoo.errors import ConfigError


def local_rank() -> int:
    return int(os.environ.get("LOCAL_RANK", "0"))


def local_world_size() -> int:
    return int(os.environ.get("LOCAL_WORLD_SIZE", "1"))


def resolve_device(requested=None) -> torch.device:
    """The device for this rank: see the module docstring. `requested`: None/'auto', 'cpu', 'cuda', 'cuda:N'
    or a torch.device."""
    name = "auto" if requested is None else str(requested)
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    try:
        device = torch.device(name)
    except RuntimeError as e:
        raise ConfigError(f"device {requested!r}: {e} (expected auto, cpu, cuda or cuda:N)") from None
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise ConfigError(f"device {requested!r} was asked for but CUDA is not available on this machine "
                             f"(use --device cpu, or auto)")
        index = device.index if device.index is not None else local_rank() % torch.cuda.device_count()
        if index >= torch.cuda.device_count():
            raise ConfigError(f"device cuda:{index} does not exist ({torch.cuda.device_count()} visible GPUs)")
        return torch.device("cuda", index)
    if device.type != "cpu":
        raise ConfigError(f"device {requested!r}: tpzoo runs on cpu or cuda")
    return device


def gpus_shared() -> bool:
    """More ranks on this node than visible GPUs: several ranks compute on one GPU."""
    return torch.cuda.is_available() and local_world_size() > torch.cuda.device_count()


def default_backend(device: torch.device) -> str:
    if device.type == "cuda" and not gpus_shared():
        return "nccl"
    return "gloo"
