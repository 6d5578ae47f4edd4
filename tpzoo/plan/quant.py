"""A kept-quantized base in the plan (`tpzoo plan --lora-rank R --base-dtype fp8|int4`): LoRA on a frozen base
whose projections and experts stay quantized (tpzoo.quant: `convert from-hf --keep-quantized`).

What changes is the frozen base's bytes: the tensors a quantized base stores quantized
(tpzoo.quant.modules.quantizable_tensors: the blocks' linear weights and the experts) take the format's bytes with
their scales (fp8: 1 byte per weight + a float32 per 128 x 128 block; int4: half a byte + a bf16 per group of
32), the rest the model dtype. Counted from the layer built quantized on meta at the rank's tp and ep (layers of
the same kinds share one build), so by construction what a run holds; a tp that would cut a block is refused as
the run refuses it. Compute and activations are modeled as the unquantized base's (the dequantization per use is a
layer's weight at a time; on a GPU the block-scaled FP8 GEMM reads the fp8 weight).
"""
from __future__ import annotations

BASE_DTYPES = {"fp8": {"format": "fp8_block", "block": [128, 128]},
               "int4": {"format": "int4_pack", "group": 32, "scale_dtype": "BF16"}}


def _build(cfg, layer: int, tp: int, ep: int, base_dtype: str) -> tuple[int, int]:
    from tpzoo.models import ModelLayout, Stage, Transformer
    from tpzoo.parallel.dims import ParallelDims
    from tpzoo.quant.modules import quantizable_tensors

    def one(c):
        layout = ModelLayout(ParallelDims.for_rank(tp=tp, ep=ep, dp=ep), device="meta")
        return Transformer(c, layout, Stage(range(layer, layer + 1), pre_process=False, post_process=False))

    plain = one(cfg)
    names = quantizable_tensors(plain)
    params = dict(plain.named_parameters())
    elements = sum(params[n].numel() for n in names)
    kept = one(cfg.replace(quantization={**BASE_DTYPES[base_dtype], "tensors": names, "hf": {}}))
    stored = {n for name in names for n in (name, name + "_scale_inv", name + "_scale")}
    return elements, sum(p.numel() * p.element_size() for n, p in kept.named_parameters() if n in stored)


def quantized_layer(cfg, layer: int, tp: int, ep: int, base_dtype: str) -> tuple[int, int]:
    """(elements stored quantized, their bytes with the scales) of layer `layer` on one rank."""
    from .layers import memo, signature

    return memo(cfg, ("quant", signature(cfg, layer), tp, ep, base_dtype),
                lambda: _build(cfg, layer, tp, ep, base_dtype))


def base_bytes(cfg, numel: int, layers, tp: int, ep: int, dtype_bytes: int, base_dtype: str | None) -> int:
    """The frozen base's bytes on one rank: `numel` elements in the model dtype, less the quantized ones'."""
    total = dtype_bytes * numel
    if base_dtype:
        for i in layers:
            elements, stored = quantized_layer(cfg, i, tp, ep, base_dtype)
            total += stored - dtype_bytes * elements
    return total


def check_base(cfg, tp: int, ep: int, base_dtype: str | None) -> None:
    """ParallelLayoutError (naming the tensor) when tp would cut a block of the quantized base."""
    if base_dtype:
        for i in range(cfg.num_layers):
            quantized_layer(cfg, i, tp, ep, base_dtype)
