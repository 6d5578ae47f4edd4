"""Run a function on several gloo ranks on one CPU, sharing process start-up across calls.

    results = run_on_ranks(4, my_module.check_fn, arg1, arg2)   # -> [result of rank 0, ..., rank 3]

`check_fn` must be importable (a module-level function). Each pool of `world_size` worker processes is started
once (about a second per rank on a small machine) and then reused; the default gloo process group stays up in
the workers, and `tpzoo.init_parallel()` builds its subgroups on top of it for each call.

Failures never hang: an exception on any rank is raised here with that rank's traceback, and a call that does
not finish within its timeout kills the pool (the next call starts a fresh one) and raises naming the ranks
that did not answer.
"""
from __future__ import annotations

import multiprocessing as mp
import os
import pickle
import queue
import time
import traceback
from datetime import timedelta

DEFAULT_TIMEOUT = float(os.environ.get("TPZOO_TEST_TIMEOUT", "300"))


class RankFailure(AssertionError):
    pass


def _worker(rank: int, world_size: int, port: int, tasks, results, collective_timeout: float, env: dict,
            backend: str = "gloo") -> None:
    # The caller's environment and the pool's own variables, before anything imports triton (TRITON_INTERPRET is
    # read at import time; a forkserver's children start with the server's environment, tpzoo.commands.launch).
    os.environ.clear()
    os.environ.update(env)
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)  # several ranks share few cores: no oversubscription
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank))
    timeout = timedelta(seconds=collective_timeout)
    # The parent holds the store's listening socket, so no other process can take the port in between.
    store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timeout)
    kw = {}
    if backend == "nccl":  # one GPU per rank (scripts/multi_gpu_check.py); init_parallel(device="auto") picks it
        kw["device_id"] = torch.device("cuda", rank % torch.cuda.device_count())
        torch.cuda.set_device(kw["device_id"])
    dist.init_process_group(backend, store=store, rank=rank, world_size=world_size, timeout=timeout, **kw)
    while True:
        task = tasks.get()
        if task is None:
            break
        call_id, payload = task
        from tpzoo.parallel import strict

        try:
            fn, args, kwargs = pickle.loads(payload)
            out = fn(*args, **kwargs)
            # a pooled worker never reaches process exit: what strict mode checks there, it checks after each call
            strict.check_all_waited(f"the end of {getattr(fn, '__name__', 'the call')}", include_carried=True)
            results.put((call_id, rank, True, pickle.dumps(out)))
        except BaseException:  # noqa: BLE001 - the traceback goes to the caller
            strict.forget()
            results.put((call_id, rank, False, traceback.format_exc()))
        finally:
            from tpzoo.parallel import state

            if state.is_initialized():
                try:
                    state.destroy_parallel()
                except Exception:  # noqa: BLE001
                    pass
    dist.destroy_process_group()


class RankPool:
    def __init__(self, world_size: int, collective_timeout: float = 60.0, env: dict | None = None,
                 backend: str = "gloo"):
        import torch.distributed as dist

        from tpzoo.commands.launch import start_method

        ctx = mp.get_context(start_method())  # forked from a server that imported torch once, where there is one
        self.world_size = world_size
        self.tasks = [ctx.Queue() for _ in range(world_size)]
        self.results = ctx.Queue()
        # Bind the rendezvous store here, on a port the OS picks: choosing a "free" port and letting a child
        # bind it later races with other processes (EADDRINUSE under parallel test runs).
        self.store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
        port = self.store.port
        self.procs = [ctx.Process(target=_worker, args=(r, world_size, port, self.tasks[r], self.results,
                                                        collective_timeout, {**os.environ, **(env or {})}, backend),
                                 daemon=True)
                      for r in range(world_size)]
        for p in self.procs:
            p.start()
        self._next_id = 0

    def run(self, fn, *args, timeout: float | None = None, **kwargs) -> list:
        timeout = DEFAULT_TIMEOUT if timeout is None else timeout
        self._next_id += 1
        call_id = self._next_id
        payload = pickle.dumps((fn, args, kwargs))
        for q in self.tasks:
            q.put((call_id, payload))
        outputs, errors = {}, {}
        deadline = time.monotonic() + timeout
        while len(outputs) + len(errors) < self.world_size:
            if errors:  # a failed rank leaves the others blocked in a collective: give them a moment only
                deadline = min(deadline, time.monotonic() + 3.0)
            try:
                got_id, rank, ok, data = self.results.get(timeout=max(0.05, min(1.0, deadline - time.monotonic())))
            except queue.Empty:
                dead = [r for r, p in enumerate(self.procs) if not p.is_alive() and r not in outputs]
                if dead and not errors:
                    errors.update({r: f"rank {r} died (exit code {self.procs[r].exitcode})" for r in dead})
                if time.monotonic() >= deadline:
                    break
                continue
            if got_id != call_id:
                continue  # a straggler from an earlier, failed call
            (outputs if ok else errors)[rank] = pickle.loads(data) if ok else data
        if errors or len(outputs) < self.world_size:
            self.close(kill=True)
            missing = sorted(set(range(self.world_size)) - set(outputs) - set(errors))
            msg = [f"{getattr(fn, '__name__', fn)} on {self.world_size} ranks failed"]
            for rank in sorted(errors):
                msg.append(f"--- rank {rank} ---\n{errors[rank]}")
            if missing:
                msg.append(f"ranks {missing} did not finish within {timeout:.0f}s (killed)")
            raise RankFailure("\n".join(msg))
        return [outputs[r] for r in range(self.world_size)]

    @property
    def alive(self) -> bool:
        return all(p.is_alive() for p in self.procs)

    def close(self, kill: bool = False) -> None:
        if not kill:
            self._ask_to_stop()
            self._join(time.monotonic() + 3.0)  # one shared grace period, then kill: teardown stays quick
        self._kill()

    def _ask_to_stop(self) -> None:
        for q in self.tasks:
            q.put(None)

    def _join(self, deadline: float) -> None:
        for p in self.procs:
            p.join(timeout=max(0.0, deadline - time.monotonic()))

    def _kill(self) -> None:
        for p in self.procs:
            if p.is_alive():
                p.kill()
                p.join(timeout=5)


_POOLS: dict[tuple, RankPool] = {}


def run_on_ranks(world_size: int, fn, *args, timeout: float | None = None, pool_env: dict | None = None,
                 backend: str = "gloo", **kwargs) -> list:
    """Run fn(*args, **kwargs) on `world_size` gloo ranks; return the per-rank results in rank order.

    `pool_env`: environment variables the worker processes start with (a separate pool per distinct env),
    e.g. {"TRITON_INTERPRET": "1"}, which Triton only honours when set before it is first imported.
    `backend="nccl"`: ranks on GPUs 0..world_size-1 with NCCL (the multi-GPU acceptance check)."""
    key = (world_size, tuple(sorted((pool_env or {}).items())), backend)
    pool = _POOLS.get(key)
    if pool is None or not pool.alive:
        pool = _POOLS[key] = RankPool(world_size, env=pool_env, backend=backend)
    try:
        return pool.run(fn, *args, timeout=timeout, **kwargs)
    except RankFailure:
        _POOLS.pop(key, None)
        raise


def shutdown_pools() -> None:
    """Stop every pool: all asked at once, then one shared grace period for all of them, then killed."""
    pools = list(_POOLS.values())
    _POOLS.clear()
    for pool in pools:
        pool._ask_to_stop()
    deadline = time.monotonic() + 3.0
    for pool in pools:
        pool._join(deadline)
    for pool in pools:
        pool._kill()
