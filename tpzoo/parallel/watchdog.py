"""Named stalls: a rank that stops making progress is named (rank, host, pid, what it was doing) and the job ends.

A collective waits for every rank of its group; when one rank is stopped (SIGSTOP, a frozen node, a process
killed without a trace) or never reaches the collective (busy or deadlocked elsewhere), its peers wait until the
collective's timeout (--dist-timeout, 600 s by default) and then fail without saying which rank held them up.
A stopped process cannot run a thread of its own, so the detection is done by the others:

- every rank runs a daemon thread that, every `interval` seconds, publishes a heartbeat into the job's
  rendezvous store (the one MASTER_ADDR:MASTER_PORT names: torchrun's agent, or tpzoo's own launcher): a
  counter, its host and pid, the number of collectives it has issued on each of its process groups, where its
  main thread is (sampled from the stack: e.g. "in all_reduce at tpzoo/parallel/comm.py:114 all_reduce") and
  the last `note()` (e.g. "step 12");
- the same thread reads its peers' heartbeats and applies two rules (`Timing` has the numbers):
  (a) stopped: a peer whose counter has not moved for `stall_after` seconds (measured on this rank's clock, so
      host clocks need not agree) is stopped, frozen or dead;
  (b) not joining: when this rank has issued no collective for `hang_after` seconds while waiting in one, the
      peers that have issued fewer collectives on a group it shares with them and are not waiting in a
      collective themselves have not reached it (busy or deadlocked elsewhere): they are named with where their
      main thread is. (Peers that wait too are left to the collective's timeout: pipeline stages issue
      different numbers of point-to-point operations, so their counts differ without anything being wrong.)
- the first rank to see it claims the job's one error report (the same claim as user errors, tpzoo.errors),
  prints one line `tpzoo <command>: error: rank N (host H, pid P) ...` on stderr, and every detecting rank
  exits with status 3 (STALL_EXIT) at once; the launcher then stops the rest of the job (tpzoo's launcher kills
  the stopped process within a few seconds; torchrun's agent sends SIGTERM and, as a stopped process cannot act
  on it, SIGKILL after its 30 s grace period).

The watchdog is opt-in: `init_parallel(watchdog=True)`, or inside the tpzoo commands (the launcher sets the
process default with `enable_for(command)`); TPZOO_WATCHDOG=0/1 overrides. The test harness (tpzoo.testing),
which calls init_parallel many times in pooled processes, never turns it on. Keys are prefixed by the torchrun
restart count and a per-process generation (every rank calls init_parallel in the same order), so a later
init_parallel never reads an earlier one's heartbeats; `stop()` (destroy_parallel, or process exit) publishes a
last heartbeat marked "exited", which peers stop watching.
"""
from __future__ import annotations

import atexit
import datetime
import functools
import json
import os
import socket
import sys
import threading
import time
from dataclasses import dataclass, field

STALL_EXIT = 3           # a rank's exit status when it ended the job for a stalled peer (named on stderr)
MAX_WATCHED_ALL = 32     # up to this world size every rank watches every other; beyond, its ring neighbours
RING_NEIGHBOURS = 4      # ... this many on each side (every rank is then watched by 2 * RING_NEIGHBOURS peers)

_command: str | None = None   # set by the commands' launcher: the watchdog is on, reports name this command
_note = ""                    # what the rank says it is doing (note())
_active: Watchdog | None = None
_generation = 0


@dataclass(frozen=True)
class Timing:
    """The rule's numbers for one --dist-timeout T (seconds):

    stall_after = min(T / 2, 60)                   a silent peer is named after this long (rule a)
    interval    = clamp(stall_after / 5, 0.25, 10)  seconds between heartbeats (one store write, one or two reads)
    hang_after  = T - 2 * interval                 waiting this long in one collective names who is behind (rule
                                                   b): checked every interval, so it fires before T, when the
                                                   collective itself would give up
    T=600 (default): 60 s, 10 s, 580 s.  T=20: 10 s, 2 s, 16 s."""
    timeout: float
    stall_after: float
    interval: float
    hang_after: float

    @classmethod
    def for_timeout(cls, timeout: float) -> Timing:
        stall_after = min(timeout / 2, 60.0)
        interval = min(max(stall_after / 5, 0.25), 10.0)
        return cls(timeout, stall_after, interval, max(timeout - 2 * interval, stall_after))


def enable_for(command: str | None) -> None:
    """Turn the watchdog on (off with None) for init_parallel calls in this process that do not say; reports name
    `tpzoo <command>`. The commands' launcher calls this around each rank."""
    global _command
    _command = command


def wanted(flag: bool | None) -> bool:
    env = os.environ.get("TPZOO_WATCHDOG", "").strip().lower()
    if env in ("0", "false", "no", "off"):
        return False
    if flag is not None:
        return flag
    return env in ("1", "true", "yes", "on") or _command is not None


def note(text: str) -> None:
    """Say what this rank is doing (e.g. "step 12"); it travels with the next heartbeat and appears in a report
    naming this rank. Costs one assignment."""
    global _note
    _note = text


# --- what this process publishes ---------------------------------------------------------------------------------

_TPZOO_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_WAIT_FILES = (os.path.join("tpzoo", "parallel", "comm.py"), os.path.join("tpzoo", "pipeline", "p2p.py"))


@functools.lru_cache(maxsize=1)
def _library_dirs() -> tuple[str, ...]:
    import sysconfig

    import torch

    return os.path.dirname(torch.__file__) + os.sep, sysconfig.get_paths()["stdlib"] + os.sep


def main_thread_position() -> tuple[str, bool]:
    """(where the main thread is, whether it is waiting in a collective), from one sample of its stack.

    Where: the torch.distributed function it is in, if any, and its innermost frame outside torch and the
    standard library ("in all_reduce at tpzoo/parallel/comm.py:114 all_reduce", "at train.py:40 load"). Waiting:
    its innermost Python frame is in torch.distributed or in tpzoo's collective wrappers (a gloo collective, or a
    `.wait()` on one, blocks there)."""
    frame = sys._current_frames().get(threading.main_thread().ident)
    if frame is None:
        return "exited", False
    innermost, dist_fn, own = frame, None, None
    library = _library_dirs()
    try:
        while frame is not None:
            path = frame.f_code.co_filename
            if dist_fn is None and "torch" in path and "distributed_c10d" in path:
                dist_fn = frame.f_code.co_name
            if own is None and not path.startswith(library) and not path.startswith("<"):
                own = frame
            frame = frame.f_back
        path = innermost.f_code.co_filename
        waiting = (os.sep + os.path.join("torch", "distributed") + os.sep) in path or path.endswith(_WAIT_FILES)
        at = own or innermost
        where = (f"in {dist_fn} " if dist_fn else "") + f"at {_short(at.f_code.co_filename)}:{at.f_lineno} " \
                                                        f"{at.f_code.co_name}"
        return where, waiting
    finally:
        del frame, innermost, own  # never keep the main thread's locals (tensors) alive


def _short(path: str) -> str:
    if path.startswith(_TPZOO_DIR):
        return os.path.relpath(path, os.path.dirname(_TPZOO_DIR))
    return os.path.basename(path)


def collective_counts(groups: dict) -> dict:
    """Collectives issued so far on each named group (the process group's sequence number: it moves when this
    rank issues a collective, so a rank that has not reached one has a smaller count than its peers)."""
    counts = {}
    for name, group in groups.items():
        getter = getattr(group, "_get_sequence_number_for_group", None)
        if getter is None:
            continue
        try:
            counts[name] = int(getter())
        except Exception:  # noqa: BLE001 - a backend without sequence numbers: rule (b) does without this group
            pass
    return counts


# --- the rules ----------------------------------------------------------------------------------------------------

@dataclass
class Peer:
    rank: int
    seen_at: float                 # this rank's monotonic time when the peer's counter last moved (or watching began)
    beat: int = -1
    record: dict | None = None

    def update(self, record: dict | None, now: float) -> None:
        if record is not None and record.get("beat") != self.beat:
            self.beat, self.record, self.seen_at = record.get("beat"), record, now


@dataclass
class Self:
    """This rank's own view: its collective counts, since when they have not moved, and where it waits."""
    rank: int
    group_ranks: dict                  # group name -> member ranks (this rank's groups)
    counts: dict = field(default_factory=dict)
    still_since: float = 0.0
    where: str = ""
    waiting: bool = False              # its main thread is in a collective call (a gloo wait blocks there)
    # NCCL collectives return at once on the host, which then blocks at the next synchronisation (.item(),
    # .tolist()), outside torch.distributed: with NCCL, any long time without a new collective counts as waiting.
    nccl: bool = False


def _who(rank: int, record: dict | None) -> str:
    if not record:
        return f"rank {rank}"
    return f"rank {rank} (host {record.get('host', '?')}, pid {record.get('pid', '?')})"


def _doing(record: dict | None) -> str:
    parts = [record.get("where") or "", record.get("note") or ""]
    return "; ".join(p for p in parts if p)


def judge(me: Self, peers: list[Peer], now: float, timing: Timing) -> str | None:
    """The report for what this rank sees now, or None. Rule (a) first (a silent peer), then rule (b)."""
    live = [p for p in peers if not (p.record and p.record.get("state") == "exited")]
    silent = [p for p in live if now - p.seen_at >= timing.stall_after]
    if silent:
        names = "; ".join(f"{_who(p.rank, p.record)} has sent no heartbeat for {now - p.seen_at:.0f} s "
                          f"({'last seen ' + _doing(p.record) if p.record else 'never heard from'})" for p in silent)
        return (f"{names}: stopped, frozen or dead (noticed by rank {me.rank}; with --dist-timeout "
                f"{timing.timeout:g} s a silent rank is named after {timing.stall_after:g} s)")
    waited = now - me.still_since
    if not (me.waiting or me.nccl) or waited < timing.hang_after:
        return None
    behind = []
    for p in live:
        theirs = (p.record or {}).get("counts")
        if theirs is None or (p.record or {}).get("waiting", True):
            continue
        late = [g for g, ranks in me.group_ranks.items()
                if p.rank in ranks and g in me.counts and g in theirs and theirs[g] < me.counts[g]]
        if late:
            behind.append((p, late[0]))
    if not behind:
        return None
    names = "; ".join(f"{_who(p.rank, p.record)} has not reached it ({g} group): it is {_doing(p.record)}"
                      for p, g in behind)
    return (f"rank {me.rank} has waited {waited:.0f} s {me.where}; {names} "
            f"(busy or deadlocked; --dist-timeout {timing.timeout:g} s)")


# --- the thread ---------------------------------------------------------------------------------------------------

def watched_ranks(rank: int, world_size: int) -> list[int]:
    if world_size <= MAX_WATCHED_ALL + 1:
        return [r for r in range(world_size) if r != rank]
    near = {(rank + d) % world_size for d in range(-RING_NEIGHBOURS, RING_NEIGHBOURS + 1)}
    return sorted(near - {rank})


class Watchdog:
    def __init__(self, dims, timing: Timing, store, prefix: str, command: str | None, store_timeout: float):
        import torch.distributed as dist

        self.timing, self.store, self.prefix, self.command = timing, store, prefix, command
        self.store_timeout = store_timeout
        self.rank = dims.rank
        self.groups = {"world": dist.group.WORLD, **dims.groups}
        group_ranks = {"world": list(range(dims.world_size)), **dims.group_ranks}
        now = time.monotonic()
        self.me = Self(self.rank, group_ranks, still_since=now, nccl=dist.get_backend() == "nccl")
        self.peers = [Peer(r, seen_at=now) for r in watched_ranks(self.rank, dims.world_size)]
        self.host, self.pid, self.beat = socket.gethostname(), os.getpid(), 0
        self.store_ok_at = now
        self._stop = threading.Event()
        self._publish("running")  # before init_parallel returns: peers see this rank from the start
        self.thread = threading.Thread(target=self._run, name="tpzoo-watchdog", daemon=True)
        self.thread.start()

    def _key(self, rank: int) -> str:
        return f"{self.prefix}/{rank}"

    def _publish(self, state: str) -> None:
        self.beat += 1
        record = {"beat": self.beat, "state": state, "host": self.host, "pid": self.pid, "note": _note,
                  "where": self.me.where, "waiting": self.me.waiting, "counts": self.me.counts}
        self.store.set(self._key(self.rank), json.dumps(record))

    def _read_peers(self) -> list[dict | None]:
        keys = [self._key(p.rank) for p in self.peers]
        if self.store.check(keys):
            values = self.store.multi_get(keys)
        else:  # some peer has not published yet (get would block until it does)
            values = [self.store.get(k) if self.store.check([k]) else None for k in keys]
        return [json.loads(v) if v is not None else None for v in values]

    def _observe_self(self, now: float) -> None:
        counts = collective_counts(self.groups)
        if counts != self.me.counts:
            self.me.counts, self.me.still_since = counts, now
        self.me.where, self.me.waiting = main_thread_position()

    def _run(self) -> None:
        try:
            last = time.monotonic()
            while not self._stop.wait(self.timing.interval):
                now = time.monotonic()
                if now - last > 3 * self.timing.interval:
                    # This thread did not run for a while (the whole job was stopped and continued, e.g. Ctrl-Z,
                    # or the machine was starved): what it saw is stale, so start watching afresh.
                    self.me.still_since = now
                    for p in self.peers:
                        p.seen_at = now
                    self.store_ok_at = now
                last = now
                self._observe_self(now)
                try:
                    self._publish("running")
                    records = self._read_peers()
                    self.store_ok_at = now
                except Exception:  # noqa: BLE001 - the store is slow or gone: judged below, not raised
                    if now - self.store_ok_at >= self.timing.stall_after and not self._stop.is_set():
                        self._fail(f"rank {self.rank} lost the job's store at {os.environ.get('MASTER_ADDR')}:"
                                   f"{os.environ.get('MASTER_PORT')} for {now - self.store_ok_at:.0f} s: the "
                                   f"launcher (torchrun's agent or tpzoo's) is stopped or gone", claim=False)
                    continue
                for peer, record in zip(self.peers, records):
                    peer.update(record, now)
                report = judge(self.me, self.peers, now, self.timing)
                if report and not self._stop.is_set():
                    self._fail(report)
        except BaseException:  # noqa: BLE001 - never print from a daemon thread at exit
            pass

    def _fail(self, report: str, claim: bool = True) -> None:
        from tpzoo.errors import claim_report

        if not claim or claim_report():
            print(f"tpzoo {self.command or 'rank'}: error: {report}", file=sys.stderr, flush=True)
        try:
            sys.stdout.flush()
        finally:
            os._exit(STALL_EXIT)

    def stop(self) -> None:
        """End the thread, then say "exited" from here. The thread must be gone before the interpreter shuts
        down: a daemon thread still inside a store call then (the call has released the GIL) is torn down
        mid-C++ and aborts the process ("terminate called without an active exception"). Its store calls are
        bounded by the store's timeout, so the join is too."""
        self._stop.set()
        if self.thread is threading.current_thread():
            return
        self.thread.join(timeout=self.store_timeout + 2 * self.timing.interval + 5.0)
        if not self.thread.is_alive():
            try:
                self._publish("exited")  # peers never report a rank that left on purpose
            except Exception:  # noqa: BLE001 - the store is gone with the launcher: nobody is watching
                pass


# --- start / stop (init_parallel, destroy_parallel) ------------------------------------------------------------------

def start(dims, timeout: datetime.timedelta) -> None:
    """Start this rank's watchdog (init_parallel calls this after creating the groups; one rank: nothing)."""
    global _active, _generation
    stop()
    if dims.world_size <= 1:
        return
    _generation += 1  # on every rank alike, whatever happens below: the ranks' keys stay in step
    prefix = f"tpzoo/watchdog/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}/{_generation}"
    timing = Timing.for_timeout(timeout.total_seconds())
    store_timeout = max(2 * timing.interval, 5.0)
    from tpzoo.errors import job_store

    store = job_store(store_timeout)
    if store is None:  # no job store to publish into: no watchdog (the collective timeout remains)
        return
    try:
        _active = Watchdog(dims, timing, store, prefix, _command, store_timeout)
    except Exception:  # noqa: BLE001 - the store refused the first heartbeat: run without (the timeout remains)
        _active = None


def stop() -> None:
    """Stop the watchdog (destroy_parallel calls this): its last heartbeat says "exited"."""
    global _active
    watchdog, _active = _active, None
    if watchdog is not None:
        watchdog.stop()


def active() -> Watchdog | None:
    return _active


atexit.register(stop)
