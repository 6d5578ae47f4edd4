"""Run a multi-rank command either under torchrun or, without it, by spawning the ranks on this machine.

Each rank runs the command's function inside `_rank`: a user error is reported once for the whole job (the first
rank to fail prints `tpzoo <command>: error: ...`, tpzoo.errors) and the rank exits with status 2; a rank failing
because of it (a peer gone from a collective) exits 2 silently; a bug keeps its traceback.

Each rank also runs the stall watchdog (tpzoo.parallel.watchdog): a rank that stops making progress is named by
its peers, which exit with status 3. When one rank fails, the launcher stops the others within a few seconds:
SIGTERM, then SIGKILL, which also ends a stopped (SIGSTOP) process, since a stopped process never acts on SIGTERM.
"""
from __future__ import annotations

import os
import sys


def under_torchrun() -> bool:
    return "WORLD_SIZE" in os.environ and "RANK" in os.environ


# A failed rank's peers get this long to exit by themselves (they are usually failing too, silently), then
# SIGTERM and as long again, then SIGKILL: the job ends within 2 * STOP_GRACE_S of its first failure.
STOP_GRACE_S = 2.0
_REPORTED = (1, 2, 3)  # exit statuses whose cause a rank has already printed (3: a stalled rank, named)


def _rank(fn, args, command: str) -> None:
    from tpzoo.errors import debug_enabled, fail_rank
    from tpzoo.parallel import watchdog

    watchdog.enable_for(command)  # init_parallel in this rank starts the stall watchdog
    try:
        fn(args)
    except Exception as e:  # noqa: BLE001 - sorted into user errors and bugs
        rc = fail_rank(command, e, debug=debug_enabled(args))
        if rc is None:
            raise
        sys.exit(rc)
    finally:
        watchdog.enable_for(None)


def _spawned(rank: int, world_size: int, port: int, fn, args, command: str, env: dict) -> None:
    import torch.distributed as dist

    # The launching process's environment as it is now (a forkserver's children inherit the server's, which
    # started at the first launch), before anything of tpzoo reads it.
    os.environ.clear()
    os.environ.update(env)
    # TORCHELASTIC_USE_AGENT_STORE: every rank joins the store the parent already listens on (as under torchrun,
    # whose agent holds it), so no rank has to bind a port that another process may have taken meanwhile.
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world_size),
                      LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world_size), TORCHELASTIC_USE_AGENT_STORE="True")
    try:
        _rank(fn, args, command)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def start_method() -> str:
    """"forkserver" where the platform has it: one server process imports torch once, and each rank is forked from
    it (a clean, single-threaded process that has not touched CUDA), instead of every rank importing torch anew
    (about 1.5 s of CPU each); "spawn" elsewhere."""
    import multiprocessing

    if "forkserver" not in multiprocessing.get_all_start_methods():
        return "spawn"
    multiprocessing.set_forkserver_preload(["torch", "torch.distributed"])  # (no effect once the server runs)
    return "forkserver"


def run_multirank(fn, args, nproc: int, command: str) -> int:
    """Call fn(args) on every rank: in this process under torchrun (or for one rank), else in `nproc` spawned
    processes. Returns the job's exit status: 0, or the first failing rank's (2: a user error, already printed;
    3: a stalled or dead rank, named by a peer; 1: a failure the command reported itself, e.g. a diverged run).
    A rank that raised a bug re-raises it here with its traceback."""
    if under_torchrun() or nproc == 1:
        _rank(fn, args, command)
        return 0
    import logging

    import torch.distributed as dist
    import torch.multiprocessing as mp

    # torch logs each SIGTERM/SIGKILL it sends to a rank as a warning; the job's own report is the line that counts
    logging.getLogger("torch.multiprocessing.spawn").setLevel(logging.ERROR)
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)  # the OS picks a free port
    try:
        ranks = mp.start_processes(_spawned, args=(nproc, store.port, fn, args, command, dict(os.environ)),
                                   nprocs=nproc, start_method=start_method(), join=False)
        while not ranks.join(grace_period=STOP_GRACE_S):
            pass
    except mp.ProcessExitedException as e:
        if e.exit_code in _REPORTED:
            return e.exit_code
        raise RuntimeError(f"tpzoo {command}: rank {e.error_index} ended with exit code {e.exit_code} "
                           f"(killed by a signal when negative)") from None
    finally:
        del store
    return 0
