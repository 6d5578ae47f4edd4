"""Mixtures of experts in the plan's memory model: what an MoE MLP (models/kinds/moe.py) keeps for the backward. The
parameters (plan/memory.py layer_params, stage_params) and the expert optimizer's state (expert_state_bytes) sit
with the dense ones they extend; the all-to-all volume is plan/volume.py moe_layer_volume (docs/plan.md)."""
from __future__ import annotations

from tpzoo.models.config import ModelConfig


def moe_mlp_bytes(cfg: ModelConfig, tp: int, sequence_parallel: bool, e: int, kernels: str, ep: int = 1) -> tuple:
    """(per token of the full sequence, per token of this rank's shard, per layer) bytes an MoE MLP
    (models/kinds/moe.py) keeps beyond its input, in place of the dense MLP's. Every token is dispatched as k rows, and
    over the ep group this rank computes T * k rows in expectation (balanced routing; exactly at ep = 1): per row the
    dispatched input (e*h), its expert's gate|up output and activation (the dense MLP's 3 e*f, 4 with the torch
    references, over f = expert ffn / tp), the returned output the combine multiplies (e*h), the top-k weight
    (e) and the int64 orders that put rows back (two, and two more for the received rows at ep > 1). Per shard token
    the router: the logits (e*E, kept in last_stats), fp32 probabilities (4E; in 16-bit also the fp32 logits
    logsumexp keeps), the top-k indices (8k), the renormalization's inputs (4k + 4) and the z-loss's
    logsumexp (4). Per layer the router statistics of last_stats (fp32 counts and probability sums, the
    z-loss sum: 8E + 8), alive until the next forward."""
    k, E, h = cfg.num_experts_per_tok, cfg.num_experts, cfg.hidden_size
    f = cfg.expert_ffn // tp
    row = e * h + e * f * (4 if kernels == "reference" else 3) + e * h + e + 16 + (16 if ep > 1 else 0)
    router = e * E + 4 * E + (4 * E if e < 4 else 0) + 8 * k + ((4 * k + 4) if cfg.norm_topk_prob else 0) + 4
    return k * row, router, 8 * E + 8
