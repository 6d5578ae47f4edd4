"""The quantized weight formats of published checkpoints: what each stores, how its quantization_config reads, and
the arithmetic (pure torch; nothing crosses ranks).

fp8 block ("fp8_block": DeepSeek-V3 / V3.1 / V3.2, Kimi K2, MiniMax-M2, the Qwen3 / GLM "-FP8" releases):
    quantization_config {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [128, 128], ...}
    a quantized linear stores `weight` float8_e4m3fn [out, in] and `weight_scale_inv` float32
    [ceil(out / 128), ceil(in / 128)]: value = fp32(q) x the scale of its 128 x 128 block, the blocks fixed from
    the top-left corner, the last ones partial (transformers' `_dequantize_fp8_weight` rule; its CPU
    `Fp8Dequantize` derives the block from the scale's shape instead, which mis-scales ragged shapes). The product is
    formed in fp32 and rounded once to the wanted dtype (DeepSeek's own `weight_dequant`), so fp32 gives it exactly.
int4 pack ("int4_pack": compressed-tensors "pack-quantized", Kimi K2 Thinking):
    quantization_config {"quant_method": "compressed-tensors", "format": "pack-quantized", "config_groups": {g:
    {"weights": {"num_bits": 4, "type": "int", "symmetric": true, "strategy": "group", "group_size": 32}}},
    "ignore": [module names, or "re:" patterns matched at the start of a name]}
    a quantized linear stores `weight_packed` int32 [out, in / 8] (value j of a word in bits 4j..4j+3, stored as
    q + 8), `weight_scale` [out, in / group] (the model's dtype) and `weight_shape` int64 [2] = [out, in]:
    value = q x the scale of its group of `group` consecutive inputs.

Every function takes the weight with any leading dims (stacked experts), the blocks on the last two.
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass

import torch

from tpzoo.errors import UserError

E4M3_MAX = 448.0
_E4M3_TABLE: dict = {}  # device -> the 256 e4m3 values in bf16


class QuantError(UserError, ValueError):
    """A quantized checkpoint tpzoo cannot read as it says it is (one line naming the tensor or the field)."""


@dataclass(frozen=True)
class Fp8Block:
    """DeepSeek's block-wise FP8: e4m3 values, a float32 scale (`scale_inv`: multiply to dequantize) per block."""
    block: tuple = (128, 128)
    name = "fp8_block"
    scale_suffix = "_scale_inv"       # tpzoo and HF: `<weight name>_scale_inv`
    weight_dtype = torch.float8_e4m3fn
    pack = 1                          # logical columns per stored column

    @property
    def scale_dtype(self) -> torch.dtype:
        return torch.float32

    def hf_weight(self, hf_name: str) -> str:
        return hf_name

    def hf_scale(self, hf_name: str) -> str:
        return hf_name + "_scale_inv"

    def stored_shape(self, shape) -> tuple:
        return tuple(shape)

    def scale_shape(self, shape) -> tuple:
        *lead, r, c = shape
        return (*lead, -(-r // self.block[0]), -(-c // self.block[1]))

    def units(self) -> tuple[int, int]:
        """The row and column counts a tensor-parallel cut must be a multiple of (whole blocks)."""
        return self.block

    def values(self, q: torch.Tensor) -> torch.Tensor:
        """The e4m3 values as bf16 (every e4m3 number is one), through a 256-entry table: several times faster on
        a CPU than torch's element-by-element fp8 conversion."""
        table = _E4M3_TABLE.get(q.device)
        if table is None:
            table = _E4M3_TABLE[q.device] = torch.arange(256, dtype=torch.uint8, device=q.device).view(
                torch.float8_e4m3fn).to(torch.bfloat16)
        return table.index_select(0, q.contiguous().view(torch.uint8).reshape(-1).int()).view(q.shape)

    def dequantize(self, q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype, rows: int = 0,
                   cols: int = 0) -> torch.Tensor:
        """`q` a box of a weight whose top-left corner is (rows, cols) in it (a multiple of nothing: any box),
        `scale` the blocks covering the box (from block rows // 128, cols // 128): the box dequantized."""
        br, bc = self.block
        ri = (torch.arange(rows, rows + q.shape[-2], device=q.device) // br) - rows // br
        return apply_scales(self.values(q), scale.to(torch.float32).index_select(-2, ri), bc, cols, dtype)

    def quantize(self, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(e4m3 values, float32 scale_inv = block amax / 448) of a weight; an all-zero block gets scale 0."""
        br, bc = self.block
        *lead, r, c = w.shape
        nr, nc = -(-r // br), -(-c // bc)
        padded = torch.zeros((*lead, nr * br, nc * bc), dtype=torch.float32, device=w.device)
        padded[..., :r, :c] = w.to(torch.float32)
        blocks = padded.unflatten(-1, (nc, bc)).unflatten(-3, (nr, br))  # [..., nr, br, nc, bc]
        amax = blocks.abs().amax(dim=(-3, -1))                          # [..., nr, nc]
        scale = amax / E4M3_MAX
        safe = torch.where(scale > 0, scale, torch.ones_like(scale))
        q = (blocks / safe[..., :, None, :, None]).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
        return q.flatten(-4, -3).flatten(-2, -1)[..., :r, :c].contiguous(), scale

    def hf_config(self) -> dict:
        return {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                "weight_block_size": list(self.block)}


@dataclass(frozen=True)
class Int4Pack:
    """compressed-tensors' symmetric group-wise int4, packed eight to an int32."""
    group: int = 32
    scale_type: str = "BF16"            # the scales' safetensors dtype (the source's)
    name = "int4_pack"
    scale_suffix = "_scale"             # tpzoo: `<weight name>_scale`; HF: `<module>.weight_scale`
    weight_dtype = torch.int32
    pack = 8

    @property
    def scale_dtype(self) -> torch.dtype:
        from tpzoo.checkpoint.safetensors_io import DTYPES

        return DTYPES[self.scale_type]

    def hf_weight(self, hf_name: str) -> str:
        return _module(hf_name) + ".weight_packed"

    def hf_scale(self, hf_name: str) -> str:
        return _module(hf_name) + ".weight_scale"

    def hf_shape(self, hf_name: str) -> str:
        return _module(hf_name) + ".weight_shape"

    def stored_shape(self, shape) -> tuple:
        *lead, r, c = shape
        return (*lead, r, -(-c // 8))

    def scale_shape(self, shape) -> tuple:
        *lead, r, c = shape
        return (*lead, r, -(-c // self.group))

    def units(self) -> tuple[int, int]:
        return (1, math.lcm(self.group, 8))

    def values(self, packed: torch.Tensor) -> torch.Tensor:
        return self.unpack(packed, packed.shape[-1] * 8)

    def unpack(self, packed: torch.Tensor, cols: int) -> torch.Tensor:
        """int32 words [..., r, w] -> int8 values [..., r, cols] in [-8, 7] (low nibble first, little-endian)."""
        nibbles = packed.contiguous().view(torch.uint8)
        values = torch.stack((nibbles & 0xF, nibbles >> 4), dim=-1).flatten(-2)
        return values[..., :cols].to(torch.int8) - 8

    def pack_values(self, q: torch.Tensor) -> torch.Tensor:
        """The inverse of unpack: int8 values [..., r, c] in [-8, 7] -> int32 words [..., r, ceil(c / 8)]."""
        *lead, r, c = q.shape
        words = -(-c // 8)
        u = torch.zeros((*lead, r, words * 8), dtype=torch.uint8, device=q.device)
        u[..., :c] = (q.to(torch.int16) + 8).to(torch.uint8)
        pairs = u.unflatten(-1, (-1, 2))
        return (pairs[..., 0] | (pairs[..., 1] << 4)).contiguous().view(torch.int32)

    def dequantize(self, q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype, rows: int = 0,
                   cols: int = 0) -> torch.Tensor:
        """`q` int8 values (unpacked) of a box starting at column `cols`, `scale` the groups covering it (from
        group cols // group): the box dequantized (q x scale in fp32, rounded once)."""
        return apply_scales(q, scale.to(torch.float32), self.group, cols, dtype)

    def hf_config(self) -> dict:
        raise QuantError("int4 (compressed-tensors) is exported as the source's own quantization_config only")


def apply_scales(values: torch.Tensor, scale: torch.Tensor, unit: int, cols: int, dtype: torch.dtype) -> torch.Tensor:
    """values [..., c] (exact: bf16 e4m3 values, int8 int4 values) of the columns starting at `cols` of a weight,
    times the fp32 scale [..., blocks] of the column blocks of `unit` covering them (from block cols // unit): each
    product formed in fp32 and rounded once into `dtype`. The whole blocks broadcast their scale (no expanded scale
    tensor); a partial block at either end takes its own. (Same-dtype in-place multiplies: torch's CPU kernels for a
    mixed-dtype multiply are several times slower.)"""
    out = values.to(torch.float32)
    c = out.shape[-1]
    head = min(c, -cols % unit)  # columns before the first block boundary
    first = 1 if head else 0     # the scale of the first whole block
    whole = (c - head) // unit * unit
    if head:
        out[..., :head].mul_(scale[..., :1])
    if whole:
        n = whole // unit
        out[..., head:head + whole].unflatten(-1, (n, unit)).mul_(scale[..., first:first + n, None])
    if head + whole < c:
        last = first + whole // unit
        out[..., head + whole:].mul_(scale[..., last:last + 1])
    return out if dtype == torch.float32 else out.to(dtype)


def _module(hf_name: str) -> str:
    return hf_name[: -len(".weight")] if hf_name.endswith(".weight") else hf_name


def format_of(record: dict):
    """The format object of a ModelConfig.quantization record."""
    if record["format"] == "fp8_block":
        return Fp8Block(tuple(record.get("block", (128, 128))))
    if record["format"] == "int4_pack":
        return Int4Pack(int(record["group"]), record.get("scale_dtype", "BF16"))
    raise QuantError(f"unknown quantization format {record['format']!r} in the model config")


def read_quantization_config(quant: dict, where: str):
    """The format a HF quantization_config describes, every unsupported value refused in one line naming its
    field (`where`: the config file). None for MXFP4 (gpt-oss: read by tpzoo/checkpoint/hf.py itself)."""
    method = quant.get("quant_method")
    field = f"{where}: quantization_config"
    if method == "mxfp4":
        return None
    if method == "fp8":
        if quant.get("fmt", "e4m3") not in ("e4m3", "float8_e4m3fn"):  # (MiniMax-M2 spells it out)
            raise QuantError(f"{field}.fmt={quant.get('fmt')!r} is not supported (tpzoo reads e4m3)")
        block = quant.get("weight_block_size")
        if block is None or list(block) != [128, 128]:
            raise QuantError(f"{field}.weight_block_size={block!r} is not supported (tpzoo reads DeepSeek's "
                             f"[128, 128] blocks)")
        return Fp8Block((128, 128))
    if method == "compressed-tensors":
        fmt = quant.get("format")
        if fmt != "pack-quantized":
            raise QuantError(f"{field}.format={fmt!r} is not supported (tpzoo reads compressed-tensors "
                             f"'pack-quantized')")
        groups = quant.get("config_groups") or {}
        if len(groups) != 1:
            raise QuantError(f"{field}.config_groups: {len(groups)} groups; tpzoo reads one int4 weight scheme")
        (gname, group), = groups.items()
        w = group.get("weights") or {}
        base = f"{field}.config_groups.{gname}.weights"
        for key, want in (("num_bits", 4), ("type", "int"), ("symmetric", True), ("strategy", "group")):
            if w.get(key) != want:
                raise QuantError(f"{base}.{key}={w.get(key)!r} is not supported (tpzoo reads {key}={want!r})")
        if group.get("input_activations") or group.get("output_activations"):
            raise QuantError(f"{field}.config_groups.{gname}: activation quantization is not supported")
        g = w.get("group_size")
        if not isinstance(g, int) or g <= 0 or g % 8:
            raise QuantError(f"{base}.group_size={g!r} is not supported (a positive multiple of 8)")
        return Int4Pack(g)
    raise QuantError(f"{field}.quant_method={method!r} is not supported (tpzoo reads 'fp8' block-wise, "
                     f"'compressed-tensors' pack-quantized int4 and 'mxfp4')")


def ignored(module: str, ignore: list) -> bool:
    """compressed-tensors' `ignore` rule: an exact module name, or "re:PATTERN" matching its start."""
    return any(re.match(t[3:], module) if t.startswith("re:") else t == module for t in ignore or ())
