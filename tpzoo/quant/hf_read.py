"""Reading a quantized Hugging Face checkpoint: every quantized weight checked on opening, then presented either
dequantized (the default) or kept with its scales (`--keep-quantized`).

`open_quantized(source, quant, config_path, keep, dtype)` is called by tpzoo/checkpoint/hf.py's HFSource when
config.json carries a quantization_config other than MXFP4. It reads every header (never the weights) and refuses,
in one line naming the tensor or the field, before anything is written: an unsupported method, format, block size
or scheme (formats.read_quantization_config), an FP8 weight without its `weight_scale_inv` (a weight and its scale
may sit in different shards of the index), a scale whose shape is not the [128, 128] blocks of its weight, a packed
int4 weight without its scale or shape, a `weight_shape` that disagrees with the packed tensor, a module that the
`ignore` list names stored packed, asymmetric int4 (zero points).

Dequantized: each quantized weight becomes the tensor `<module>.weight` of a `DequantReader`, whose boxes (any
slice the converter asks for) read only the values and the blocks of scales that cover them, and multiply in fp32
rounding once to the import's dtype (--dtype; auto: the checkpoint's own, config.json `dtype`). Memory stays that
of the converter's pieces. Kept: the tpzoo tensors made of quantized HF weights keep their stored bytes, and their
scales come as tensors of their own (tpzoo.quant.maps); the model config records which (ModelConfig.quantization).
"""
from __future__ import annotations

from pathlib import Path

import torch

from .formats import Fp8Block, Int4Pack, QuantError, ignored, read_quantization_config
from .maps import kept_maps

FP8 = torch.float8_e4m3fn


class DequantReader:
    """Quantized weights behind the reader interface, dequantized box by box. `entries`: logical HF name ->
    (format, values reader, values name, scales reader, scales name, logical shape)."""

    def __init__(self, entries: dict, dtype: torch.dtype):
        self.entries, self.out_dtype = entries, dtype

    def keys(self):
        return self.entries.keys()

    def shape(self, name):
        return self.entries[name][5]

    def dtype(self, name):
        return self.out_dtype

    def read(self, name):
        return self.read_box(name, [(0, n) for n in self.shape(name)])

    def read_box(self, name, box):
        fmt, rv, nv, rs, ns, _ = self.entries[name]
        *lead, (r0, rn), (c0, cn) = box
        if fmt.pack == 1:
            q = rv.read_box(nv, box)
        else:  # the packed words covering the columns, unpacked, then the wanted columns
            w0, w1 = c0 // fmt.pack, -(-(c0 + cn) // fmt.pack)
            q = fmt.unpack(rv.read_box(nv, [*lead, (r0, rn), (w0, w1 - w0)]), (w1 - w0) * fmt.pack)
            q = q[..., c0 - w0 * fmt.pack: c0 - w0 * fmt.pack + cn]
        br, bc = fmt.units()
        sbox = [*lead, (r0 // br, -(-(r0 + rn) // br) - r0 // br), (c0 // bc, -(-(c0 + cn) // bc) - c0 // bc)]
        return fmt.dequantize(q, rs.read_box(ns, sbox), self.out_dtype, r0, c0)

    def close(self):
        self.entries = {}


def _scan_fp8(fmt: Fp8Block, where: dict, reader) -> dict:
    """{weight name: (values name, scales name, logical shape)}, every pair checked."""
    found = {}
    for name in where:
        dt = reader(where[name]).dtype(name)
        if dt.is_floating_point and dt.itemsize == 1 and dt != FP8:
            raise QuantError(f"{where[name]}: tensor {name} is {dt}; tpzoo reads e4m3 FP8 weights")
        if dt != FP8:
            continue
        scale = name + "_scale_inv"
        if scale not in where:
            raise QuantError(f"{where[name]}: FP8 weight {name} has no {scale} (its block scales) in the checkpoint")
        shape, sshape = tuple(reader(where[name]).shape(name)), tuple(reader(where[scale]).shape(scale))
        if len(shape) < 2 or sshape != fmt.scale_shape(shape):
            raise QuantError(f"{where[scale]}: {scale} has shape {list(sshape)}; the [128, 128] blocks of {name} "
                             f"{list(shape)} need {list(fmt.scale_shape(shape)) if len(shape) >= 2 else '2-d'}")
        if not reader(where[scale]).dtype(scale).is_floating_point:
            raise QuantError(f"{where[scale]}: {scale} is {reader(where[scale]).dtype(scale)}, not a float scale")
        found[name] = (name, scale, shape)
    for name in where:
        if name.endswith("_scale_inv") and name[: -len("_scale_inv")] not in found:
            weight = name[: -len("_scale_inv")]
            what = "missing" if weight not in where else f"{reader(where[weight]).dtype(weight)}, not FP8"
            raise QuantError(f"{where[name]}: {name} scales {weight}, which is {what}")
    return found


def _scan_int4(fmt: Int4Pack, where: dict, reader, ignore: list) -> tuple[dict, Int4Pack]:
    found, scale_types = {}, set()
    for name in where:
        if not name.endswith(".weight_packed"):
            continue
        module = name[: -len(".weight_packed")]
        scale, shape_name = module + ".weight_scale", module + ".weight_shape"
        for need in (scale, shape_name):
            if need not in where:
                raise QuantError(f"{where[name]}: packed int4 weight {name} has no {need} in the checkpoint")
        if module + ".weight_zero_point" in where:
            raise QuantError(f"{where[name]}: {module}.weight_zero_point: asymmetric int4 is not supported")
        if ignored(module, ignore):
            raise QuantError(f"{where[name]}: {module} is in quantization_config.ignore but stored packed")
        logical = tuple(int(v) for v in reader(where[shape_name]).read(shape_name).tolist())
        packed, sshape = tuple(reader(where[name]).shape(name)), tuple(reader(where[scale]).shape(scale))
        if (len(logical) < 2 or packed != fmt.stored_shape(logical) or logical[-1] % 8
                or reader(where[name]).dtype(name) != torch.int32):
            raise QuantError(f"{where[shape_name]}: {shape_name} = {list(logical)} disagrees with {name} "
                             f"{list(packed)} {reader(where[name]).dtype(name)} (int32, eight values a word)")
        if sshape != fmt.scale_shape(logical):
            raise QuantError(f"{where[scale]}: {scale} has shape {list(sshape)}; groups of {fmt.group} of "
                             f"{list(logical)} need {list(fmt.scale_shape(logical))}")
        scale_types.add(reader(where[scale]).dtype(scale))
        found[module + ".weight"] = (name, scale, logical)
    if len(scale_types) > 1:
        raise QuantError(f"int4 scales of several dtypes ({sorted(map(str, scale_types))}): tpzoo keeps one")
    if scale_types:
        from tpzoo.checkpoint.safetensors_io import dtype_name

        fmt = Int4Pack(fmt.group, dtype_name(scale_types.pop()))
    return found, fmt


def open_quantized(source, quant: dict, config: Path, keep: bool, dtype: torch.dtype | None) -> None:
    """Check the quantized weights of the HFSource `source` and present them dequantized or kept (module
    docstring); its `where`, `maps`, `cfg` and `notes` are updated in place."""
    fmt = read_quantization_config(quant, str(config))
    if isinstance(fmt, Fp8Block) and quant.get("activation_scheme", "dynamic") != "dynamic":
        raise QuantError(f"{config}: quantization_config.activation_scheme={quant['activation_scheme']!r} is not "
                         f"supported (tpzoo reads 'dynamic': no stored activation scales)")
    if isinstance(fmt, Fp8Block):
        found = _scan_fp8(fmt, source.where, source._reader)
    else:
        found, fmt = _scan_int4(fmt, source.where, source._reader, quant.get("ignore") or [])
    family = source.cfg.family
    if keep:
        _keep(source, fmt, found, quant)
        return
    out = dtype or _config_dtype(source.hf_config)
    entries = {logical: (fmt, source._reader(source.where[v]), v, source._reader(source.where[s]), s, shape)
               for logical, (v, s, shape) in found.items()}
    if entries:
        reader, virtual = DequantReader(entries, out), Path(str(config) + "#" + fmt.name)
        source._readers[virtual] = reader
        source.where.update({logical: virtual for logical in entries})
    source.notes.append(f"{family}: {len(entries)} {fmt.name} weights (quantization_config {config}) dequantized to "
                        f"{str(out).replace('torch.', '')} on import (--keep-quantized keeps them)")


def _config_dtype(hf: dict) -> torch.dtype:
    name = str(hf.get("dtype") or hf.get("torch_dtype") or "bfloat16")
    return getattr(torch, name, torch.bfloat16) if name in ("float32", "float16", "bfloat16") else torch.bfloat16


def _keep(source, fmt, found: dict, quant: dict) -> None:
    """The tpzoo tensors whose HF tensors are all quantized keep their stored form; a tensor mixing quantized and
    unquantized HF tensors cannot (one line naming it)."""
    quantized = []
    for m in source.maps.values():
        hits = [h in found for h in m.hf]
        if any(hits) and not all(hits):
            raise QuantError(f"{m.name}: made of quantized {[h for h, q in zip(m.hf, hits) if q][:3]} and unquantized "
                             f"{[h for h, q in zip(m.hf, hits) if not q][:3]} HF tensors; --keep-quantized cannot "
                             f"keep it (convert without --keep-quantized)")
        if all(hits) and hits:
            quantized.append(m.name)
    maps = kept_maps(fmt, list(source.maps.values()), set(quantized), lambda h: found[h][2])
    source.maps = {m.name: m for m in maps}
    record = {"format": fmt.name, "tensors": quantized, "hf": dict(quant)}
    if isinstance(fmt, Fp8Block):
        record["block"] = list(fmt.block)
    else:
        record.update(group=fmt.group, scale_dtype=fmt.scale_type)
    source.cfg = source.cfg.replace(quantization=record)
    source.notes.append(f"{source.cfg.family}: {len(quantized)} weights kept in {fmt.name} with their scales "
                        f"(the rest as stored)")
