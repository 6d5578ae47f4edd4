"""A run directory belongs to one run: its lock, and the fresh / resume / overwrite decision.
(docs/reliability.md, "A run directory belongs to one run".)

    SAVE/.tpzoo.lock            JSON {pid, host, started, token, ...}: the run that owns SAVE (rank 0 of its job)
    SAVE/.replaced-<time>/      what --overwrite moved aside: the previous run's checkpoints, `latest`, logs

`claim(cfg, dims)` runs on every rank before any work. Rank 0 locks each run directory (--save, and --log-dir
when it is another directory), refuses a fresh run into a directory that already holds a run (unless
--overwrite, which moves that run aside), removes the temporary save directories whose writer is gone
(checkpointing.remove_stale_temp_dirs), and picks the checkpoint to resume. The other ranks receive the
outcome, or the same error, by one broadcast: a refusal is one line, and no rank has read data or built a model.
Only rank 0 touches the lock, so ranks never contend for it, and ranks on other nodes (which see the same shared
directory) never do either.

A lock is stale when its process is gone: same host and the pid no longer runs (or runs another program: the
process start time in the lock differs). A stale lock is taken over with a message. A lock from another host
cannot be checked from here and is never taken over: the message says to delete it once that run is gone.
"""
from __future__ import annotations

import datetime
import json
import os
import re
import sys
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

from tpzoo.errors import ConfigError, UserError
from tpzoo.processes import pid_alive, proc_stat, this_host

LOCK_NAME = ".tpzoo.lock"
LOCK_FORMAT = "tpzoo-run-lock"
REPLACED_PREFIX = ".replaced-"
RESUME_NEWEST = ("auto", "latest")  # --resume auto (documented; 'latest' and the bare flag are aliases)
HOLD_ENV = "TPZOO_TEST_HOLD_LOCK"  # testing aid: once locked, rank 0 waits until this file exists
_STEP_DIR = re.compile(r"^step_\d+$")

_held: dict[str, str] = {}  # lock path -> token of the locks this process holds now


class RunDirInUse(UserError):
    """Another run owns the directory (its lock is held by a live process, or cannot be judged)."""


class RunDirNotEmpty(UserError):
    """A fresh run was started in a directory that holds a run."""


def warn(text: str) -> None:
    """A warning on stderr, one line (shown even with --quiet: something was skipped or taken over)."""
    print(f"tpzoo: warning: {text}", file=sys.stderr, flush=True)


# -- the lock -------------------------------------------------------------------------------------------------------

def _new_lock_info() -> dict:
    stat = proc_stat(os.getpid())
    return {"format": LOCK_FORMAT, "pid": os.getpid(), "host": this_host(),
            "started": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
            "proc_start": stat[1] if stat else None, "token": uuid.uuid4().hex,
            "command": " ".join(sys.argv)[:300]}


def describe_holder(info: dict) -> str:
    return f"pid {info.get('pid')} on host {info.get('host')}, started {info.get('started')}"


def read_lock(path) -> dict | None:
    """The lock's contents; None when there is no lock; ValueError when it cannot be read as one."""
    for _ in range(10):  # a lock created without hard links is written after it appears: give it a moment
        try:
            text = Path(path).read_text()
        except FileNotFoundError:
            return None
        if text.strip():
            break
        time.sleep(0.1)
    try:
        info = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"not JSON ({e})") from None
    if not isinstance(info, dict) or info.get("format") != LOCK_FORMAT:
        raise ValueError("not a tpzoo run lock")
    return info


def _create_lock(path: Path, info: dict) -> bool:
    """Create the lock holding `info` unless one exists (atomically: a hard link of a complete file, which also
    works on NFS; an exclusive create where the file system has no hard links)."""
    text = json.dumps(info, indent=1) + "\n"
    tmp = path.with_name(f"{path.name}.{info['token']}.tmp")
    tmp.write_text(text)
    try:
        os.link(tmp, path)
        return True
    except FileExistsError:
        return False
    except OSError:
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        except FileExistsError:
            return False
        with os.fdopen(fd, "w") as f:
            f.write(text)
        return True
    finally:
        tmp.unlink(missing_ok=True)


def _stale_reason(path: Path, info: dict) -> str | None:
    """Why the holder of a lock is gone, or None while it may still run."""
    if info.get("host") != this_host():
        return None  # another machine's processes cannot be checked from here
    pid = info.get("pid")
    if pid == os.getpid():
        if _held.get(str(path)) == info.get("token"):
            return None  # this process holds it right now (a second run in the same process)
        return "left by an earlier run in this process"
    if not pid_alive(pid, info.get("proc_start")):
        return f"process {pid} is no longer running"
    return None


@dataclass
class RunLock:
    path: Path
    info: dict

    def release(self) -> None:
        """Delete the lock if it is still this run's (never another run's that took it over)."""
        if _held.pop(str(self.path), None) != self.info["token"]:
            return
        try:
            current = read_lock(self.path)
        except ValueError:
            return
        if current is not None and current.get("token") == self.info["token"]:
            self.path.unlink(missing_ok=True)


def acquire_lock(directory) -> RunLock:
    """Lock `directory` (created if needed) for this process; refuse with one line naming the directory and the
    holder while another run holds it; take over a stale lock with a warning."""
    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    path = d / LOCK_NAME
    info = _new_lock_info()
    took_over = None
    for _ in range(5):
        if _create_lock(path, info):
            _held[str(path)] = info["token"]
            if took_over:
                warn(f"{d}: took over the lock of a run that is gone ({took_over})")
            return RunLock(path, info)
        try:
            held = read_lock(path)
        except ValueError as e:
            raise RunDirInUse(f"{d} has an unreadable lock file {path} ({e}): if no run uses {d}, delete "
                              f"{path} and start again") from None
        if held is None:
            continue  # released meanwhile: try again
        reason = _stale_reason(path, held)
        if reason is None:
            remote = held.get("host") != this_host()
            raise RunDirInUse(f"{d} is in use by another run ({describe_holder(held)}): wait for it to end or use "
                              f"another --save" + (f"; if that run is gone, delete {path}" if remote else ""))
        # Take it over: move the stale lock aside, then check that what moved is the lock judged stale (another
        # starting run may have replaced it meanwhile; then put that one back).
        grave = path.with_name(f"{path.name}.stale-{info['token']}")
        try:
            os.rename(path, grave)
        except FileNotFoundError:
            continue
        try:
            moved = read_lock(grave)
        except ValueError:
            moved = None
        if moved is None or moved.get("token") != held.get("token"):
            try:
                os.link(grave, path)
            except OSError:
                pass
            grave.unlink(missing_ok=True)
            continue
        grave.unlink(missing_ok=True)
        took_over = f"{describe_holder(held)}: {reason}"
    raise RunDirInUse(f"{d}: could not take the lock {path} (several runs are starting there at once)")


# -- what a run leaves in its directory -------------------------------------------------------------------------

def run_contents(directory) -> list[Path]:
    """The entries of `directory` that belong to a run: checkpoints, the `latest` pointer and the logs (not the
    lock, not what --overwrite moved aside, not temporary directories, not unrelated files)."""
    d = Path(directory)
    if not d.is_dir():
        return []
    found = [p for p in d.iterdir()
             if (_STEP_DIR.match(p.name) and p.is_dir()) or p.name in ("latest", "metrics.jsonl", "curves.png")
             or p.name.startswith("events.out.tfevents.")]
    return sorted(found, key=lambda p: p.name)


def move_aside(directory, entries: list[Path]) -> Path:
    """--overwrite: move a previous run's entries into DIR/.replaced-<time>/ (renames within the directory: no
    copy, nothing deleted); returns that directory."""
    d = Path(directory)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    dest, n = d / f"{REPLACED_PREFIX}{stamp}", 1
    while True:
        try:
            dest.mkdir()
            break
        except FileExistsError:
            n += 1
            dest = d / f"{REPLACED_PREFIX}{stamp}-{n}"
    for p in entries:
        os.rename(p, dest / p.name)
    return dest


def _summary(entries: list[Path]) -> str:
    """'2 checkpoints up to step_00000004, metrics.jsonl, TensorBoard events' (for the one-line messages)."""
    steps = [p.name for p in entries if _STEP_DIR.match(p.name)]
    names = {p.name for p in entries}
    parts = [f"{len(steps)} checkpoint{'s' if len(steps) != 1 else ''} up to {steps[-1]}"] if steps else []
    parts += [n for n in ("metrics.jsonl", "curves.png") if n in names]
    if any(n.startswith("events.out.tfevents.") for n in names):
        parts.append("TensorBoard events")
    return ", ".join(parts) or "latest"


def _is_within(path, directory) -> bool:
    a, b = os.path.realpath(path), os.path.realpath(directory)
    return a == b or a.startswith(b.rstrip(os.sep) + os.sep)


def run_dirs(cfg) -> list[Path]:
    """The directories a run writes into: --save, and --log-dir when it is another one."""
    out: list[Path] = []
    for d in (cfg.save, cfg.log_dir):
        if d and not any(os.path.realpath(d) == os.path.realpath(o) for o in out):
            out.append(Path(d))
    return out


def _prepare(cfg) -> Path | None:
    """Rank 0, holding the locks: the fresh / resume / overwrite decision; returns the checkpoint to resume."""
    from . import checkpointing as ckpt

    if cfg.save:
        ckpt.remove_stale_temp_dirs(cfg.save)
    resume_here = bool(cfg.resume) and (cfg.resume in RESUME_NEWEST
                                        or bool(cfg.save) and _is_within(cfg.resume, cfg.save))
    if cfg.overwrite and resume_here:
        raise ConfigError(f"--overwrite starts a new run in {cfg.save}, --resume {cfg.resume} continues the one "
                          f"there: pass one of them")
    if not resume_here:  # a new run in these directories (also one resuming a checkpoint from elsewhere)
        for d in run_dirs(cfg):
            entries = run_contents(d)
            if not entries:
                continue
            if not cfg.overwrite:
                if cfg.resume:
                    raise RunDirNotEmpty(f"{d} already holds a run ({_summary(entries)}) and --resume {cfg.resume} "
                                         f"is not one of its checkpoints: use another --save, or pass --overwrite "
                                         f"to move that run aside")
                raise RunDirNotEmpty(f"{d} already holds a run ({_summary(entries)}): pass --resume to continue it, "
                                     f"or --overwrite to start a new run there (the old one is moved to "
                                     f"{d / (REPLACED_PREFIX + '<time>')})")
            dest = move_aside(d, entries)
            print(f"--overwrite: moved the previous run in {d} ({_summary(entries)}) to {dest}", flush=True)
    return ckpt.resolve_resume(cfg, say=warn)


def _hold_for_test() -> None:
    target = os.environ.get(HOLD_ENV)
    deadline = time.monotonic() + 120
    while target and not os.path.exists(target) and time.monotonic() < deadline:
        time.sleep(0.05)


# -- the whole job --------------------------------------------------------------------------------------------------

@dataclass
class RunDir:
    """What claim() gives every rank: the checkpoint to resume (None: start at step 0) and, on rank 0, the locks."""
    resume_from: Path | None
    locks: list[RunLock] = field(default_factory=list)

    def release(self) -> None:
        for lock in reversed(self.locks):
            lock.release()
        self.locks = []


def _claim_here(cfg) -> RunDir:
    locks: list[RunLock] = []
    try:
        for d in run_dirs(cfg):
            locks.append(acquire_lock(d))
        _hold_for_test()
        return RunDir(_prepare(cfg), locks)
    except BaseException:
        for lock in reversed(locks):
            lock.release()
        raise


_ERRORS = {c.__name__: c for c in (RunDirInUse, RunDirNotEmpty, ConfigError, UserError)}


def _same_error(name: str, text: str, user: bool) -> Exception:
    """Rank 0's error, raised again on another rank (the report is printed once per job: tpzoo.errors)."""
    from tpzoo.checkpoint import CheckpointError

    if not user:
        return RuntimeError(f"rank 0 failed while claiming the run directory: {text}")
    cls = {**_ERRORS, "CheckpointError": CheckpointError}.get(name, UserError)
    return cls(text)


def claim(cfg, dims) -> RunDir:
    """Collective (every rank, first thing): rank 0 claims the run directories; every rank gets the checkpoint
    to resume, or rank 0's error."""
    import torch.distributed as dist

    from tpzoo.errors import is_user_error, message

    here, err, outcome = None, None, None
    if dims.rank == 0:
        try:
            here = _claim_here(cfg)
            outcome = ("ok", str(here.resume_from) if here.resume_from is not None else None)
        except Exception as e:  # noqa: BLE001 - re-raised here and, by name, on every other rank
            err, outcome = e, ("error", type(e).__name__, message(e), is_user_error(e))
    if dims.world_size > 1 and dist.is_initialized():
        box = [outcome]
        dist.broadcast_object_list(box, src=0)
        outcome = box[0]
    if err is not None:
        raise err
    if here is not None:
        return here
    if outcome[0] == "error":
        raise _same_error(*outcome[1:])
    return RunDir(Path(outcome[1]) if outcome[1] else None)
