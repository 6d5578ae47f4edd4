"""All-or-nothing output directories, and the temporary directories that killed writers leave behind.

`atomic_dir(final)` writes into a temporary sibling `.FINAL.tmp-PID-XXXXXXXX` and renames it to FINAL only once
complete. A process killed meanwhile (SIGKILL, OOM, a lost node) cannot clean up, so its temporary directory
stays. Two things make that harmless:

- it never passes for a checkpoint: it holds a marker file (OWNER_FILE) until just before the rename, and its
  name has the temporary pattern; `is_temp_dir` recognizes either, and every reader refuses such a directory;
- the next `atomic_dir(final, clean_stale=True)` into the same FINAL (conversion, reshard) removes it, saying so,
  but only when the marker shows that its writer is gone: same host and boot, and that pid no longer running.
  A directory whose writer may be alive (another host, a running pid, no readable marker) is left alone; a
  reused pid only delays the cleanup, it never removes a live writer's directory.

The name keeps the `.FINAL.tmp-` prefix that tpzoo.train's own cleanup of `.step_*` directories matches.
"""
from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import sys
import uuid
from pathlib import Path

from tpzoo.processes import boot_id, pid_alive, this_host

OWNER_FILE = ".tpzoo-incomplete"  # inside a temporary directory until it is renamed into place: who writes it
TEMP_INFIX = ".tmp-"
# `.NAME.tmp-PID-RANDOM` (this module) or `.NAME.tmp-XXXXXXXX` (tempfile.mkdtemp, tpzoo before the pid was added)
_TEMP_NAME = re.compile(r"^\..+\.tmp-(\d+-[0-9a-f]{8}|[A-Za-z0-9_]{8})$")


def temp_name(final: Path) -> str:
    return f".{final.name}{TEMP_INFIX}{os.getpid()}-{uuid.uuid4().hex[:8]}"


def is_temp_dir(path) -> bool:
    """Whether `path` is (inside) the temporary directory of an unfinished atomic write."""
    p = Path(os.path.abspath(path))
    if (p / OWNER_FILE).exists() or _TEMP_NAME.match(p.name):
        return True
    # A checkpoint nested in an unfinished one (a training save's optim/exp_avg) is unfinished too.
    return any((parent / OWNER_FILE).exists() for parent in p.parents)


def _write_owner(tmp: Path, final: Path) -> None:
    owner = {"pid": os.getpid(), "host": this_host(), "boot_id": boot_id(), "final": final.name}
    (tmp / OWNER_FILE).write_text(json.dumps(owner) + "\n")


def read_owner(tmp) -> dict | None:
    """The writer recorded in a temporary directory, or None (no marker yet, or not readable)."""
    try:
        owner = json.loads((Path(tmp) / OWNER_FILE).read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(owner, dict) or not isinstance(owner.get("pid"), int) or not isinstance(owner.get("host"), str):
        return None
    return owner


def writer_gone(owner: dict | None) -> bool:
    """True only when the recorded writer certainly no longer runs (so its directory can be removed)."""
    if owner is None or owner["host"] != this_host():
        return False  # unknown writer, or one on another host sharing this file system: never guess
    boot = boot_id()
    if owner.get("boot_id") and boot and owner["boot_id"] != boot:
        return True  # written before this machine rebooted
    return owner["pid"] != os.getpid() and not pid_alive(owner["pid"])


def temp_dirs(directory, name_prefix: str = ".") -> list[tuple[Path, dict | None]]:
    """(directory, recorded writer or None) of every temporary directory of an atomic write inside `directory`
    whose name starts with `name_prefix` (e.g. `.DST.tmp-`: the writes into DST)."""
    d = Path(directory)
    if not d.is_dir():
        return []
    return [(p, read_owner(p)) for p in sorted(d.iterdir())
            if p.name.startswith(name_prefix) and _TEMP_NAME.match(p.name) and p.is_dir() and not p.is_symlink()]


def stale_temp_dirs(final) -> list[tuple[Path, dict]]:
    """(directory, owner) of every temporary directory of a write into `final` whose writer is gone."""
    final = Path(final)
    return [(p, owner) for p, owner in temp_dirs(final.parent, f".{final.name}{TEMP_INFIX}") if writer_gone(owner)]


def remove_stale_temp_dirs(final, log=None) -> list[Path]:
    """Remove what killed writes into `final` left behind (see the module doc); `log(message)` for each."""
    log = log or (lambda msg: print(msg, file=sys.stderr, flush=True))
    removed = []
    for p, owner in stale_temp_dirs(final):
        shutil.rmtree(p, ignore_errors=True)
        if not p.exists():
            removed.append(p)
            log(f"tpzoo: removed {p}: the temporary directory of an earlier write into {final} that did not "
                f"finish (process {owner['pid']} on {owner['host']} is gone)")
    return removed


# --- atomic output ---------------------------------------------------------------------------------------------

def _dist_world():
    import torch.distributed as dist

    return dist if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1 else None


def _broadcast(obj, dist):
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


@contextlib.contextmanager
def atomic_dir(final, force: bool = False, clean_stale: bool = False):
    """Yield a fresh temporary directory next to `final`; on success rename it to `final` (replacing an existing
    one only with force, and only now that the new one is complete); on failure delete it, leaving `final`
    untouched. Under torch.distributed every rank must enter it (rank 0 does the file system work; all ranks
    get the same temporary path, and the rename happens only if every rank succeeded).
    clean_stale: first remove the temporary directories of earlier writes into `final` whose process is gone
    (a message on stderr names each)."""
    final = Path(final)
    dist = _dist_world()
    tmp, err = None, None
    if dist is None or dist.get_rank() == 0:
        if final.exists() and not force:
            err = FileExistsError(f"{final} already exists (pass --force / force=True to replace it)")
        else:
            try:
                final.parent.mkdir(parents=True, exist_ok=True)
                if clean_stale:
                    remove_stale_temp_dirs(final)
                tmp = final.parent / temp_name(final)
                tmp.mkdir(mode=0o777)  # the umask applies, as for any directory the user creates
                _write_owner(tmp, final)
            except OSError as e:  # a full disk, no permission: on every rank, and no directory left without owner
                if tmp is not None:
                    shutil.rmtree(tmp, ignore_errors=True)
                tmp, err = None, e
    if dist is not None:
        tmp, err = _broadcast((tmp, err), dist)
    if err:
        raise err
    ok = False
    try:
        yield Path(tmp)
        ok = True
    finally:
        if dist is not None:  # an object collective: no tensor whose device must suit the backend
            flags = [None] * dist.get_world_size()
            dist.all_gather_object(flags, ok)
            ok = all(flags)
        if dist is None or dist.get_rank() == 0:
            if ok:
                _commit(Path(tmp), final)
            else:
                shutil.rmtree(tmp, ignore_errors=True)
        if dist is not None:
            dist.barrier()


def _commit(tmp: Path, final: Path) -> None:
    # The marker goes first: a kill between the two steps leaves a complete directory that still has a
    # temporary name (refused by readers, removed by the next write), never a final one that looks unfinished.
    (tmp / OWNER_FILE).unlink(missing_ok=True)
    if not final.exists() and not final.is_symlink():
        os.rename(tmp, final)
        return
    old = final.with_name(f".{final.name}.old-{uuid.uuid4().hex[:8]}")
    os.rename(final, old)
    os.rename(tmp, final)
    if old.is_dir() and not old.is_symlink():
        shutil.rmtree(old, ignore_errors=True)
    else:
        old.unlink()
