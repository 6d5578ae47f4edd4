"""Dead and stalled ranks are named within a bound set by --dist-timeout, and the job exits non-zero.

The rules themselves (tpzoo.parallel.watchdog.judge) are checked on made-up heartbeats; the end-to-end cases
run `tpzoo pretrain` at tp=2 in a subprocess, SIGSTOP one rank's process once it trains, and require one report
line naming that rank (number, host, pid) before the collective timeout, a non-zero exit within a bound, and no
process left behind. A rank that is alive but never reaches the collective its peer waits in is named too, and a normal
run with the watchdog on ends with status 0 and nothing on stderr.
"""
import json
import os
import signal
import socket
import subprocess
import sys
import textwrap
import threading
import time

import pytest

from tpzoo.parallel.watchdog import STALL_EXIT, Peer, Self, Timing, judge

pytestmark = pytest.mark.faults

DIST_TIMEOUT = 20     # --dist-timeout of the end-to-end cases: a silent rank is named after 10 s
WAIT_BOUND_S = 90     # how long a test waits for the job to end after stopping a rank (torchrun's agent: +30 s)
DATA = json.__file__  # a small standard-library file: data loads in no time


# --- the rules, on made-up heartbeats ------------------------------------------------------------------------------

def test_timing_follows_the_documented_rule():
    assert Timing.for_timeout(600) == Timing(600, 60, 10, 580)
    assert Timing.for_timeout(20) == Timing(20, 10, 2, 16)
    t = Timing.for_timeout(1)
    assert t.interval == 0.25 and t.stall_after == 0.5 and t.hang_after < 1


def _record(beat=1, **kw):
    return {"beat": beat, "state": "running", "host": "h1", "pid": 42, "note": "", "where": "at x.py:1 f",
            "waiting": False, "counts": {"world": 3}, **kw}


def _me(counts=None, still_since=0.0, waiting=True):
    return Self(0, {"world": [0, 1, 2]}, counts=counts or {"world": 3}, still_since=still_since,
                where="in all_reduce at tpzoo/parallel/comm.py:114 all_reduce", waiting=waiting)


def test_a_silent_peer_is_named_after_stall_after_and_an_exited_one_never():
    t = Timing.for_timeout(20)
    quiet = Peer(1, seen_at=0.0, beat=5, record=_record(5, note="step 12"))
    assert judge(_me(), [quiet], now=9.0, timing=t) is None
    report = judge(_me(), [quiet], now=10.5, timing=t)
    assert report.startswith("rank 1 (host h1, pid 42) has sent no heartbeat for 10 s (last seen at x.py:1 f; step 12)")
    assert "stopped, frozen or dead (noticed by rank 0" in report
    gone = Peer(1, seen_at=0.0, beat=5, record=_record(5, state="exited"))
    assert judge(_me(), [gone], now=100.0, timing=t) is None
    never = Peer(2, seen_at=0.0)
    assert "rank 2 has sent no heartbeat for 11 s (never heard from)" in judge(_me(), [never], now=11.0, timing=t)


def test_a_peer_behind_and_busy_is_named_when_the_wait_nears_the_timeout():
    t = Timing.for_timeout(20)
    busy = Peer(1, seen_at=15.0, beat=9, record=_record(9, counts={"world": 2}, where="at train.py:7 spin"))
    waiting_too = Peer(2, seen_at=15.0, beat=9, record=_record(9, counts={"world": 2}, waiting=True))
    assert judge(_me(), [busy, waiting_too], now=15.0, timing=t) is None  # not yet hang_after (16 s)
    report = judge(_me(), [busy, waiting_too], now=16.5, timing=t)
    assert "rank 1 (host h1, pid 42) has not reached it" in report and "at train.py:7 spin" in report
    assert "rank 2" not in report  # waiting in a collective itself: left to the collective's timeout
    assert judge(_me(waiting=False), [busy], now=16.5, timing=t) is None  # this rank is busy itself, not waiting
    level = Peer(1, seen_at=15.0, beat=9, record=_record(9, counts={"world": 3}))
    assert judge(_me(), [level], now=16.5, timing=t) is None  # the peer has reached it: not the culprit


# --- the switch: off in the test harness, on when asked, stopped by destroy_parallel ------------------------------

def _watchdog_in_the_harness():
    import tpzoo
    from tpzoo.parallel import watchdog

    tpzoo.init_parallel(tp=2, device="cpu")
    off = watchdog.active() is None
    tpzoo.destroy_parallel()
    tpzoo.init_parallel(tp=2, device="cpu", watchdog=True)
    running = watchdog.active()
    tpzoo.destroy_parallel()
    running.thread.join(timeout=5)
    return off, running is not None, watchdog.active() is None and not running.thread.is_alive()


def test_the_harness_never_starts_it_and_destroy_parallel_stops_it():
    from tpzoo.testing import run_on_ranks

    assert run_on_ranks(2, _watchdog_in_the_harness) == [(True, True, True)] * 2


# --- end to end -----------------------------------------------------------------------------------------------------

def _pretrain_args(steps: int, log_dir) -> list:
    return ["pretrain", "--model", "nano-gpt", "--data", DATA, "--seq-len", "32", "--global-batch-size", "4",
            "--micro-batch-size", "2", "--steps", str(steps), "--save", "", "--sample-prompt", "", "--device", "cpu",
            "--dist-timeout", str(DIST_TIMEOUT), "--tp", "2", "--quiet", "--log-dir", str(log_dir)]


def _start(argv: list, cwd) -> subprocess.Popen:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env.pop("TPZOO_WATCHDOG", None)
    return subprocess.Popen(argv, cwd=cwd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)


def _processes() -> dict[int, tuple[str, int]]:
    """{pid: (state, parent pid)} of every process, from /proc."""
    out = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()  # state, ppid, ...
            except OSError:
                continue
            out[int(entry)] = (fields[0], int(fields[1]))
    return out


def _descendants(root: int) -> list[int]:
    procs, found, todo = _processes(), [], [root]
    while todo:
        parent = todo.pop()
        children = [pid for pid, (_, ppid) in procs.items() if ppid == parent]
        found += children
        todo += children
    return sorted(found)


def _alive(pids) -> list[int]:
    procs = _processes()
    return [p for p in pids if p in procs and procs[p][0] != "Z"]


def _rank_processes(proc: subprocess.Popen, torchrun: bool) -> dict[int, int]:
    """{rank: pid} of the job's rank processes: torchrun's workers (their environment says RANK), or the
    processes tpzoo's launcher started in rank order: its forkserver's children (tpzoo.commands.launch), or its
    own children where it spawns them."""
    ranks = {}
    procs = _processes()
    for pid in _descendants(proc.pid):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmd = f.read().replace(b"\0", b" ").decode()
            with open(f"/proc/{pid}/environ", "rb") as f:
                env = dict(kv.split("=", 1) for kv in f.read().decode(errors="replace").split("\0") if "=" in kv)
        except OSError:
            continue
        if torchrun and "RANK" in env and "tpzoo" in cmd:
            ranks[int(env["RANK"])] = pid
        elif not torchrun:
            parent = procs.get(pid, ("", 0))[1]
            forked = "forkserver" in cmd and procs.get(parent, ("", 0))[1] == proc.pid  # the server's children
            if forked or ("spawn_main" in cmd and parent == proc.pid):
                ranks[len(ranks)] = pid
    return ranks


def _timed_lines(stream) -> list:
    """Read `stream` in a thread; the list fills with (monotonic time, line) as lines arrive."""
    lines = []

    def read():
        for line in stream:
            lines.append((time.monotonic(), line))

    threading.Thread(target=read, daemon=True).start()
    return lines


def _wait_for_training(proc: subprocess.Popen, log_dir, lines: list, limit_s: float = 120.0) -> None:
    metrics = os.path.join(log_dir, "metrics.jsonl")
    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            time.sleep(0.5)
            pytest.fail(f"the run ended before training: status {proc.returncode}\n" + "".join(x for _, x in lines))
        if os.path.exists(metrics) and os.path.getsize(metrics) > 0:
            return
        time.sleep(0.2)
    pytest.fail("no training step within the time allowed")


def _stop_a_rank_and_check(proc, log_dir, torchrun: bool, rank: int = 1) -> float:
    """SIGSTOP `rank` once the job trains; require the named report and a bounded non-zero exit. Returns the
    seconds from SIGSTOP to the report and to the job's exit."""
    job = [proc.pid]
    lines = _timed_lines(proc.stderr)  # read from the start: a full pipe would stall the job by itself
    try:
        _wait_for_training(proc, log_dir, lines)
        job += _descendants(proc.pid)
        ranks = _rank_processes(proc, torchrun)
        assert sorted(ranks) == [0, 1], ranks
        stopped = ranks[rank]
        os.kill(stopped, signal.SIGSTOP)
        t0 = time.monotonic()
        try:
            proc.wait(timeout=WAIT_BOUND_S)
        except subprocess.TimeoutExpired:
            pytest.fail(f"the job did not end within {WAIT_BOUND_S} s of rank {rank} stopping")
        took = time.monotonic() - t0
        time.sleep(0.5)  # the reader drains what is left
        err = "".join(line for _, line in lines)
        named = [t - t0 for t, line in lines if line.startswith("tpzoo pretrain: error: ")]
        assert proc.returncode != 0, err
        if not torchrun:
            assert proc.returncode == STALL_EXIT, err
        lines = [line for line in err.splitlines() if line.startswith("tpzoo pretrain: error: ")]
        assert len(lines) == 1, err
        assert f"rank {rank} (host {socket.gethostname()}, pid {stopped})" in lines[0], lines[0]
        assert "stopped, frozen or dead" in lines[0], lines[0]
        assert named[0] < DIST_TIMEOUT, (named, err)  # named before the collective's own timeout
        assert took < DIST_TIMEOUT + (35 if torchrun else 5), (took, err)  # torchrun: + its 30 s SIGKILL grace
        deadline = time.monotonic() + 10
        while _alive(job) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not _alive(job), f"processes left behind: {_alive(job)}"
        return named[0], took
    finally:
        for pid in _alive(job):  # never leave a stopped process behind, whatever failed above
            for sig in (signal.SIGKILL, signal.SIGCONT):
                try:
                    os.kill(pid, sig)
                except ProcessLookupError:
                    pass
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_a_stopped_rank_is_named_and_the_self_spawned_job_exits(tmp_path):
    proc = _start([sys.executable, "-m", "tpzoo", *_pretrain_args(100000, tmp_path / "logs")], tmp_path)
    named, took = _stop_a_rank_and_check(proc, tmp_path / "logs", torchrun=False)
    print(f"self-spawned, --dist-timeout {DIST_TIMEOUT}: named {named:.1f} s after SIGSTOP, exit after {took:.1f} s")


@pytest.mark.slow  # ~50 s, most of it torchrun's 30 s grace before it SIGKILLs the stopped worker; the default tier
def test_a_stopped_rank_is_named_under_torchrun(tmp_path):  # names a stopped rank of a self-spawned job (above)
    argv = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--standalone",
            "-m", "tpzoo", *_pretrain_args(100000, tmp_path / "logs")]
    proc = _start(argv, tmp_path)
    named, took = _stop_a_rank_and_check(proc, tmp_path / "logs", torchrun=True, rank=0)
    print(f"torchrun, --dist-timeout {DIST_TIMEOUT}: named {named:.1f} s after SIGSTOP, exit after {took:.1f} s")


def test_a_normal_run_with_the_watchdog_on_exits_cleanly(tmp_path):
    # 60 steps: several heartbeats (one every 2 s at --dist-timeout 20), then a normal exit
    proc = _start([sys.executable, "-m", "tpzoo", *_pretrain_args(60, tmp_path / "logs")], tmp_path)
    try:
        _, err = proc.communicate(timeout=240)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 0, err
    assert err.strip() == "", err
    with open(tmp_path / "logs" / "metrics.jsonl") as f:
        assert len(f.readlines()) == 60


BUSY_SCRIPT = textwrap.dedent("""
    import sys, time
    import torch
    import tpzoo
    from tpzoo.commands.launch import run_multirank
    from tpzoo.parallel import comm, watchdog

    def spin_forever():
        while True:  # alive, heartbeating, but never reaching the collective its peer waits in
            time.sleep(0.05)

    def job(timeout):
        import datetime
        dims = tpzoo.init_parallel(tp=2, device="cpu", timeout=datetime.timedelta(seconds=timeout))
        comm.all_reduce(torch.ones(1), dims.tp_group)
        watchdog.note("after the first all_reduce")
        if dims.rank == 1:
            spin_forever()
        comm.all_reduce(torch.ones(1), dims.tp_group)

    if __name__ == "__main__":
        sys.exit(run_multirank(job, float(sys.argv[1]), 2, "busy-test"))
""")


def test_a_rank_that_never_reaches_the_collective_is_named(tmp_path):
    script = tmp_path / "busy.py"
    script.write_text(BUSY_SCRIPT)
    timeout = 8  # hang_after = 8 - 2 * 0.8 = 6.4 s
    proc = _start([sys.executable, str(script), str(timeout)], tmp_path)
    try:
        _, err = proc.communicate(timeout=120)
    finally:
        for pid in _alive([proc.pid, *_descendants(proc.pid)]):
            os.kill(pid, signal.SIGKILL)
        proc.communicate()
    assert proc.returncode == STALL_EXIT, err
    lines = [line for line in err.splitlines() if line.startswith("tpzoo busy-test: error: ")]
    assert len(lines) == 1, err
    line = lines[0]
    assert "rank 0 has waited" in line and "in all_reduce" in line, line
    assert f"rank 1 (host {socket.gethostname()}, pid " in line and "has not reached it (tp group)" in line, line
    assert "spin_forever" in line and "after the first all_reduce" in line, line
    assert "Traceback" not in err, err
