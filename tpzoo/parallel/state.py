"""Process groups and rank layout.

Megatron's rank order: tensor parallel varies fastest, then context parallel, then data parallel, then
pipeline parallel. So global rank = tp_rank + tp * (cp_rank + cp * (dp_rank + dp * pp_rank)), and the
ranks of one tensor-parallel group are neighbours (on one node, where the bandwidth is).
"""
from __future__ import annotations

import contextlib
import datetime
import itertools
import os
from dataclasses import dataclass, field

import torch
import torch.distributed as dist


class ParallelLayoutError(ValueError):
    """A parallel layout that cannot work (degrees that do not divide, a world size that does not match)."""


def divide(numerator: int, denominator: int, what: str = "value") -> int:
    """numerator / denominator, or a clear error when it does not divide evenly."""
    if denominator <= 0 or numerator % denominator != 0:
        raise ParallelLayoutError(f"{what}: {numerator} is not divisible by {denominator}")
    return numerator // denominator


def default_timeout() -> datetime.timedelta:
    # A broken rank must fail the job rather than hang it: collectives give up after this long.
    return datetime.timedelta(seconds=float(os.environ.get("TPZOO_DIST_TIMEOUT", "600")))


@dataclass
class ParallelState:
    tp: int
    pp: int
    cp: int
    dp: int
    rank: int
    world_size: int
    groups: dict = field(default_factory=dict)  # name -> ProcessGroup (this rank's)
    group_ranks: dict = field(default_factory=dict)  # name -> list of global ranks in this rank's group
    owns_default_group: bool = False

    def coords(self, rank: int | None = None) -> dict:
        r = self.rank if rank is None else rank
        tp_rank = r % self.tp
        cp_rank = (r // self.tp) % self.cp
        dp_rank = (r // (self.tp * self.cp)) % self.dp
        pp_rank = r // (self.tp * self.cp * self.dp)
        return {"tp": tp_rank, "cp": cp_rank, "dp": dp_rank, "pp": pp_rank}

    def rank_of(self, tp: int, cp: int, dp: int, pp: int) -> int:
        return tp + self.tp * (cp + self.cp * (dp + self.dp * pp))


_STATE: ParallelState | None = None
_GROUP_NAMES: dict = {}  # ProcessGroup -> short name, for the collective counter


def check_layout(world_size: int, tp: int = 1, pp: int = 1, cp: int = 1, dp: int | None = None) -> int:
    """Validate degrees against a world size and return dp (inferred when None)."""
    for name, value in (("tp", tp), ("pp", pp), ("cp", cp)):
        if not isinstance(value, int) or value < 1:
            raise ParallelLayoutError(f"{name} must be a positive integer, got {value!r}")
    model_parallel = tp * pp * cp
    if world_size % model_parallel != 0:
        raise ParallelLayoutError(
            f"world size {world_size} is not divisible by tp*pp*cp = {tp}*{pp}*{cp} = {model_parallel}"
        )
    inferred = world_size // model_parallel
    if dp is None:
        return inferred
    if dp != inferred:
        raise ParallelLayoutError(
            f"tp*pp*cp*dp = {tp}*{pp}*{cp}*{dp} = {model_parallel * dp} does not equal world size {world_size}"
        )
    return dp


def _default_backend() -> str:
    return "nccl" if torch.cuda.is_available() else "gloo"


def init_parallel(tp: int = 1, pp: int = 1, cp: int = 1, dp: int | None = None, *, backend: str | None = None,
                  timeout: datetime.timedelta | None = None) -> ParallelState:
    """Create the tp/cp/dp/pp process groups of this rank.

    Works under torchrun (reads RANK/WORLD_SIZE/MASTER_ADDR), after an explicit
    ``torch.distributed.init_process_group``, or as a single process with no environment (world size 1).
    The layout is checked before any collective is issued.
    """
    global _STATE
    if _STATE is not None:
        raise RuntimeError("init_parallel() was already called; call destroy_parallel() first")
    timeout = timeout or default_timeout()
    owns = False
    if dist.is_initialized():
        world_size, rank = dist.get_world_size(), dist.get_rank()
        dp = check_layout(world_size, tp, pp, cp, dp)
    else:
        world_size = int(os.environ.get("WORLD_SIZE", "1"))
        rank = int(os.environ.get("RANK", "0"))
        dp = check_layout(world_size, tp, pp, cp, dp)
        if world_size == 1:
            os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
            os.environ.setdefault("MASTER_PORT", str(_free_port()))
        backend = backend or _default_backend()
        if backend == "nccl":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        dist.init_process_group(backend=backend, rank=rank, world_size=world_size, timeout=timeout)
        owns = True

    state = ParallelState(tp=tp, pp=pp, cp=cp, dp=dp, rank=rank, world_size=world_size, owns_default_group=owns)
    sizes = {"tp": tp, "cp": cp, "dp": dp, "pp": pp}
    # Every rank must create every group, in the same order (new_group is collective over the world).
    for name, varying in (("tp", ("tp",)), ("cp", ("cp",)), ("dp", ("dp",)), ("pp", ("pp",)),
                          ("dp_cp", ("dp", "cp")), ("mp", ("tp", "pp"))):
        for ranks in _enumerate_groups(state, sizes, varying):
            group = dist.new_group(ranks=ranks, timeout=timeout) if world_size > 1 else dist.group.WORLD
            if rank in ranks:
                state.groups[name] = group
                state.group_ranks[name] = ranks
                _GROUP_NAMES[group] = name
    # First and last pipeline stage of each pipeline: they hold the tied input/output embeddings.
    for ranks in _enumerate_groups(state, sizes, ("pp",)):
        emb_ranks = sorted({ranks[0], ranks[-1]})
        group = dist.new_group(ranks=emb_ranks, timeout=timeout) if world_size > 1 else dist.group.WORLD
        if rank in emb_ranks:
            state.groups["embedding"] = group
            state.group_ranks["embedding"] = emb_ranks
            _GROUP_NAMES[group] = "embedding"
    _GROUP_NAMES.setdefault(dist.group.WORLD, "world")
    _STATE = state
    return state


def _enumerate_groups(state: ParallelState, sizes: dict, varying: tuple) -> list[list[int]]:
    """All groups whose members differ only in the `varying` coordinates, as sorted rank lists."""
    fixed = [k for k in ("tp", "cp", "dp", "pp") if k not in varying]
    groups = []
    for fixed_vals in itertools.product(*(range(sizes[k]) for k in fixed)):
        base = dict(zip(fixed, fixed_vals))
        members = []
        for var_vals in itertools.product(*(range(sizes[k]) for k in varying)):
            c = {**base, **dict(zip(varying, var_vals))}
            members.append(state.rank_of(c["tp"], c["cp"], c["dp"], c["pp"]))
        groups.append(sorted(members))
    return groups


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def destroy_parallel() -> None:
    """Forget the layout; destroy the default group too when init_parallel created it."""
    global _STATE
    state, _STATE = _STATE, None
    if state is None:
        return
    for name, group in state.groups.items():
        _GROUP_NAMES.pop(group, None)
        if state.world_size > 1 and group is not dist.group.WORLD:
            try:
                dist.destroy_process_group(group)
            except (ValueError, RuntimeError):
                pass  # already gone with the default group
    if state.owns_default_group and dist.is_initialized():
        dist.destroy_process_group()


def is_initialized() -> bool:
    return _STATE is not None


def get_state() -> ParallelState:
    if _STATE is None:
        raise RuntimeError("tpzoo parallel state is not initialized: call tpzoo.init_parallel() first")
    return _STATE


def group_name(group) -> str:
    if group is None:
        return "world"
    return _GROUP_NAMES.get(group, f"group{id(group) % 10000}")


# --- queries -----------------------------------------------------------------------------------------------
# When nothing is initialized, every size is 1 and every rank 0: single-process code runs unchanged.

_OVERRIDE: dict | None = None  # {"tp": (size, rank), ...}: see override_layout()


def _size(name: str) -> int:
    if _OVERRIDE is not None and name in _OVERRIDE:
        return _OVERRIDE[name][0]
    return getattr(_STATE, name) if _STATE is not None else 1


def _rank(name: str) -> int:
    if _OVERRIDE is not None and name in _OVERRIDE:
        return _OVERRIDE[name][1]
    return _STATE.coords()[name] if _STATE is not None else 0


@contextlib.contextmanager
def override_layout(**sizes_and_ranks: tuple[int, int]):
    """Make size/rank queries answer as rank r of a layout of size n, e.g. override_layout(tp=(4, 1)).

    For building a rank's part of a model on the meta device in one process (to learn its parameter names,
    shapes and shard specs: checkpoint conversion and the plan advisor) without any process group. Nothing
    may communicate inside."""
    global _OVERRIDE
    previous = _OVERRIDE
    _OVERRIDE = {**(previous or {}), **sizes_and_ranks}
    try:
        yield
    finally:
        _OVERRIDE = previous


def _group(name: str):
    return get_state().groups[name]


def get_tp_size() -> int: return _size("tp")
def get_tp_rank() -> int: return _rank("tp")
def get_tp_group(): return _group("tp")
def get_pp_size() -> int: return _size("pp")
def get_pp_rank() -> int: return _rank("pp")
def get_pp_group(): return _group("pp")
def get_dp_size() -> int: return _size("dp")
def get_dp_rank() -> int: return _rank("dp")
def get_dp_group(): return _group("dp")
def get_cp_size() -> int: return _size("cp")
def get_cp_rank() -> int: return _rank("cp")
def get_cp_group(): return _group("cp")
def get_mp_group(): return _group("mp")
def get_embedding_group(): return get_state().groups.get("embedding")


def get_group_ranks(name: str) -> list[int]:
    return list(get_state().group_ranks[name])


def is_pipeline_first_stage() -> bool:
    return get_pp_rank() == 0


def is_pipeline_last_stage() -> bool:
    return get_pp_rank() == get_pp_size() - 1


def get_pp_next_rank() -> int:
    ranks = get_group_ranks("pp")
    return ranks[(get_pp_rank() + 1) % len(ranks)]


def get_pp_prev_rank() -> int:
    ranks = get_group_ranks("pp")
    return ranks[(get_pp_rank() - 1) % len(ranks)]


def get_device() -> torch.device:
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")
