"""Run a multi-rank command either under torchrun or, without it, by spawning the ranks on this machine.

Each rank runs the command's function inside `_rank`: a user error is reported once for the whole job (the first
rank to fail prints `tpzoo <command>: error: ...`, tpzoo.errors) and the rank exits with status 2; a rank failing
because of it (a peer gone from a collective) exits 2 silently; a bug keeps its traceback.
"""
from __future__ import annotations

import os
import sys


def under_torchrun() -> bool:
    return "WORLD_SIZE" in os.environ and "RANK" in os.environ


def _rank(fn, args, command: str) -> None:
    from tpzoo.errors import debug_enabled, fail_rank

    try:
        fn(args)
    except Exception as e:  # noqa: BLE001 - sorted into user errors and bugs
        rc = fail_rank(command, e, debug=debug_enabled(args))
        if rc is None:
            raise
        sys.exit(rc)


def _spawned(rank: int, world_size: int, port: int, fn, args, command: str) -> None:
    import torch.distributed as dist

    # TORCHELASTIC_USE_AGENT_STORE: every rank joins the store the parent already listens on (as under torchrun,
    # whose agent holds it), so no rank has to bind a port that another process may have taken meanwhile.
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world_size),
                      LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world_size), TORCHELASTIC_USE_AGENT_STORE="True")
    try:
        _rank(fn, args, command)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_multirank(fn, args, nproc: int, command: str) -> int:
    """Call fn(args) on every rank: in this process under torchrun (or for one rank), else in `nproc` spawned
    processes. Returns the job's exit status: 0, or the first failing rank's (2: a user error, already printed;
    1: a failure the command reported itself, e.g. a diverged run). A rank that raised a bug re-raises it here
    with its traceback."""
    if under_torchrun() or nproc == 1:
        _rank(fn, args, command)
        return 0
    import torch.distributed as dist
    import torch.multiprocessing as mp

    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)  # the OS picks a free port
    try:
        mp.start_processes(_spawned, args=(nproc, store.port, fn, args, command), nprocs=nproc,
                           start_method="spawn")
    except mp.ProcessExitedException as e:
        if e.exit_code in (1, 2):
            return e.exit_code
        raise RuntimeError(f"tpzoo {command}: rank {e.error_index} ended with exit code {e.exit_code} "
                           f"(killed by a signal when negative)") from None
    finally:
        del store
    return 0
