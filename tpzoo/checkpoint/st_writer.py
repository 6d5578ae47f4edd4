"""A streaming safetensors writer: header from declared shapes first, then the data, piece by piece.

A piece is either a tensor (its bytes are written) or `FileRuns`: byte ranges of another file that hold exactly
the piece (a shard of a tensor that another safetensors file stores with the same dtype). Those are copied by
the kernel (`os.copy_file_range`, as `shutil.copyfile` does), never passing through this process's memory.

Writing and checksumming run on two background threads (both release the GIL), overlapping each other and the
caller's preparation of the next piece. The file checksum (crc32 or sha256) covers every byte: copied ranges are
read back from the page cache once written. At most MAX_IN_FLIGHT pieces held in memory are outstanding, over
all writers of the process, which bounds the memory they take.
"""
from __future__ import annotations

import errno
import json
import os
import struct
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import torch

from .safetensors_io import Checksum, dtype_name, nbytes, tensor_bytes

MAX_IN_FLIGHT = 2   # pieces held in memory by the background threads, over all writers
MAX_QUEUED = 64     # kernel copies queued (they hold no memory)
_IN_FLIGHT: deque = deque()
_HASH_CHUNK = 8 << 20


@dataclass
class FileRuns:
    """`runs` = [(fd, offset, length)] whose concatenation is a piece of dtype `dtype`."""
    runs: list
    dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        return sum(n for _, _, n in self.runs)


def _wait(item) -> None:
    for fut in item[2:]:
        fut.result()  # re-raises a background error in the caller


def _copy_range(src_fd: int, dst_fd: int, offset: int, n: int, pos: int) -> None:
    try:
        while n:
            done = os.copy_file_range(src_fd, dst_fd, n, offset, pos)
            if done == 0:
                raise OSError(errno.EIO, f"copy_file_range copied nothing at offset {offset} (source truncated?)")
            offset, pos, n = offset + done, pos + done, n - done
    except OSError as e:
        if e.errno not in (errno.EXDEV, errno.ENOSYS, errno.EINVAL, errno.EOPNOTSUPP, errno.EBADF):
            raise
        while n:  # a file system or kernel without it: go through a buffer
            data = os.pread(src_fd, min(n, _HASH_CHUNK), offset)
            if not data:
                raise OSError(errno.EIO, f"short read at offset {offset} (source truncated?)") from None
            _pwrite_all(dst_fd, data, pos)
            offset, pos, n = offset + len(data), pos + len(data), n - len(data)


def _pwrite_all(fd: int, data, pos: int) -> None:
    view = memoryview(data).cast("B")
    while len(view):
        done = os.pwrite(fd, view, pos)
        view, pos = view[done:], pos + done


class SafetensorsWriter:
    """Tensors are declared up front, then written in declared order, each in one or several consecutive pieces
    (runs of its row-major bytes). `close()` returns (size in bytes, checksum "algo:hex")."""

    def __init__(self, path, entries: list[tuple[str, torch.dtype, tuple]], metadata: dict | None = None,
                 checksum: str = "crc32"):
        self.path = str(path)
        header, offset = {}, 0
        self._order = []
        for name, dtype, shape in entries:
            n = nbytes(dtype, shape)
            header[name] = {"dtype": dtype_name(dtype), "shape": list(shape), "data_offsets": [offset, offset + n]}
            self._order.append((name, dtype, tuple(shape), n))
            offset += n
        if metadata:
            header["__metadata__"] = {str(k): str(v) for k, v in metadata.items()}
        raw = json.dumps(header, separators=(",", ":")).encode()
        raw += b" " * (-len(raw) % 8)  # the reference writer aligns the data start to 8 bytes
        self.size = 8 + len(raw) + offset
        self._hash = Checksum(checksum)
        self._fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
        self._io = ThreadPoolExecutor(1, thread_name_prefix="st-write")
        self._hasher = ThreadPoolExecutor(1, thread_name_prefix="st-hash")
        self._pos = 0  # where the next piece goes
        self._back = None
        self._index, self._filled = 0, 0
        self._emit(struct.pack("<Q", len(raw)) + raw, 8 + len(raw))

    def _emit(self, data, n: int) -> None:
        copy = isinstance(data, FileRuns)
        # Pieces in memory are bounded by MAX_IN_FLIGHT; copies hold no memory, so more of them may queue up.
        while (len(_IN_FLIGHT) >= MAX_QUEUED or
               (not copy and sum(1 for item in _IN_FLIGHT if not item[1]) >= MAX_IN_FLIGHT)):
            _wait(_IN_FLIGHT.popleft())
        pos, self._pos = self._pos, self._pos + n
        if copy:
            io = self._io.submit(self._copy_runs, data.runs, pos)
            digest = self._hasher.submit(self._hash_back, io, pos, n)
        else:
            io = self._io.submit(_pwrite_all, self._fd, data, pos)
            digest = self._hasher.submit(self._hash.update, data)
        _IN_FLIGHT.append((self, copy, io, digest))

    def _copy_runs(self, runs, pos: int) -> None:
        for fd, offset, n in runs:
            _copy_range(fd, self._fd, offset, n, pos)
            pos += n

    def _hash_back(self, io, pos: int, n: int) -> None:
        io.result()
        if self._back is None:  # only the hasher thread uses it: one buffer for the writer's life
            self._back = memoryview(bytearray(_HASH_CHUNK))
        while n:
            got = os.preadv(self._fd, [self._back[: min(n, _HASH_CHUNK)]], pos)
            self._hash.update(self._back[:got])
            pos, n = pos + got, n - got

    def write(self, name: str, piece) -> None:
        """Append `piece` (a tensor or FileRuns: the whole tensor `name`, or its next run of rows)."""
        if self._index >= len(self._order):
            raise ValueError(f"{self.path}: {name}: every declared tensor is already written")
        while (self._index < len(self._order) - 1 and self._order[self._index][3] == 0
               and self._order[self._index][0] != name):
            self._index += 1  # an empty tensor that nobody wrote: it has no bytes anyway
        want, dtype, shape, n = self._order[self._index]
        if name != want or piece.dtype != dtype:
            raise ValueError(f"{self.path}: expected the next piece of {want} ({dtype}), got {name} ({piece.dtype})")
        data = piece if isinstance(piece, FileRuns) else tensor_bytes(piece)
        size = data.nbytes if isinstance(data, FileRuns) else len(data)
        self._filled += size
        if self._filled > n:
            raise ValueError(f"{self.path}: {name}: more bytes than its shape {shape} holds")
        if size:
            self._emit(data, size)
        if self._filled == n:
            self._index, self._filled = self._index + 1, 0

    def close(self) -> tuple[int, str]:
        while self._index < len(self._order) and self._order[self._index][3] == 0:
            self._index += 1  # empty tensors have no bytes to wait for
        missing = [e[0] for e in self._order[self._index:]]
        try:
            for item in [i for i in _IN_FLIGHT if i[0] is self]:
                _IN_FLIGHT.remove(item)
                _wait(item)
        finally:
            self.abort()
        if missing:
            raise ValueError(f"{self.path}: not every tensor was written (next: {missing[0]})")
        return self.size, self._hash.value()

    def abort(self) -> None:
        """Stop and close (after an error; harmless after close())."""
        self._io.shutdown(wait=True)
        self._hasher.shutdown(wait=True)
        for item in [i for i in _IN_FLIGHT if i[0] is self]:
            _IN_FLIGHT.remove(item)
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
