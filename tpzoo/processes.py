"""Is a process still there? For the owner records tpzoo leaves on disk (a run directory's lock, a temporary
checkpoint directory): a record of a process that certainly no longer runs on this host can be taken over or
cleaned up; anything uncertain (another host, no /proc) is left alone by the callers."""
from __future__ import annotations

import os
import socket
from pathlib import Path


def this_host() -> str:
    return socket.gethostname()


def boot_id() -> str:
    """This boot of this machine ('' when unknown): a pid recorded before a reboot means nothing now."""
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return ""


def proc_stat(pid: int) -> tuple[str, str] | None:
    """(state, start time in clock ticks) of a process from /proc, or None (no such process, or no /proc)."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = text.rsplit(")", 1)[-1].split()  # after the command name, which may hold spaces and parentheses
    return fields[0], fields[19]


def pid_alive(pid: int, start: str | None = None) -> bool:
    """Whether process `pid` of this host still runs (a zombie does not) and, given its start time, is still the
    same process (a pid is reused after a while)."""
    if not isinstance(pid, int) or pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass  # exists, owned by another user
    stat = proc_stat(pid)
    if stat is None:
        return not Path("/proc/self/stat").exists()  # without /proc, kill's answer is all there is
    state, started = stat
    if state in ("Z", "X"):  # exited, not yet reaped
        return False
    return start is None or started == start
