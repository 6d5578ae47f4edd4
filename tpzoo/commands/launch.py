"""Run a multi-rank command either under torchrun or, without it, by spawning the ranks on this machine."""
from __future__ import annotations

import os


def under_torchrun() -> bool:
    return "WORLD_SIZE" in os.environ and "RANK" in os.environ


def _spawned(rank: int, world_size: int, port: int, fn, args) -> None:
    import torch.distributed as dist

    # TORCHELASTIC_USE_AGENT_STORE: every rank joins the store the parent already listens on (as under torchrun,
    # whose agent holds it), so no rank has to bind a port that another process may have taken meanwhile.
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world_size),
                      LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world_size), TORCHELASTIC_USE_AGENT_STORE="True")
    try:
        fn(args)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_multirank(fn, args, nproc: int) -> None:
    """Call fn(args) on every rank: in this process under torchrun, else in `nproc` spawned processes."""
    if under_torchrun() or nproc == 1:
        fn(args)
        return
    import torch.distributed as dist
    import torch.multiprocessing as mp

    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)  # the OS picks a free port
    try:
        mp.start_processes(_spawned, args=(nproc, store.port, fn, args), nprocs=nproc, start_method="spawn")
    finally:
        del store
