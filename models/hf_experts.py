"""Hugging Face expert tensor layouts that differ from tpzoo's, converted both ways (pure tensor functions, for a
family's HF mapping; nothing crosses ranks, nothing is cached).

tpzoo's experts (models/kinds/experts.py, models/kinds/moe.py) keep nn.Linear's layout with gate|up fused in halves:
    gate_up [E, 2f, h] (rows 0..f-1 the gate, f..2f-1 up), down [E, h, f], gate_up_bias [E, 2f], down_bias [E, h].
gpt-oss's checkpoints (transformers' GptOssExperts) keep x @ W's layout with gate and up *interleaved*:
    gate_up_proj [E, h, 2f] (column 2j the gate of unit j, 2j + 1 its up), gate_up_proj_bias [E, 2f] (same
    interleaving), down_proj [E, f, h], down_proj_bias [E, h].
Both directions are permutations and transposes: a round trip is bit-exact.

The hub's gpt-oss checkpoints store the two expert weights in MXFP4 (`quantization_config.quant_method ==
"mxfp4"`): `<name>_blocks` uint8 [E, rows, cols/32, 16] (two e2m1 values per byte, low nibble first) and
`<name>_scales` uint8 [E, rows, cols/32] (a power-of-two exponent per 32 values, biased by 127), rows x cols being
the weight transposed. `dequantize_mxfp4` gives the weight in HF's unquantized layout (gate_up_proj [E, h, 2f],
down_proj [E, f, h]), equal to transformers' own `convert_moe_packed_tensors`; export writes the dequantized
weights (bf16), never MXFP4.
"""
from __future__ import annotations

import torch

# e2m1: the 16 values a nibble encodes (sign bit 3, then exponent and mantissa)
FP4_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)


def interleaved_to_halves(t: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """(g0, u0, g1, u1, ...) -> (g0, g1, ..., u0, u1, ...) along `dim`."""
    d = dim % t.dim()
    return t.unflatten(d, (-1, 2)).transpose(d, d + 1).flatten(d, d + 1)


def halves_to_interleaved(t: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """(g0, g1, ..., u0, u1, ...) -> (g0, u0, g1, u1, ...) along `dim`."""
    d = dim % t.dim()
    return t.unflatten(d, (2, -1)).transpose(d, d + 1).flatten(d, d + 1)


def gpt_oss_experts_from_hf(gate_up_proj: torch.Tensor, gate_up_proj_bias: torch.Tensor, down_proj: torch.Tensor,
                            down_proj_bias: torch.Tensor) -> dict[str, torch.Tensor]:
    """HF GptOssExperts' tensors -> tpzoo's {gate_up, gate_up_bias, down, down_bias} (contiguous)."""
    if gate_up_proj.dim() != 3 or gate_up_proj.shape[-1] % 2 or down_proj.shape[1] * 2 != gate_up_proj.shape[-1]:
        raise ValueError(f"gpt-oss experts: gate_up_proj {tuple(gate_up_proj.shape)} and down_proj "
                         f"{tuple(down_proj.shape)} are not [E, h, 2f] and [E, f, h]")
    return {"gate_up": interleaved_to_halves(gate_up_proj, -1).transpose(1, 2).contiguous(),
            "gate_up_bias": interleaved_to_halves(gate_up_proj_bias, -1).contiguous(),
            "down": down_proj.transpose(1, 2).contiguous(),
            "down_bias": down_proj_bias.contiguous()}


def gpt_oss_experts_to_hf(gate_up: torch.Tensor, gate_up_bias: torch.Tensor, down: torch.Tensor,
                          down_bias: torch.Tensor) -> dict[str, torch.Tensor]:
    """tpzoo's expert tensors -> HF GptOssExperts' {gate_up_proj, gate_up_proj_bias, down_proj, down_proj_bias}."""
    return {"gate_up_proj": halves_to_interleaved(gate_up.transpose(1, 2), -1).contiguous(),
            "gate_up_proj_bias": halves_to_interleaved(gate_up_bias, -1).contiguous(),
            "down_proj": down.transpose(1, 2).contiguous(),
            "down_proj_bias": down_bias.contiguous()}


def dequantize_mxfp4(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """MXFP4 blocks [E, rows, G, 16] uint8 and scales [E, rows, G] uint8 -> the weight [E, G * 32, rows] in `dtype`
    (value = e2m1(nibble) * 2^(scale - 127); the low nibble is the even element)."""
    if blocks.shape[:-1] != scales.shape or blocks.dim() != 4:
        raise ValueError(f"mxfp4: blocks {tuple(blocks.shape)} and scales {tuple(scales.shape)} are not "
                         f"[E, rows, G, 16] and [E, rows, G]")
    lut = torch.tensor(FP4_VALUES, dtype=dtype, device=blocks.device)
    blocks = blocks.to(torch.uint8)
    low, high = lut[(blocks & 0x0F).long()], lut[(blocks >> 4).long()]
    values = torch.stack([low, high], dim=-1).flatten(-2)  # [E, rows, G, 32]
    exponent = (scales.to(torch.int32) - 127).unsqueeze(-1)
    values = torch.ldexp(values, exponent).to(dtype)  # exact: a power of two times a 3-bit value
    return values.flatten(-2).transpose(1, 2).contiguous()
