"""Hugging Face checkpoints: read one lazily (tensor by tensor, or just a slice), and write one, streamed.

Reading takes a directory (or a weights file in it) with config.json and model.safetensors,
model.safetensors.index.json + shards, or, as a fallback, pytorch_model.bin[.index.json] loaded with
torch.load(weights_only=True). A hub id is tried only when SRC is not an existing path.

MXFP4 checkpoints (config.json quantization_config.quant_method "mxfp4": gpt-oss on the hub) store some weights
as `<name>_blocks` + `<name>_scales`; the reader presents each such pair as the tensor `<name>` dequantized to
bf16 in the unquantized layout (models/hf_experts.dequantize_mxfp4, equal to transformers' own), so a family maps
the unquantized names only. `HFSource.notes` says so in one line, with the family's own notes (what an import
leaves out) and what the tensors say against the config (a multi-token-prediction layer counted but absent).

Block-wise FP8 and compressed-tensors int4 checkpoints are read by tpzoo.quant.hf_read: dequantized (default) or
kept with their scales (`keep_quantized`).
"""
from __future__ import annotations

import json
import math
import re
from pathlib import Path

import torch

from tpzoo.errors import UserError

from .format import CheckpointError, refuse_temp_dir, safe_path
from .safetensors_io import SafetensorsReader

HUB_PATTERNS = ["*.json", "*.safetensors", "*.model", "*.txt", "*.jinja", "*.tiktoken"]


class TorchFileReader:
    """pytorch_model.bin behind the SafetensorsReader interface (weights_only: no code runs on load)."""

    def __init__(self, path):
        self.path = str(path)
        try:
            try:
                self.state = torch.load(self.path, map_location="cpu", weights_only=True, mmap=True)
            except RuntimeError:  # legacy (non-zip) files cannot be memory-mapped
                self.state = torch.load(self.path, map_location="cpu", weights_only=True)
        except OSError:
            raise
        except Exception as e:  # noqa: BLE001 - unpickling a damaged file fails in many ways; all mean the same
            raise CheckpointError(f"{self.path}: not a readable PyTorch weights file (truncated or corrupt?): "
                                  f"{type(e).__name__}: {e}") from None
        if not isinstance(self.state, dict) or not all(isinstance(v, torch.Tensor) for v in self.state.values()):
            raise CheckpointError(f"{self.path}: not a state dict of tensors")

    def keys(self):
        return self.state.keys()

    def shape(self, name):
        return tuple(self.state[name].shape)

    def dtype(self, name):
        return self.state[name].dtype

    def read(self, name):
        return self.state[name].clone()

    def read_box(self, name, box):
        return self.state[name][tuple(slice(s, s + n) for s, n in box)].clone()

    def close(self):
        self.state = {}


def _download(repo_id: str) -> Path:
    try:
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(repo_id, allow_patterns=HUB_PATTERNS))
    except Exception as e:  # noqa: BLE001 - offline, unknown repo, gated repo: one clear message
        raise FileNotFoundError(f"{repo_id!r} is not a local path, and fetching it from the Hugging Face hub "
                                f"failed (offline? unknown or gated repository?): {type(e).__name__}: {e}") from e


def read_json(path: Path, what: str) -> dict:
    """A JSON object from `path`; anything else is a CheckpointError naming the file."""
    try:
        data = json.loads(path.read_bytes().decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{path}: corrupt {what} (not valid JSON): {e}") from None
    if not isinstance(data, dict):
        raise CheckpointError(f"{path}: corrupt {what}: expected a JSON object, got {type(data).__name__}")
    return data


def _weights_from_index(root: Path, index: Path) -> dict[str, Path]:
    weight_map = read_json(index, "weights index").get("weight_map")
    if not isinstance(weight_map, dict) or not all(isinstance(f, str) for f in weight_map.values()):
        raise CheckpointError(f"{index}: corrupt weights index: no 'weight_map' object of tensor name -> file")
    where = {name: safe_path(root, fname, f"{index.name} entry") for name, fname in weight_map.items()}
    for name, path in where.items():
        if not path.is_file():
            raise CheckpointError(f"{index}: tensor {name} is in {path.name}, which is missing")
    return where


def locate_hf(src) -> tuple[Path, dict[str, Path] | list[Path]]:
    """(directory, {tensor: file} from an index, or the list of weight files)."""
    p = Path(src)
    if p.exists():
        refuse_temp_dir(p if p.is_dir() else p.parent)
    if not p.exists():
        if re.fullmatch(r"[\w.-]+/[\w.-]+", str(src)):
            p = _download(str(src))
        else:
            raise FileNotFoundError(f"no such file or directory: {src}")
    root = p.parent if p.is_file() else p
    if p.is_file():
        if p.name.endswith(".index.json"):
            return root, _weights_from_index(root, p)
        return root, [p]
    for index in ("model.safetensors.index.json", "pytorch_model.bin.index.json"):
        if (root / index).is_file():
            return root, _weights_from_index(root, root / index)
    for pattern in ("model.safetensors", "*.safetensors", "pytorch_model.bin"):
        found = sorted(root.glob(pattern))
        if found:
            return root, found
    raise FileNotFoundError(f"no weights in {root}: expected model.safetensors, model.safetensors.index.json "
                            f"(+ shards) or pytorch_model.bin")


def _open(path: Path):
    return TorchFileReader(path) if path.suffix == ".bin" else SafetensorsReader(path)


class Mxfp4Reader:
    """The `<name>` of every `<name>_blocks` / `<name>_scales` pair of an MXFP4 checkpoint, dequantized (bf16), behind
    the reader interface; `parts` maps a name to (blocks reader, blocks name, scales reader, scales name)."""

    def __init__(self, parts: dict):
        self.parts = parts

    def keys(self):
        return self.parts.keys()

    def shape(self, name):
        rb, nb, _, _ = self.parts[name]
        e, rows, groups, _ = rb.shape(nb)
        return (e, groups * 32, rows)

    def dtype(self, name):
        return torch.bfloat16

    def read(self, name):
        from tpzoo.models.hf_experts import dequantize_mxfp4

        rb, nb, rs, ns = self.parts[name]
        return dequantize_mxfp4(rb.read(nb), rs.read(ns), torch.bfloat16)

    def read_box(self, name, box):
        return self.read(name)[tuple(slice(s, s + n) for s, n in box)].clone()

    def close(self):
        self.parts = {}


class HFSource:
    """A HF checkpoint seen as tpzoo's full tensors (by tpzoo name), through the family's tensor mapping."""

    kind = "hf"

    def __init__(self, src, keep_quantized: bool = False, dtype: torch.dtype | None = None):
        """keep_quantized: quantized weights stay as stored, with their scales (else dequantized to `dtype`,
        default the checkpoint's own)."""
        from tpzoo.models.mtp_hf import reconcile
        from tpzoo.models.registry import from_hf_config, get_family

        self.root, weights = locate_hf(src)
        config = self.root / "config.json"
        if not config.is_file():
            raise FileNotFoundError(f"{self.root} has no config.json (needed to know the architecture)")
        self.hf_config = read_json(config, "config.json")
        self.cfg = from_hf_config(self.hf_config)  # a clear error for an unsupported architecture
        family = get_family(self.cfg.family)
        self.notes = list(family.import_notes(self.hf_config)) if family.import_notes else []
        self._readers: dict[Path, object] = {}
        if isinstance(weights, dict):
            self.where = dict(weights)
            for name, path in self.where.items():  # every header now: a corrupt file or a wrong index fails here
                if name not in self._reader(path).keys():
                    raise CheckpointError(f"{path}: has no tensor {name}, which the weights index puts there")
        else:
            self.where = {}
            for path in weights:
                for name in self._reader(path).keys():
                    self.where[name] = path
        # the multi-token-prediction depths the tensors hold, whatever the config counts (models/mtp_hf.py)
        self.cfg, notes = reconcile(self.cfg, family.hf_mtp, self.where)
        self.notes += notes
        self.maps = {m.name: m for m in family.hf_tensor_map(self.cfg) if not m.mirror}  # (copies are not read)
        self._dequantized(config, keep_quantized, dtype)
        self._cache: tuple[str, torch.Tensor] | None = None
        self._structure: dict[str, tuple | None] = {}
        self.aux_dir = self.root
        self.stages, self.tp, self.pp, self.padding_multiple = None, None, None, 1

    def _dequantized(self, config: Path, keep: bool, dtype) -> None:
        """MXFP4 pairs become their dequantized tensors (module docstring); block FP8 and int4: tpzoo.quant."""
        quant = self.hf_config.get("quantization_config") or {}
        if not quant:
            if keep:
                raise CheckpointError(f"{config}: --keep-quantized: the checkpoint is not quantized (no "
                                      f"quantization_config)")
            return
        if quant.get("quant_method") != "mxfp4":
            from tpzoo.quant.hf_read import open_quantized

            return open_quantized(self, quant, config, keep, dtype)
        if keep:
            raise CheckpointError(f"{config}: --keep-quantized: MXFP4 (gpt-oss) is only read dequantized")
        parts = {}
        for name in [n for n in self.where if n.endswith("_blocks")]:
            base = name[: -len("_blocks")]
            scales = base + "_scales"
            if scales not in self.where:
                raise CheckpointError(f"{self.where[name]}: MXFP4 tensor {name} has no {scales}")
            parts[base] = (self._reader(self.where[name]), name, self._reader(self.where[scales]), scales)
        if parts:
            reader, virtual = Mxfp4Reader(parts), Path(str(config) + "#mxfp4")
            self._readers[virtual] = reader
            self.where.update({base: virtual for base in parts})
            self.notes.append(f"{self.cfg.family}: {len(parts)} MXFP4 weights (quantization_config {config}) "
                              f"dequantized to bf16 on import")

    def _reader(self, path: Path):
        if path not in self._readers:
            if not path.is_file():
                raise CheckpointError(f"missing weights file {path}")
            self._readers[path] = _open(path)
        return self._readers[path]

    def _hf(self, hf_name: str):
        if hf_name not in self.where:
            raise CheckpointError(f"HF checkpoint {self.root} is missing tensor {hf_name!r}")
        return self._reader(self.where[hf_name])

    def check(self, names) -> None:
        """Every HF tensor the given tpzoo tensors need is present (one error listing all that are not)."""
        missing = sorted({h for n in names for h in self._map(n).hf if h not in self.where})
        if missing:
            raise CheckpointError(f"HF checkpoint {self.root} is missing tensor(s) {missing[:8]}"
                           f"{' ...' if len(missing) > 8 else ''} ({len(missing)} in all)")

    def _map(self, name: str):
        if name not in self.maps:
            raise KeyError(f"the {self.cfg.family} mapping has no tensor {name!r}")
        return self.maps[name]

    def _meta_inputs(self, name):
        m = self._map(name)
        return [torch.empty(self._hf(h).shape(h), dtype=self._hf(h).dtype(h), device="meta") for h in m.hf]

    def structure(self, name: str):
        """See concat_structure; cached per tensor."""
        if name not in self._structure:
            m = self._map(name)
            self._structure[name] = concat_structure(m, [tuple(self._hf(h).shape(h)) for h in m.hf])
        return self._structure[name]

    def full_shape(self, name: str) -> tuple:
        st = self.structure(name)
        if st is None:
            return tuple(self._map(name).to_tpzoo(self._meta_inputs(name)).shape)
        d, _, extents, first = st
        return tuple(sum(extents) if i == d else n for i, n in enumerate(first))

    def check_shape(self, name: str, full_shape: tuple) -> None:
        """The HF tensors have the shapes the config implies. Checked in the to_hf direction (a split): torch.cat
        on meta tensors would import torch._dynamo (seconds and ~150 MB) just to add up sizes."""
        m = self._map(name)
        for h, want in zip(m.hf, m.to_hf(torch.empty(full_shape, device="meta"))):
            got = tuple(self._hf(h).shape(h))
            if got != tuple(want.shape):
                raise CheckpointError(f"shape mismatch for HF tensor {h} (tpzoo {name}): the checkpoint has {got}, the "
                                 f"config implies {tuple(want.shape)}")

    def dtype(self, name: str) -> torch.dtype:
        h = self._map(name).hf[0]
        return self._hf(h).dtype(h)

    def _locate(self, name: str, box):
        """(dim, transposed, [(hf name, box in it)]) covering `box` of the tpzoo tensor, or None if unstructured."""
        st = self.structure(name)
        if st is None:
            return None
        d, transposed, extents, _ = st
        start, n = box[d]
        pieces, offset = [], 0
        for h, ext in zip(self._map(name).hf, extents):
            lo, hi = max(start, offset), min(start + n, offset + ext)
            if lo < hi:
                sub = list(box)
                sub[d] = (lo - offset, hi - lo)
                pieces.append((h, sub[::-1] if transposed else sub))
            offset += ext
        return d, transposed, pieces

    def read_box(self, name: str, box) -> torch.Tensor:
        located = self._locate(name, box)
        if located is not None:
            d, transposed, pieces = located
            parts = [self._hf(h).read_box(h, sub) for h, sub in pieces]
            parts = [p.t() for p in parts] if transposed else parts
            if not parts:
                return torch.empty([k for _, k in box], dtype=self.dtype(name), device="cpu")
            return parts[0] if len(parts) == 1 else torch.cat(parts, dim=d)
        m = self._map(name)
        if self._cache is None or self._cache[0] != name:  # every tp rank's shard comes from one assembly
            self._cache = None
            self._cache = (name, m.to_tpzoo([self._hf(h).read(h) for h in m.hf]).contiguous())
        full = self._cache[1]
        return full[tuple(slice(s, s + n) for s, n in box)]  # a view: consumers copy or write it out

    def byte_runs(self, name: str, box):
        """[(fd, offset, length)] holding exactly the bytes of `box` in some weights file, or None."""
        located = self._locate(name, box)
        if located is None or located[1] or (located[0] != 0 and len(located[2]) > 1):
            return None
        readers = [self._hf(h) for h, _ in located[2]]
        if not all(isinstance(r, SafetensorsReader) for r in readers):
            return None
        return [(r.fd, off, n) for r, (h, sub) in zip(readers, located[2]) for off, n in r.byte_runs(h, sub)]

    def close(self) -> None:
        for r in self._readers.values():
            r.close()
        self._readers.clear()
        self._cache = None


def concat_structure(m, shapes: list[tuple]):
    """(dim, transposed, extents, first input shape as seen after the transpose) when the mapping's tpzoo tensor
    is the concatenation along `dim` of its HF tensors (or of their transposes), one HF tensor being the trivial
    case; else None. Then any box of it maps to boxes of the HF tensors, read (or written) directly, never
    assembled whole. Learned by running the mapping on tiny stand-ins with the same pattern of sizes and
    distinct values, so that only a true concatenation compares equal."""
    small = {n: 2 + i for i, n in enumerate(sorted({n for s in shapes for n in s}))}
    probes, offset = [], 0
    for shape in shapes:
        numel = math.prod(small[n] for n in shape)
        probes.append(torch.arange(offset, offset + numel, dtype=torch.float64, device="cpu").reshape(
            [small[n] for n in shape]))
        offset += numel
    try:
        out = m.to_tpzoo(probes)
    except (RuntimeError, ValueError, IndexError):
        return None
    for transposed in (False, True):
        if transposed and any(p.dim() != 2 for p in probes):
            continue
        parts = [p.t() if transposed else p for p in probes]
        for d in range(out.dim()):
            if all(p.dim() == out.dim() and p.shape[:d] + p.shape[d + 1:] == out.shape[:d] + out.shape[d + 1:]
                   for p in parts) and torch.equal(torch.cat(parts, d), out):
                real = [tuple(s[::-1]) if transposed else tuple(s) for s in shapes]
                return d, transposed, [r[d] for r in real], real[0]
    return None


def hf_config_for(cfg, dtype: torch.dtype | None) -> dict:
    """config.json for `cfg`: the source's own dict, verbatim, when the model config is unchanged since import
    (an exact round trip), else the family's to_hf_config. `dtype` updates the recorded dtype."""
    from tpzoo.models.registry import from_hf_config, to_hf_config

    from tpzoo.models.mtp_hf import mtp_to_hf
    from tpzoo.models.registry import get_family

    orig = cfg.extra.get("hf_config")
    same = False
    if orig:
        try:
            same = _comparable(from_hf_config(orig)) == _comparable(cfg)
        except (ValueError, KeyError, UserError):
            same = False
    hf = dict(orig) if same else to_hf_config(cfg)
    if same:  # the depths are those the weights hold (a config counting layers it lacks exports a count of 0)
        layout = get_family(cfg.family).hf_mtp
        hf.update(mtp_to_hf(layout, cfg) if layout is not None and layout.count_field in hf else {})
    if dtype is not None:
        name = str(dtype).replace("torch.", "")
        keys = [k for k in ("dtype", "torch_dtype") if k in hf]
        if not keys and dtype != torch.float32:  # no key means float32 to transformers
            keys = ["dtype"]
        for k in keys:
            hf[k] = name
    return hf


def _comparable(cfg) -> dict:
    d = cfg.to_dict()
    # (the multi-token-prediction depths: a config alone counts them, the weights say which are there)
    for k in ("extra", "name", "hf_source", "quantization", "mtp"):
        d.pop(k, None)
    return d
