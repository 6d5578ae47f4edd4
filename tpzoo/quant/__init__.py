"""Quantized weights as published checkpoints ship them: block-wise FP8 (DeepSeek's) and compressed-tensors int4.

formats.py   the formats: their quantization_config, the dequantization and FP8 quantization arithmetic
hf_read.py   reading a quantized HF checkpoint, checked, dequantized or kept (`convert from-hf --keep-quantized`)
maps.py      the HF tensor map of a kept model (stored names, the scales' own maps)
layout.py    the scales' shard specs, whole-block tensor-parallel splits
modules.py   a kept model's frozen projections, dequantized per use (LoRA on a quantized base)
export.py    `convert to-hf` of a kept checkpoint (byte-identical) and `--quantize fp8-block`
"""
from __future__ import annotations


def stored_names(cfg) -> set:
    """The tpzoo tensors of a kept-quantized model whose bytes are stored as they are (the quantized weights and
    their scales): conversions never cast them to another dtype."""
    record = getattr(cfg, "quantization", None)
    if not record:
        return set()
    from .formats import format_of

    suffix = format_of(record).scale_suffix
    return {n for name in record["tensors"] for n in (name, name + suffix)}


def quantization_line(cfg) -> str:
    """One line: what a kept-quantized model stores quantized (empty for any other)."""
    record = getattr(cfg, "quantization", None)
    if not record:
        return ""
    from .formats import format_of

    fmt = format_of(record)
    how = (f"e4m3, {fmt.block[0]}x{fmt.block[1]} blocks, float32 scale_inv" if fmt.name == "fp8_block" else
           f"int4 packed in int32, groups of {fmt.group}, {fmt.scale_type} scales")
    return f"quantized: {len(record['tensors'])} weights kept in {fmt.name} ({how}; `<name>{fmt.scale_suffix}`)"


def refuse_full_training(cfg, what: str = "the base") -> None:
    """A kept-quantized model trains adapters only: one line saying so, and what to do."""
    record = getattr(cfg, "quantization", None)
    if record:
        from tpzoo.errors import ConfigError

        raise ConfigError(f"{what} is kept quantized ({record['format']}, convert from-hf --keep-quantized): its "
                          f"weights are frozen; fine-tune it with LoRA (--lora-rank R), or convert the HF checkpoint "
                          f"again without --keep-quantized to train every weight")


def check_split(cfg, tp: int) -> None:
    """A kept-quantized model at tensor-parallel size tp: every quantized tensor cut along whole blocks (else the
    ParallelLayoutError naming it), checked on a meta build."""
    if getattr(cfg, "quantization", None) and tp > 1:
        from tpzoo.models import ModelLayout, Transformer
        from tpzoo.parallel import ParallelDims

        Transformer(cfg, ModelLayout(ParallelDims.for_rank(tp=tp), device="meta"))
