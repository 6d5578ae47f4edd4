"""init_parallel: create this rank's process groups and device, as a ParallelDims that is also the default.

Everything in tpzoo takes a `dims` argument; when it is omitted, the default is the ParallelDims of the last
`init_parallel()` (or, before any, a single CPU process). That keeps the simple public API:

    tpzoo.init_parallel(tp=2)               # under torchrun --nproc-per-node 2
    layer = ColumnParallelLinear(512, 2048)  # uses the default dims: tp=2, this rank's device

The functions at the end (get_tp_size(), ...) read the default dims, for scripts; library code passes dims.
"""
from __future__ import annotations

import datetime
import os

import torch
import torch.distributed as dist

from tpzoo.errors import ConfigError

from . import watchdog as _watchdog
from .device import default_backend, local_rank, resolve_device
from .dims import SELF_GROUP, ParallelDims, ParallelLayoutError, check_layout, divide, local_dims  # noqa: F401 - re-exported


def default_timeout() -> datetime.timedelta:
    # A broken rank must fail the job rather than hang it: collectives give up after this long.
    return datetime.timedelta(seconds=float(os.environ.get("TPZOO_DIST_TIMEOUT", "600")))


_DIMS: ParallelDims | None = None
_LOCAL: ParallelDims | None = None    # the default before init_parallel: one CPU process
_GROUP_NAMES: dict = {}  # ProcessGroup -> short name, for the collective counter


def job_world_size() -> int:
    """How many ranks init_parallel joins from this process: the default group's size once torch.distributed is
    initialized, else WORLD_SIZE (set by torchrun, and by tpzoo for the ranks it spawns), else 1. Every check that
    depends on the world size before the groups exist (the preflight under torchrun, TrainConfig.validate inside
    train()) asks this, so it cannot disagree with the groups init_parallel builds."""
    if dist.is_initialized():
        return dist.get_world_size()
    return int(os.environ.get("WORLD_SIZE", "1"))


def init_parallel(tp: int = 1, pp: int = 1, cp: int = 1, dp: int | None = None, ep: int = 1, *, device=None,
                  backend: str | None = None, timeout: datetime.timedelta | None = None,
                  watchdog: bool | None = None, replicas: int = 1) -> ParallelDims:
    """Create the tp/cp/dp/pp (and with ep > 1 the expert ep/edp) process groups of this rank and choose its device; return them as ParallelDims
    (also the default dims from now on).

    Works under torchrun (reads RANK/WORLD_SIZE/LOCAL_RANK/MASTER_ADDR), after an explicit
    ``torch.distributed.init_process_group``, or as a single process with no environment (world size 1).
    `device`: 'auto' (default: cuda:LOCAL_RANK with CUDA, else cpu), 'cpu', 'cuda', 'cuda:N'. `backend`: default
    nccl for CUDA, gloo for CPU (and for GPUs shared by several ranks). The layout is checked before any
    collective is issued. `timeout`: how long a collective waits (default TPZOO_DIST_TIMEOUT, 600 s).
    `replicas`: split dp into that many replicas of whole model copies (their groups: tpzoo.parallel.dims).
    `watchdog`: name a stalled or dead rank well before that (tpzoo.parallel.watchdog); default on inside the tpzoo
    commands, off otherwise (TPZOO_WATCHDOG=0/1 overrides)."""
    global _DIMS
    if _DIMS is not None:
        raise RuntimeError("init_parallel() was already called; call destroy_parallel() first")
    timeout = timeout or default_timeout()
    device = resolve_device(device)
    owns = False
    world_size = job_world_size()
    dp = check_layout(world_size, tp, pp, cp, dp, ep, replicas)
    if dist.is_initialized():
        rank = dist.get_rank()
    else:
        rank = int(os.environ.get("RANK", "0"))
        backend = backend or default_backend(device)
        if backend == "nccl" and device.type != "cuda":
            raise ConfigError(f"backend nccl needs a CUDA device, got {device}")
        if device.type == "cuda":
            torch.cuda.set_device(device)
        kw = {"device_id": device} if backend == "nccl" else {}
        if world_size == 1:  # one process: an in-memory store, no port to pick (and lose to another process)
            kw["store"] = dist.HashStore()
        dist.init_process_group(backend=backend, rank=rank, world_size=world_size, timeout=timeout, **kw)
        owns = True
    if device.type == "cuda":
        torch.cuda.set_device(device)

    dims = ParallelDims(tp=tp, pp=pp, cp=cp, dp=dp, ep=ep, rank=rank, world_size=world_size, device=device,
                        owns_default_group=owns, replicas=replicas)
    # Every rank must create every group, in the same order (new_group is collective over the world).
    for name, ranks in dims.enumerate_groups():
        group = dist.new_group(ranks=ranks, timeout=timeout) if world_size > 1 else dist.group.WORLD
        if rank in ranks:
            dims.groups[name] = group
            dims.group_ranks[name] = ranks
            _GROUP_NAMES[group] = name.split(">")[0]  # counted under their kind: the p2p channels as "pp"
    _GROUP_NAMES.setdefault(dist.group.WORLD, "world")
    _DIMS = dims
    if _watchdog.wanted(watchdog):
        _watchdog.start(dims, timeout)
    return dims


def destroy_parallel() -> None:
    """Forget the layout; destroy the default group too when init_parallel created it."""
    global _DIMS
    dims, _DIMS = _DIMS, None
    if dims is None:
        return
    _watchdog.stop()  # before the groups go: its last heartbeat tells the peers this rank left on purpose
    for group in dims.groups.values():
        _GROUP_NAMES.pop(group, None)
        if dims.world_size > 1 and group is not dist.group.WORLD:
            try:
                dist.destroy_process_group(group)
            except (ValueError, RuntimeError):
                pass  # already gone with the default group
    if dims.owns_default_group and dist.is_initialized():
        dist.destroy_process_group()


def is_initialized() -> bool:
    return _DIMS is not None


def get_dims(dims: ParallelDims | None = None) -> ParallelDims:
    """`dims` itself when given, else the default: init_parallel's, or a single CPU process before it."""
    global _LOCAL
    if dims is not None:
        return dims
    if _DIMS is not None:
        return _DIMS
    if _LOCAL is None:
        _LOCAL = local_dims("cpu")
    return _LOCAL


def group_name(group) -> str:
    if group is None:
        return "world"
    if group is SELF_GROUP:
        return "self"
    return _GROUP_NAMES.get(group, f"group{id(group) % 10000}")


# --- the default dims' values, for scripts (library code takes dims) --------------------------------------------

def get_tp_size() -> int: return get_dims().tp
def get_tp_rank() -> int: return get_dims().tp_rank
def get_tp_group(): return get_dims().tp_group
def get_pp_size() -> int: return get_dims().pp
def get_pp_rank() -> int: return get_dims().pp_rank
def get_pp_group(): return get_dims().pp_group
def get_dp_size() -> int: return get_dims().dp
def get_dp_rank() -> int: return get_dims().dp_rank
def get_dp_group(): return get_dims().dp_group
def get_cp_size() -> int: return get_dims().cp
def get_cp_rank() -> int: return get_dims().cp_rank
def get_cp_group(): return get_dims().cp_group
def get_device() -> torch.device: return get_dims().device
def get_group_ranks(name: str) -> list[int]: return get_dims().ranks(name)


__all__ = ["ParallelDims", "ParallelLayoutError", "SELF_GROUP", "check_layout", "default_timeout", "destroy_parallel",
           "divide", "get_cp_group", "get_cp_rank", "get_cp_size", "get_device", "get_dims", "get_dp_group",
           "get_dp_rank", "get_dp_size", "get_group_ranks", "get_pp_group", "get_pp_rank", "get_pp_size",
           "get_tp_group", "get_tp_rank", "get_tp_size", "group_name", "init_parallel", "is_initialized",
           "job_world_size", "local_rank"]
