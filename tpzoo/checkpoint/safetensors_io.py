"""The safetensors format: header parsing, a reader of exact slices, helpers (the writer: st_writer.py).

The format (https://github.com/huggingface/safetensors): 8 bytes little-endian header length N, N bytes of
JSON {name: {"dtype", "shape", "data_offsets": [begin, end]}, "__metadata__": {str: str}}, then the raw
little-endian bytes of every tensor, back to back (offsets relative to the end of the header).

Headers are read and validated by the `safetensors` package (`safe_open`: names, dtypes, shapes, metadata, and
the checks that the offsets cover the data without gaps or overlaps and that the file is exactly that long); its
errors are re-raised naming the file. Opening only maps the file: the header's pages are all it touches.

Tensor data is not read through `safetensors`, because of the conversion memory goal (peak RSS < 15 % of the
checkpoint, scripts/bench/convert.py): `safe_open`'s default backend memory-maps the file, so every page a slice
touches stays in the resident set until the file is closed (a converter reads every byte of every file), and its
"pread" backend reads a whole tensor to return any slice of it. Measured on the bench's 4.4 GB checkpoint with
--out-dtype bf16 (every tensor read into memory): docs/benchmarks.md. `save_file` needs every tensor of a file in
memory at once, so the writer streams its own file (st_writer.py). Here reads are positioned reads (`os.preadv`)
of exactly the bytes of a slice, into one buffer, and the byte ranges of a slice can be copied by the kernel
instead (`byte_runs`). Files written here load with `safetensors` and transformers.
"""
from __future__ import annotations

import hashlib
import itertools
import math
import os
import struct
import zlib

import torch
from safetensors import SafetensorError, safe_open

from tpzoo.errors import UserError

DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
          "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
          "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2}
DTYPE_NAMES = {v: k for k, v in DTYPES.items()}
SHORT_RUN = 256 * 1024  # byte runs shorter than this on average are read as one span (then gathered)
COPY_MIN_RUN = 4096     # byte runs at least this long on average are copied by the kernel, not via memory
MAX_SPAN_WASTE = 4      # read a span only when it is at most this many times the bytes wanted


class SafetensorsError(UserError, ValueError):
    """A file that is not valid safetensors (truncated, corrupt header, inconsistent offsets)."""


def dtype_name(dtype: torch.dtype) -> str:
    if dtype not in DTYPE_NAMES:
        raise ValueError(f"dtype {dtype} cannot be stored in safetensors")
    return DTYPE_NAMES[dtype]


def nbytes(dtype: torch.dtype, shape) -> int:
    return math.prod(shape) * dtype.itemsize


def tensor_bytes(t: torch.Tensor):
    """A zero-copy byte view of a CPU tensor (numpy has no bfloat16, so go through uint8)."""
    t = t.detach().cpu().contiguous()
    return t.reshape(-1).view(torch.uint8).numpy() if t.numel() else b""


def read_header(path) -> tuple[dict, int, dict]:
    """(tensors {name: (dtype, shape, begin, end)} in file order, data_start, metadata) of a file that
    `safetensors` accepts; a truncated or corrupt file fails here, naming itself."""
    path = str(path)
    try:
        with safe_open(path, framework="pt") as f:
            metadata = f.metadata() or {}
            entries = [(name, f.get_slice(name)) for name in f.offset_keys()]
            entries = [(name, s.get_dtype(), tuple(s.get_shape())) for name, s in entries]
    except SafetensorError as e:  # its messages do not say which file
        raise SafetensorsError(f"{path}: not a valid safetensors file ({os.path.getsize(path)} bytes; truncated "
                               f"or corrupt): {e}") from None
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
    # safetensors has checked that the data is the tensors back to back, in offset_keys order, from offset 0.
    tensors, begin = {}, 0
    for name, code, shape in entries:
        if code not in DTYPES:
            raise SafetensorsError(f"{path}: tensor {name}: unsupported dtype {code}")
        end = begin + nbytes(DTYPES[code], shape)
        tensors[name] = (DTYPES[code], shape, begin, end)
        begin = end
    return tensors, 8 + n, metadata


class TensorFile:
    """Positioned reads of whole tensors or of boxes (a [start, start+length) range on every dim) of row-major
    tensors at known places in one file: `tensors` {name: (dtype, shape, begin, end)}, offsets relative to
    `data_start`. SafetensorsReader reads them from the header; Megatron's torch_dist chunks
    (checkpoint/megatron/dist_format.py) from each chunk's torch.save archive."""

    def __init__(self, path, tensors: dict, data_start: int = 0):
        self.path = str(path)
        self._fd = None  # set before anything can fail: __del__ runs even when __init__ raised
        self.tensors, self.data_start = tensors, data_start
        self._fd = os.open(self.path, os.O_RDONLY)
        self._span: tuple[int, int] | None = None  # (file offset, length) of the bytes in _span_buf
        self._span_buf: torch.Tensor | None = None

    @property
    def fd(self) -> int:
        return self._fd

    def keys(self):
        return self.tensors.keys()

    def shape(self, name: str) -> tuple:
        return self.tensors[name][1]

    def dtype(self, name: str) -> torch.dtype:
        return self.tensors[name][0]

    def read(self, name: str) -> torch.Tensor:
        return self.read_box(name, [(0, n) for n in self.shape(name)])

    def byte_runs(self, name: str, box: list[tuple[int, int]]) -> list[tuple[int, int]]:
        """(file offset, length) of the bytes of t[s0:s0+n0, s1:s1+n1, ...], in row-major order, adjacent runs
        merged: one run for a range of whole rows, one per row for a range of columns."""
        if name not in self.tensors:
            raise SafetensorsError(f"{self.path}: no tensor {name!r}")
        dtype, shape, begin, _ = self.tensors[name]
        if len(box) != len(shape) or any(s < 0 or n < 0 or s + n > d for (s, n), d in zip(box, shape)):
            raise IndexError(f"{self.path}: {name}: box {box} outside shape {shape}")
        esize = dtype.itemsize
        if any(n == 0 for _, n in box):
            return []
        if not shape:  # a scalar
            return [(self.data_start + begin, esize)]
        # Dims after `last` are whole, so each index over the dims before it is one contiguous run of bytes.
        last = max([i for i, ((s, n), d) in enumerate(zip(box, shape)) if n != d] or [0])
        inner = math.prod(shape[last + 1:]) * esize
        run = box[last][1] * inner
        strides = [math.prod(shape[i + 1:]) * esize for i in range(len(shape))]
        base = self.data_start + begin + box[last][0] * inner
        runs: list[tuple[int, int]] = []
        for idx in itertools.product(*(range(s, s + n) for s, n in box[:last])):
            offset = base + sum(i * st for i, st in zip(idx, strides))
            if runs and runs[-1][0] + runs[-1][1] == offset:
                runs[-1] = (runs[-1][0], runs[-1][1] + run)
            else:
                runs.append((offset, run))
        return runs

    def read_box(self, name: str, box: list[tuple[int, int]]) -> torch.Tensor:
        """The slice t[s0:s0+n0, s1:s1+n1, ...] as a new contiguous tensor; reads only its bytes."""
        runs = self.byte_runs(name, box)
        out = torch.empty([n for _, n in box], dtype=self.tensors[name][0], device="cpu")
        buf = out.reshape(-1).view(torch.uint8).numpy() if out.numel() else None
        useful, span_len = sum(n for _, n in runs), (runs[-1][0] + runs[-1][1] - runs[0][0] if runs else 0)
        if len(runs) > 1 and useful < SHORT_RUN * len(runs) and span_len <= MAX_SPAN_WASTE * useful:
            # Many short runs (a column range of each row): one read of the span beats a system call per row,
            # unless most of the span would be read for nothing (a rank's columns at a large tp).
            span, base = self._span_of(runs[0][0], runs[-1][0] + runs[-1][1])
            n, stride = runs[0][1], (runs[1][0] - base if len(runs) > 1 else 0)
            if all(r == (base + i * stride, n) for i, r in enumerate(runs)):  # evenly spaced: one strided copy
                out.reshape(-1).view(torch.uint8).view(len(runs), n).copy_(span.as_strided((len(runs), n), (stride, 1)))
                return out
            pos = 0
            for offset, k in runs:
                buf[pos: pos + k] = span.numpy()[offset - base: offset - base + k]
                pos += k
            return out
        pos = 0
        for offset, n in runs:
            self._pread(buf[pos: pos + n], offset)
            pos += n
        return out

    def _span_of(self, start: int, end: int) -> tuple[torch.Tensor, int]:
        """Bytes [start, end) of the file, from the last span read when it covers them (the tp ranks' column
        ranges of the same rows are read one after the other). The buffer never leaves read_box, so it is
        reused: no fresh pages to fault in for every read."""
        if self._span is None or not (self._span[0] <= start and end <= self._span[0] + self._span[1]):
            self._span = None
            if self._span_buf is None or self._span_buf.numel() < end - start:
                self._span_buf = torch.empty(end - start, dtype=torch.uint8, device="cpu")
            self._pread(self._span_buf[: end - start].numpy(), start)
            self._span = (start, end - start)
        return self._span_buf[: self._span[1]], self._span[0]

    def _pread(self, view, offset: int) -> None:
        got = os.preadv(self._fd, [view], offset)
        if got != len(view):
            raise SafetensorsError(f"{self.path}: short read at offset {offset} (file truncated while reading?)")

    def close(self) -> None:
        self._span = self._span_buf = None
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __del__(self):
        self.close()


class SafetensorsReader(TensorFile):
    """A safetensors file: its header read and validated on opening (read_header), then positioned reads."""

    def __init__(self, path):
        self._fd = None
        tensors, data_start, self.metadata = read_header(str(path))
        super().__init__(path, tensors, data_start)


CHECKSUMS = ("crc32", "sha256")


class Checksum:
    """A file checksum, written "algo:hex". crc32 (default) detects truncation and corruption at about twice the
    speed of sha256 (zlib vs hashlib, one core); sha256 when a cryptographic digest is wanted."""

    def __init__(self, algo: str = "crc32"):
        if algo not in CHECKSUMS:
            raise ValueError(f"checksum must be one of {CHECKSUMS}, got {algo!r}")
        self.algo = algo
        self._crc = 0
        self._sha = hashlib.sha256() if algo == "sha256" else None

    def update(self, data) -> None:
        if self._sha is not None:
            self._sha.update(data)
        else:
            self._crc = zlib.crc32(data, self._crc)

    def value(self) -> str:
        return f"sha256:{self._sha.hexdigest()}" if self._sha is not None else f"crc32:{self._crc:08x}"


def file_checksum(path, algo: str, chunk: int = 16 << 20) -> str:
    c = Checksum(algo)
    buf = bytearray(chunk)
    view = memoryview(buf)
    with open(path, "rb", buffering=0) as f:
        while n := f.readinto(buf):
            c.update(view[:n])
    return c.value()
