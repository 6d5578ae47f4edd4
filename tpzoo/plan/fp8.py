"""FP8 in the plan (`tpzoo plan --fp8 tensorwise|rowwise`), as tpzoo.parallel.fp8 runs it.

Time: the attention and MLP projections run their three GEMMs (forward, input gradient, weight gradient) in FP8,
at twice the model dtype's FLOP rate (Hopper's dense fp8 peak is twice bf16's); on a mixture-of-experts layer only
the attention projections (the experts and the router stay in the model dtype), and never the LM head. A
projection whose local dims (at this tp) are not multiples of 16 stays in the model dtype, as the trainer does.
Under LoRA the frozen base's forward and input-gradient GEMMs (its adapters are small and stay 16-bit).
Recomputation repeats the forward's FP8 GEMMs (full recompute: all but the MLP's output projection, as
estimate.stage_flops counts). The casts themselves (memory-bound passes over the operands, the amax reductions
and the per-GEMM host work) are not in the model: docs/benchmarks.md measures what they cost.

Memory: nothing saved for the backward changes (tpzoo keeps the 16-bit input and casts it again in backward), and
the weights, gradients and optimizer state are the model dtype's. Each FP8 projection's weight is kept in fp8 for
the step, row-major and transposed (2 bytes per weight element, counted with the parameters: `fp8_weight_bytes`),
except under ZeRO-3, which gathers each layer per use and casts it per use too. The working set grows by the fp8
copies that live during one projection's backward on CUDA: dy in fp8 in both layouts and x transposed,
T (2 out + in) bytes, plus under ZeRO-3 the weight's transposed copy (out in). The largest projection's is added
to the transient working set; scales (4 bytes per row) are left out.
"""
from __future__ import annotations

from tpzoo.models.config import ModelConfig

from .layers import layer_cost, signature
from .spec import RankLayout

ALIGN = 16  # tpzoo.parallel.fp8.ALIGN: torch._scaled_mm's K and N


def fp8_projections(cfg: ModelConfig, layer: int, tp: int) -> dict[str, tuple[int, int]]:
    """(out, in) per rank of the projections of layer `layer` whose GEMMs run in FP8: the kinds' column/row-parallel
    projections (plan/kinds Matmul.fp8) with both local dims multiples of 16."""
    mm = layer_cost(cfg, layer, RankLayout(tp=tp)).matmuls
    return {m.name: (m.out, m.inp) for m, _ in mm if m.fp8 and m.out % ALIGN == 0 and m.inp % ALIGN == 0}


def fp8_flops(cfg: ModelConfig, tp: int, tokens: int, layers: list[int], lora: bool, recompute: str) -> dict:
    """FLOPs of one micro-batch's FP8 GEMMs on a stage holding `layers` (ids), in stage_flops' keys."""
    per_pass = again = 0
    for i in layers:
        for m, replayed in layer_cost(cfg, i, RankLayout(tp=tp)).matmuls:
            if m.fp8 and m.out % ALIGN == 0 and m.inp % ALIGN == 0:
                per_pass += 2 * tokens * m.out * m.inp
                again += 2 * tokens * m.out * m.inp if replayed else 0  # full recomputation's replay
    return {"forward": per_pass, "dgrad": per_pass, "wgrad": 0 if lora else per_pass,
            "recompute": again if recompute == "full" else 0}


def at_fp8_rate(flops: dict, fp8: dict) -> dict:
    """stage_flops' numbers as model-dtype-equivalent work: each FP8 FLOP counts half (twice the rate)."""
    return {k: v - fp8.get(k, 0) / 2 for k, v in flops.items()}


def fp8_transient_bytes(cfg: ModelConfig, at: RankLayout, tokens: int, layers, per_use: bool = False) -> int:
    """The fp8 copies alive during the backward of the largest FP8 projection of `layers` (module docstring);
    `tokens`: the GEMM's rows (a micro-batch's tokens on this rank, the whole sequence under SP); `per_use`: the
    weights are cast per use (ZeRO-3), not kept."""
    worst = 0
    for one in {signature(cfg, i): i for i in layers}.values():
        for out, inp in fp8_projections(cfg, one, at.tp).values():
            worst = max(worst, tokens * (2 * out + inp) + (out * inp if per_use else 0))
    return worst


def fp8_weight_bytes(cfg: ModelConfig, tp: int, layers: list[int]) -> int:
    """The fp8 copies of the FP8 projections' weights of `layers` kept for the step: each weight row-major and
    transposed, one byte per element each."""
    return sum(2 * out * inp for i in layers for out, inp in fp8_projections(cfg, i, tp).values())
