"""Strict collective mode: NCCL's asynchronous contract enforced on CPU (TPZOO_STRICT_COLLECTIVES=1).

On CUDA with NCCL a collective started with `async_op=True` runs on NCCL's own stream and may read its input and
write its output at any moment until `wait()`. gloo on CPU, in practice, has finished before the caller looks, so
code that reads an output early, writes an input early, or never waits passes every CPU test and then corrupts
training on a cluster. In strict mode every transfer `tpzoo.parallel.comm` starts asynchronously behaves like the
worst schedule NCCL may legally produce:

- its output (the caller's `out` of `*_into_start`, the tensor itself for an in-place all-reduce, the buffers of a
  point-to-point receive) is poisoned at start: NaN for floating dtypes (a signalling NaN, whose bits any
  arithmetic changes), a sentinel for integer ones (the most negative value; True for bool). The real result is computed into a private buffer and copied in by `wait()`,
  so a read before `wait()` sees poison, which propagates into the loss;
- its input is snapshotted at start; `wait()` raises `CollectiveMisuse` if the input changed ("all_gather_into:
  input modified before wait() (group dp, started at ...)"), and also if the poisoned output was written;
- point-to-point messages travel untagged, each after a header naming it, as NCCL pairs two ranks' messages in
  posting order whatever their tags: a receive that gets another message than it was posted for is an error;
- a group's point-to-point batches run one after another, as on NCCL's stream for the group: a receive posted
  ahead of a send the peer needs first hangs, and after P2P_TIMEOUT seconds fails naming both batches;
- every started handle is registered until waited: `check_all_waited(where)` raises naming where each one still
  outstanding was started. The trainer calls it at the end of every training step and evaluation, eval and
  generate at their end, the test harness after every call, and an exit hook at process exit. A handle meant to
  stay in flight across steps (Streaming DiLoCo's overlapped exchange, waited some steps later) is declared with
  `carry(handle)`: the end-of-step checks let it pass, the harness's and the exit hook's (`include_carried`) do
  not, so it must still be waited before the run returns.

Synchronous collectives (`comm.all_reduce`, `all_to_all`, ...) have no window to misuse and are unchanged. The
mode costs a copy of every input and output and a comparison at `wait()`: a debugging and CI mode, not for
production runs. The test suite turns it on for every test (tests/conftest.py); `strict_collectives(False)`
turns it off in a block.
"""
from __future__ import annotations

import atexit
import contextlib
import datetime
import os
import sys

import torch

from tpzoo.errors import brief

from .state import group_name

ENV = "TPZOO_STRICT_COLLECTIVES"


def _from_env() -> bool:
    return os.environ.get(ENV, "0").strip().lower() in ("1", "true", "yes", "on")


_enabled = _from_env()


class CollectiveMisuse(RuntimeError):
    """A collective's buffers were used against the asynchronous contract (strict mode)."""


def enabled() -> bool:
    return _enabled


def set_enabled(flag: bool) -> bool:
    """Turn strict mode on or off in this process; returns the previous setting."""
    global _enabled
    previous, _enabled = _enabled, bool(flag)
    return previous


@contextlib.contextmanager
def strict_collectives(flag: bool = True):
    """Strict mode on (or off) inside the block, whatever TPZOO_STRICT_COLLECTIVES says."""
    previous = set_enabled(flag)
    try:
        yield
    finally:
        set_enabled(previous)


# Signalling NaNs (exponent all ones, quiet bit clear, payload 1): a NaN to whoever reads it, and one that any
# arithmetic turns into a quiet NaN, changing its bits, so even `poisoned.add_(x)` (NaN in, NaN out) is seen as a
# write. float8 formats have no signalling NaN: their NaN is used (a write there is seen only if it changes bits).
_SIGNALLING_NAN = {torch.float32: (torch.int32, 0x7F800001), torch.float64: (torch.int64, 0x7FF0000000000001),
                   torch.float16: (torch.int16, 0x7C01), torch.bfloat16: (torch.int16, 0x7F81)}


def poison_(t: torch.Tensor) -> torch.Tensor:
    """Fill t with what no real result holds: a (signalling) NaN for floating dtypes, else an integer sentinel
    (the most negative value; True for bool)."""
    if t.dtype in _SIGNALLING_NAN:
        int_dtype, bits = _SIGNALLING_NAN[t.dtype]
        t.view(int_dtype).fill_(bits)
        return t
    if t.dtype.is_floating_point or t.dtype.is_complex:
        return t.fill_(float("nan"))
    if t.dtype == torch.bool:
        return t.fill_(True)
    return t.fill_(torch.iinfo(t.dtype).min)


def _bits(t: torch.Tensor) -> torch.Tensor:
    """t's bytes, so that NaN compares equal to itself (a snapshot may legitimately hold NaN)."""
    return t.detach().reshape(-1).view(torch.uint8)


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.numel() == 0 or torch.equal(_bits(a), _bits(b))


_HERE = (os.path.join("tpzoo", "parallel", "comm.py"), os.path.join("tpzoo", "parallel", "strict.py"),
         os.path.join("tpzoo", "parallel", "eager.py"))  # eager.py: the collectives' mark for torch.compile


def _started_at(depth: int = 3) -> str:
    """The innermost `depth` frames outside comm and this module: where the caller started the transfer."""
    frame, out = sys._getframe(1), []
    while frame is not None and len(out) < depth:
        path = frame.f_code.co_filename
        if not path.endswith(_HERE):
            out.append(f"{_short(path)}:{frame.f_lineno} ({frame.f_code.co_name})")
        frame = frame.f_back
    return " <- ".join(out) or "?"


def _short(path: str) -> str:
    for root in ("tpzoo", "models", "kernels", "tests", "scripts"):
        marker = os.sep + root + os.sep
        if marker in path:
            return root + os.sep + path.rsplit(marker, 1)[1]
    return os.path.basename(path)


def check_layout(kind: str, group, *tensors: torch.Tensor) -> None:
    """NCCL takes only contiguous tensors ("Tensors must be contiguous"), where gloo's all-reduce and broadcast
    accept strided ones: a transposed or sliced view handed to a collective passes every gloo test and fails on
    the first GPU cluster. Strict mode refuses it here (a no-op without the mode)."""
    if not enabled():
        return
    for t in tensors:
        if not t.is_contiguous():
            raise CollectiveMisuse(f"{kind}: a non-contiguous tensor (shape {tuple(t.shape)}, strides {t.stride()}; "
                                   f"group {group_name(group)}; at {_started_at()}): NCCL refuses it; pass "
                                   f".contiguous()")


_OUTSTANDING: dict[int, "Guard"] = {}


class Guard:
    """The strict-mode bookkeeping of one started transfer: snapshots of what it reads, poisoned outputs, where it
    was started. `check()` (called by the handle's wait(), after the transfer completed) raises on misuse."""

    def __init__(self, kind: str, group: str, reads=(), writes=(), in_place: bool = False):
        self.kind, self.group, self.in_place = kind, group, in_place
        self.where = _started_at()
        self.reads = [(t, t.detach().clone()) for t in reads]
        self.writes = [(t, poison_(t.detach()).clone()) for t in writes]
        self.carried = False  # in flight across steps on purpose (carry)
        _OUTSTANDING[id(self)] = self

    headers: list = []  # point-to-point receives: (header's op index, header buffer, tag, tensor, peer)
    ops: list = []

    def check_order(self, done: int | None) -> None:
        if self.headers:
            _check_order(self, done)

    def _fail(self, what: str) -> CollectiveMisuse:
        return CollectiveMisuse(f"{self.kind}: {what} before wait() (group {self.group}; started at {self.where})")

    def check(self) -> None:
        _OUTSTANDING.pop(id(self), None)
        reads, writes, self.reads, self.writes = self.reads, self.writes, [], []
        for t, snapshot in reads:
            if not _same(t, snapshot):
                raise self._fail("input modified")
        for t, poisoned in writes:
            if not _same(t, poisoned):
                raise self._fail("tensor modified (in place: it is the input and the output)" if self.in_place
                                 else "output written")


# -- point-to-point order (NCCL ignores tags) ------------------------------------------------------------------

_DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int64, torch.int32, torch.int16,
           torch.int8, torch.uint8, torch.bool]


def p2p_header(tag: int | None, t: torch.Tensor) -> torch.Tensor:
    """What strict mode sends before each point-to-point message: its tag, size and dtype (a receive's empty
    header buffer when `tag` is None). Messages travel untagged, so gloo pairs them by order, as NCCL does; the
    header says which message a receive really got."""
    if tag is None:
        return torch.empty(3, dtype=torch.int64, device=t.device)
    code = _DTYPES.index(t.dtype) if t.dtype in _DTYPES else -1
    return torch.tensor([tag, t.numel(), code], dtype=torch.int64, device=t.device)


def _check_order(guard: "Guard", done: int | None) -> None:
    """The receives whose header arrived (op index <= done; all when None) got the messages they were posted
    for; raise otherwise."""
    while guard.headers and (done is None or guard.headers[0][0] <= done):
        _, header, tag, t, peer = guard.headers.pop(0)
        got, numel, _ = header.tolist()
        if got != tag or numel != t.numel():
            _OUTSTANDING.pop(id(guard), None)  # waited, and reported here
        if got != tag:
            raise CollectiveMisuse(
                f"{guard.kind}: a receive from rank {peer} posted for the message tagged {tag} was matched with the "
                f"peer's message tagged {got}: NCCL pairs the sends and receives of two ranks in the order they "
                f"are posted and ignores tags, so receives must be posted in the order the peer sends (group "
                f"{guard.group}; started at {guard.where})")
        if numel != t.numel():
            raise CollectiveMisuse(f"{guard.kind}: a receive of {t.numel()} elements from rank {peer} got a message "
                                   f"of {numel} (tag {tag}; group {guard.group}; started at {guard.where})")


# NCCL puts a group's batched point-to-point operations on one stream, one batch after another, and a send may
# block until its receive is posted: a batch posted behind one that needs this rank's *later* batch deadlocks.
# Strict mode starts a group's batch only when the previous one has transferred, so such a schedule hangs here
# too, and after P2P_TIMEOUT seconds (TPZOO_STRICT_P2P_TIMEOUT) fails naming both batches.
P2P_TIMEOUT = float(os.environ.get("TPZOO_STRICT_P2P_TIMEOUT", "60"))
_LAST_BATCH: dict = {}  # group -> (Transfers handle, Guard) of its latest batch


def batch_started(group, handle) -> None:
    _LAST_BATCH[group] = handle


def after_previous_batch(group, kind: str, group_label: str) -> None:
    """Block until `group`'s previous point-to-point batch has transferred (see above)."""
    previous = _LAST_BATCH.pop(group, None)
    if previous is None or previous.transferred:
        return
    where = previous.guard.where if previous.guard is not None else "?"
    try:
        previous.transfer(datetime.timedelta(seconds=P2P_TIMEOUT))
    except CollectiveMisuse:
        raise
    except RuntimeError as e:
        raise CollectiveMisuse(
            f"{kind} on group {group_label}, started at {_started_at()}: the group's previous point-to-point batch "
            f"(started at {where}) did not complete within {P2P_TIMEOUT:g} s. NCCL runs a group's batches one "
            f"after another and a send may wait for its receive, so this order deadlocks on GPUs: post a "
            f"receive in the same batch as the sends it waits behind ({brief(e)})") from None


def outstanding() -> list[str]:
    """What is started and not yet waited, one line each (strict mode registers every transfer)."""
    return [f"{g.kind} on group {g.group}, started at {g.where}" for g in _OUTSTANDING.values()]


def carry(handle) -> None:
    """Declare a started handle (a comm.Pending) in flight across training steps on purpose: the end-of-step
    checks let it pass until it is waited (module docstring). A no-op without strict mode."""
    guard = getattr(handle, "guard", None)
    if guard is not None:
        guard.carried = True


def check_all_waited(where: str, include_carried: bool = False) -> None:
    """Raise if a transfer started in strict mode was never waited by `where` (e.g. "the end of training step
    3"); carried handles (`carry`) count only with `include_carried`. What is reported leaves the registry, so
    one mistake is reported once."""
    left = [g for g in _OUTSTANDING.values() if include_carried or not g.carried]
    if not left:
        return
    for g in left:
        _OUTSTANDING.pop(id(g), None)
    lines = [f"{g.kind} on group {g.group}, started at {g.where}" for g in left]
    raise CollectiveMisuse(f"{len(left)} collective(s) started and never waited by {where}: " + "; ".join(lines))


def forget() -> None:
    """Drop the registry without checking (after a call that already failed: its leftovers are not news)."""
    _OUTSTANDING.clear()
    _LAST_BATCH.clear()


@atexit.register
def _at_exit() -> None:
    if not _OUTSTANDING or getattr(sys, "last_value", None) is not None:
        return  # nothing left, or the process is already dying of an exception (that one is the news)
    try:
        check_all_waited("process exit", include_carried=True)
    except CollectiveMisuse as e:
        sys.stderr.write(f"tpzoo: error: {e}\n")
        sys.stderr.flush()
        os._exit(1)
