"""User errors: one clear line, once, exit status 2; internal errors (bugs) keep their traceback.

A user error is anything the user can fix: a flag, a config value, a data file, a checkpoint, a Hugging Face
directory, a parallel layout. Its message names what is wrong and where (the file, the field, the line). Every
command reports it as

    tpzoo <command>: error: <message>

on stderr and exits with status 2; `--debug` (or TPZOO_DEBUG=1) shows the traceback too.

On several ranks the same error usually happens on every rank (or one rank's failure makes the others fail in a
collective). The first rank to fail claims the report through the job's rendezvous store (the process that
started the ranks holds it: torchrun's agent, or tpzoo's own launcher), prints the line and exits with status 2;
every later failure on another rank exits with status 2 silently, since its cause is already on screen.
"""
from __future__ import annotations

import datetime
import os
import sys
import traceback


class UserError(Exception):
    """A problem with what the user gave; the message names the file / field / line."""


class ConfigError(UserError, ValueError):
    """A bad configuration value, key, type, file, or a combination that cannot run."""


class DataError(UserError, ValueError):
    """A data file that cannot be read as what it should be (names the file and the line or byte offset)."""


# OS errors about paths the user gave (missing file, existing output, permissions, a full disk) name the path.
_OS_USER_ERRORS = (FileNotFoundError, FileExistsError, NotADirectoryError, IsADirectoryError, PermissionError)
_REPORT_KEY = "tpzoo/user-error"


def is_user_error(err: BaseException) -> bool:
    if isinstance(err, (UserError, *_OS_USER_ERRORS)):
        return True
    return isinstance(err, OSError) and not isinstance(err, ConnectionError) and err.errno is not None


def debug_enabled(args=None) -> bool:
    return bool(getattr(args, "debug", False)) or os.environ.get("TPZOO_DEBUG", "").lower() in ("1", "true", "yes")


def message(err: BaseException) -> str:
    """The one-line text of an error (a KeyError's repr quotes; its first argument does not)."""
    text = err.args[0] if isinstance(err, KeyError) and err.args else str(err)
    text = " ".join(str(text).split()) or type(err).__name__
    if isinstance(err, OSError) and err.filename and str(err.filename) not in text:
        text = f"{err.filename}: {text}"
    return text


def brief(err: BaseException, limit: int = 200) -> str:
    """`Type: first line` of an exception, the line cut at `limit` characters: for an error quoted inside another
    message (compilers and CUDA libraries raise pages; their first line names the failure)."""
    lines = str(err).strip().splitlines()
    return f"{type(err).__name__}: {lines[0][:limit] if lines else ''}"


def job_store(timeout: float = 5.0):
    """A client of the job's rendezvous store (MASTER_ADDR:MASTER_PORT: torchrun's agent or tpzoo's launcher holds
    it), or None when there is none to reach."""
    if "MASTER_PORT" not in os.environ:
        return None
    try:
        import torch.distributed as dist

        return dist.TCPStore(os.environ.get("MASTER_ADDR", "127.0.0.1"), int(os.environ["MASTER_PORT"]),
                             is_master=False, timeout=datetime.timedelta(seconds=timeout))
    except Exception:  # noqa: BLE001 - no store reachable: the callers fall back
        return None


def _rank_store():
    """The job's store when this process is one rank of several, else None."""
    return job_store() if int(os.environ.get("WORLD_SIZE", "1")) > 1 else None


def claim_report() -> bool:
    """True for the first rank of the job that reports an error (every rank when alone)."""
    store = _rank_store()
    if store is None:
        return int(os.environ.get("RANK", "0")) == 0
    try:
        return store.add(_REPORT_KEY, 1) == 1
    except Exception:  # noqa: BLE001
        return int(os.environ.get("RANK", "0")) == 0


def already_reported() -> bool:
    """Whether another rank of this job has already reported a user error (this failure is a consequence)."""
    store = _rank_store()
    if store is None:
        return False
    try:
        return store.check([_REPORT_KEY])
    except Exception:  # noqa: BLE001
        return False


def report(command: str, err: BaseException, *, debug: bool = False, ranks: bool = False) -> int:
    """Print `tpzoo <command>: error: <message>` (once per job when `ranks`), the traceback too with debug;
    return the exit status 2."""
    if ranks and not claim_report():
        return 2
    if debug:
        traceback.print_exception(err, file=sys.stderr)
    print(f"tpzoo {command}: error: {message(err)}", file=sys.stderr, flush=True)
    return 2


def fail_rank(command: str, err: BaseException, *, debug: bool = False) -> int:
    """A rank's exit status for an exception that ends it: 2 after reporting a user error (once per job), or after
    another rank's user error made this one fail too; None for an internal error (re-raise it: traceback)."""
    if is_user_error(err):
        return report(command, err, debug=debug, ranks=True)
    if already_reported() and not debug:
        return 2
    return None
