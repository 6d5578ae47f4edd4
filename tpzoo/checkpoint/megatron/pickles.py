"""The pickles of a Megatron-LM checkpoint, opened without running anything they name.

Megatron-LM writes three kinds of pickle, and each is read here under its own allowlist:

- torch.distributed.checkpoint's `.metadata` (torch_dist): a plain pickle of DCP's dataclasses. Read with an
  unpickler that builds only those classes, torch.Size, dtypes and layouts (`read_dcp_metadata`).
- `torch.save` archives (legacy `model_optim_rng.pt`, torch_dist's `common.pt` and the common state inside the
  .distcp files of Megatron-Core >= 0.19): `torch.load(weights_only=True)`, with the plain classes Megatron-LM's
  arguments hold (argparse.Namespace, pathlib paths, signal numbers, numpy arrays of RNG states) allowed, and each
  Megatron class the pickle names (an enum such as AttnBackend, a config dataclass) replaced by an inert record of
  its name and arguments, so neither megatron nor its code is needed. Any other global refuses the file in one
  line (`load_weights_only`).
- each tensor chunk of a .distcp file, a torch.save archive of one tensor: only its zip directory and its small
  data.pkl are parsed (`tensor_layout`), so that the chunk's bytes can be read in exact slices like a
  safetensors tensor, never the whole chunk.
"""
from __future__ import annotations

import io
import math
import os
import pickle
import struct
import zipfile
from collections import OrderedDict
from dataclasses import dataclass

import torch

from ..format import CheckpointError

STORAGE_DTYPES = {"FloatStorage": torch.float32, "DoubleStorage": torch.float64, "HalfStorage": torch.float16,
                  "BFloat16Storage": torch.bfloat16, "LongStorage": torch.int64, "IntStorage": torch.int32,
                  "ShortStorage": torch.int16, "CharStorage": torch.int8, "ByteStorage": torch.uint8,
                  "BoolStorage": torch.bool}
_DCP_MODULES = ("torch.distributed.checkpoint.metadata", "torch.distributed.checkpoint.planner",
                "torch.distributed.checkpoint.filesystem")


# --- torch.distributed.checkpoint's .metadata ------------------------------------------------------------------

class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module, name):
        if module in _DCP_MODULES:
            import importlib

            obj = getattr(importlib.import_module(module), name, None)
            if isinstance(obj, type):  # DCP's dataclasses and enums: data only
                return obj
        elif module == "torch" and (name == "Size" or isinstance(getattr(torch, name, None), torch.dtype)):
            return getattr(torch, name)
        elif (module, name) == ("torch.serialization", "_get_layout"):
            return torch.serialization._get_layout
        elif (module, name) == ("collections", "OrderedDict"):
            return OrderedDict
        raise pickle.UnpicklingError(f"{module}.{name} is not part of a checkpoint's metadata")


def read_dcp_metadata(path):
    """torch.distributed.checkpoint's Metadata from a `.metadata` file (restricted unpickling)."""
    try:
        with open(path, "rb") as f:
            return _MetadataUnpickler(f).load()
    except (pickle.UnpicklingError, EOFError, ValueError, TypeError, AttributeError, IndexError) as e:
        raise CheckpointError(f"{path}: not a readable torch.distributed.checkpoint metadata file (truncated or "
                              f"corrupt?): {type(e).__name__}: {e}") from None


# --- torch.save archives with Megatron-LM's arguments -------------------------------------------------------------

class MegatronValue:
    """What a Megatron class in a pickle became: its qualified name, and the arguments or state it was built with
    (an enum member: `args == (value,)`)."""

    megatron_name = "megatron"

    def __new__(cls, *args):
        obj = object.__new__(cls)
        obj.args, obj.state = args, None
        return obj

    def __init__(self, *args):
        pass

    def __setstate__(self, state):
        self.state = state

    @property
    def value(self):
        return self.args[0] if len(self.args) == 1 else self.args

    def __repr__(self) -> str:
        return f"{self.megatron_name}({', '.join(map(repr, self.args))})"


def _standin(name: str) -> type:
    return type(name.rsplit(".", 1)[-1], (MegatronValue,), {"megatron_name": name})


def _plain_globals() -> dict:
    """Harmless classes Megatron-LM's pickles hold besides tensors (the ones Megatron-Core itself allows)."""
    import argparse
    import pathlib
    import signal
    import types

    import numpy

    try:
        from numpy._core import multiarray
    except ImportError:  # numpy 1
        from numpy.core import multiarray
    out = {"argparse.Namespace": argparse.Namespace, "types.SimpleNamespace": types.SimpleNamespace,
           "pathlib.PosixPath": pathlib.PosixPath, "pathlib.Path": pathlib.Path, "signal.Signals": signal.Signals,
           "io.BytesIO": io.BytesIO, "numpy.ndarray": numpy.ndarray, "numpy.dtype": numpy.dtype,
           "numpy.core.multiarray._reconstruct": multiarray._reconstruct,
           "numpy._core.multiarray._reconstruct": multiarray._reconstruct,
           "torch._C.Generator": torch._C.Generator}
    for name in dir(numpy.dtypes):  # numpy's dtype classes (UInt32DType in an RNG state)
        if name.endswith("DType"):
            out[f"numpy.dtypes.{name}"] = getattr(numpy.dtypes, name)
    return out


def load_weights_only(src, what: str, mmap: bool = False):
    """torch.load(src, weights_only=True) (src: a path or bytes) with Megatron-LM's plain classes allowed and its
    own classes replaced by MegatronValue records; anything else, or a damaged file, is a one-line error naming
    `what`."""
    f = io.BytesIO(src) if isinstance(src, (bytes, bytearray, memoryview)) else src
    try:
        names = torch.serialization.get_unsafe_globals_in_checkpoint(f)
    except Exception as e:  # noqa: BLE001 - not a zip archive, truncated: all the same to the user
        raise CheckpointError(f"{what}: not a readable torch.save file (truncated or corrupt?): "
                              f"{type(e).__name__}: {e}") from None
    plain = _plain_globals()
    # numpy.dtype(...) builds an instance of its per-type class (UInt32DType in an RNG state), which the unpickler
    # then checks by class, not by name: allow them all (data types, no code)
    allowed = [cls for name, cls in plain.items() if name.startswith("numpy.dtypes.")] if "numpy.dtype" in names else []
    for name in names:
        if name in plain:
            allowed.append(plain[name])
        elif name.startswith("megatron."):
            allowed.append((_standin(name), name))
        else:
            raise CheckpointError(f"{what}: holds a {name} object, which tpzoo does not unpickle (it reads tensors, "
                                  f"plain data and Megatron-LM's argument values only)")
    if isinstance(f, io.BytesIO):
        f.seek(0)
    try:
        with torch.serialization.safe_globals(allowed):
            return torch.load(f, map_location="cpu", weights_only=True, mmap=mmap and not isinstance(f, io.BytesIO))
    except Exception as e:  # noqa: BLE001 - unpickling a damaged file fails in many ways; all mean the same
        raise CheckpointError(f"{what}: not loadable with weights_only=True (truncated or corrupt?): "
                              f"{type(e).__name__}: {' '.join(str(e).split())[:300]}") from None


# --- one tensor's torch.save archive inside a .distcp file ---------------------------------------------------------

class _FileSlice(io.RawIOBase):
    """Bytes [offset, offset + length) of an open file, as a seekable read-only file (for zipfile)."""

    def __init__(self, fd: int, offset: int, length: int):
        self.fd, self.offset, self.length, self.pos = fd, offset, length, 0

    def readable(self):
        return True

    def seekable(self):
        return True

    def seek(self, pos, whence=0):
        self.pos = {0: pos, 1: self.pos + pos, 2: self.length + pos}[whence]
        return self.pos

    def tell(self):
        return self.pos

    def readinto(self, b):
        n = max(0, min(len(b), self.length - self.pos))
        data = os.pread(self.fd, n, self.offset + self.pos)
        b[: len(data)] = data
        self.pos += len(data)
        return len(data)


@dataclass(frozen=True)
class TensorLoc:
    """Where a contiguous tensor's elements are in a file: its dtype, shape and the offset of its first element."""
    dtype: torch.dtype
    shape: tuple
    start: int

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


class _Stub:
    """Whatever a global other than a tensor names, while locating tensors: nothing of it is looked up or run."""

    def __init__(self, *args):
        self.args = args

    def __setstate__(self, state):
        self.state = state


class _LayoutUnpickler(pickle.Unpickler):
    """data.pkl of a torch.save archive, with each tensor read as (dtype, storage key, storage offset, shape,
    stride) and every other global a _Stub: so it resolves nothing and runs nothing of the file (the file's
    safety is weights_only's business: load_weights_only)."""

    def find_class(self, module, name):
        if (module, name) == ("torch._utils", "_rebuild_tensor_v2"):
            return lambda storage, offset, size, stride, *rest: ("tensor", *storage, offset, tuple(size), tuple(stride))
        if (module, name) == ("torch._utils", "_rebuild_parameter"):
            return lambda data, *rest: data
        if module == "torch" and name in STORAGE_DTYPES:
            return STORAGE_DTYPES[name]
        if (module, name) == ("collections", "OrderedDict"):
            return OrderedDict
        return type(name, (_Stub,), {})

    def persistent_load(self, pid):
        if not (isinstance(pid, tuple) and len(pid) == 5 and pid[0] == "storage"):
            raise pickle.UnpicklingError(f"unexpected persistent id {pid!r}")
        return pid[1], pid[2]  # (dtype, key)


def archive_layout(fd: int, offset: int, length: int, what: str):
    """The object torch.save wrote at [offset, offset + length) of the open file `fd` (a whole file: 0 and its
    size), with every contiguous tensor in it replaced by its TensorLoc (other values: what the stubbed unpickling
    gives, not to be used)."""
    try:
        z = zipfile.ZipFile(_FileSlice(fd, offset, length))
        names = z.namelist()
        pkl = next(n for n in names if n.endswith("/data.pkl"))
        order = [n for n in names if n.endswith("/byteorder")]
        if order and z.read(order[0]) != b"little":
            raise ValueError("big-endian data")
        records = pkl.rsplit("/", 1)[0] + "/data/"

        def locate(value):
            if isinstance(value, tuple) and len(value) == 6 and value[0] == "tensor":
                _, dtype, key, start, shape, stride = value
                if shape and stride != tuple(math.prod(shape[i + 1:]) for i in range(len(shape))):
                    raise ValueError(f"a non-contiguous tensor (stride {stride})")
                info = z.getinfo(records + str(key))
                if info.compress_type != zipfile.ZIP_STORED:
                    raise ValueError("compressed tensor data")
                name_len, extra_len = struct.unpack("<HH", os.pread(fd, 4, offset + info.header_offset + 26))
                loc = TensorLoc(dtype, shape, offset + info.header_offset + 30 + name_len + extra_len
                                + start * dtype.itemsize)
                if loc.start + loc.nbytes > offset + info.header_offset + 30 + name_len + extra_len + info.file_size:
                    raise ValueError("tensor data past the end of its record")
                return loc
            if isinstance(value, dict):
                return type(value)((k, locate(v)) for k, v in value.items())
            if isinstance(value, list):
                return [locate(v) for v in value]
            return value

        return locate(_LayoutUnpickler(io.BytesIO(z.read(pkl))).load())
    except (zipfile.BadZipFile, pickle.UnpicklingError, StopIteration, KeyError, ValueError, TypeError,
            EOFError, struct.error) as e:
        raise CheckpointError(f"{what}: not a readable torch.save archive (truncated or corrupt?): "
                              f"{type(e).__name__}: {e}") from None


def tensor_layout(fd: int, offset: int, length: int, what: str) -> TensorLoc:
    """The TensorLoc of the one tensor torch.save wrote at [offset, offset + length) (a torch_dist chunk)."""
    loc = archive_layout(fd, offset, length, what)
    if not isinstance(loc, TensorLoc):
        raise CheckpointError(f"{what}: not a tensor chunk")
    return loc
