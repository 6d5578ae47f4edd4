"""Muon in the plan (`tpzoo plan --optimizer muon`, tpzoo.train.muon): its optimizer memory and the
orthogonalization's time per step.

Which matrices Muon takes, and their pieces, are the trainer's own (tpzoo.train.muon_matrices.place on one layer of
each signature built on meta at the layout's tp and ep): nothing about the kinds is repeated here.
- Memory: a Muon element keeps one fp32 momentum where AdamW keeps two moments: 4 bytes of optimizer state instead
  of 8 per owned element (ZeRO shards Muon's elements over dp x cp as AdamW's; the experts' over edp).
- Time on the slowest stage: Newton-Schulz FLOPs of one rank's share at the GPU's rate (each matrix whole at one
  owner, the owners dealt over tp x dp ranks under ZeRO, over tp without; a share is at least the largest
  parameter's), and the exchange: 2 bytes (bfloat16) each way per Muon element, over dp for what ZeRO spreads
  there ((dp - 1)/dp of a rank's owned elements) and over tp for the shards of the parameters its dp rank owns.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

from tpzoo.models.config import ModelConfig

from .layers import memo, signature
from .memory import StateBytes, stage_layer_ids
from .spec import ClusterSpec, Layout, TrainingSpec, group_is_intra_node
from .stage_comm import bandwidth, collective_time


@dataclass(frozen=True)
class MuonLayer:
    dense: int          # this rank's elements of the layer's dense Muon matrices
    experts: int        # this rank's elements of its expert matrices (its ep rank's experts)
    flops: float        # Newton-Schulz FLOPs of the whole matrices this rank's (tp, ep) group shares
    largest: float      # of one parameter (never split between owners)
    expert_flops: float


def layer_muon(cfg: ModelConfig, layer: int, tp: int, ep: int, ns_steps: int) -> MuonLayer:
    """Muon's share of layer `layer` on one rank at tensor parallelism tp and expert parallelism ep."""
    return memo(cfg, ("muon", signature(cfg, layer), tp, ep, ns_steps),
                lambda: _layer_muon(cfg, layer, tp, ep, ns_steps))


def _layer_muon(cfg: ModelConfig, layer: int, tp: int, ep: int, ns_steps: int) -> MuonLayer:
    from tpzoo.models import ModelLayout, Stage, Transformer
    from tpzoo.parallel import ParallelDims
    from tpzoo.train.muon_matrices import full_shape, place

    dims = ParallelDims.for_rank(tp=tp, dp=ep, ep=ep)
    chunk = Transformer(cfg, ModelLayout(dims, device="meta"), Stage(range(layer, layer + 1), False, False))
    dense = experts = 0
    flops = expert_flops = largest = 0.0
    params = {id(p): p for p in chunk.parameters()}
    for pid, (_, m) in place([chunk]).items():
        p = params[pid]
        f = m.flops(full_shape(p, tp), ns_steps)
        largest = max(largest, f)
        if m.experts:
            experts, expert_flops = experts + p.numel(), expert_flops + f
        else:
            dense, flops = dense + p.numel(), flops + f
    return MuonLayer(dense, experts, flops, largest, expert_flops)


def stage_muon(cfg: ModelConfig, layout: Layout, training: TrainingSpec, stage: int) -> MuonLayer:
    """The sums over the layers pipeline rank `stage` holds (the embedding and head are AdamW's)."""
    parts = [layer_muon(cfg, i, layout.tp, layout.ep, training.muon_ns_steps)
             for i in stage_layer_ids(cfg, layout, stage)]
    return MuonLayer(sum(p.dense for p in parts), sum(p.experts for p in parts), sum(p.flops for p in parts),
                     max([p.largest for p in parts] + [0.0]), sum(p.expert_flops for p in parts))


def muon_state(cfg: ModelConfig, layout: Layout, training: TrainingSpec, stage: int, st: StateBytes) -> StateBytes:
    """`st` (AdamW's state bytes of the stage) with Muon's elements at one moment instead of two."""
    if training.optimizer != "muon":
        return st
    if training.lora_rank:  # the adapters are all Muon's matrices
        return replace(st, optimizer=st.optimizer // 2)
    mu = stage_muon(cfg, layout, training, stage)
    replicas = layout.grad_replicas
    owned = (mu.dense // replicas + mu.experts // layout.expert_replicas if training.zero_level
             else mu.dense + mu.experts)
    return replace(st, optimizer=max(st.optimizer - 4 * owned, 0))


def muon_time(cfg: ModelConfig, layout: Layout, training: TrainingSpec, cluster: ClusterSpec, stage: int) -> float:
    """Seconds per step of the orthogonalization on one rank of `stage`, its exchange included (module
    docstring)."""
    if training.optimizer != "muon" or training.lora_rank:  # LoRA's adapters: rank-r matrices, negligible work
        return 0.0
    mu = stage_muon(cfg, layout, training, stage)
    zero = training.zero_level > 0
    dp, edp = (layout.grad_replicas, layout.expert_replicas) if zero else (1, 1)
    share = max(mu.flops / (layout.tp * dp) + mu.expert_flops / (layout.tp * edp), mu.largest)
    compute = share / (cluster.gpu_tflops * 1e12 * cluster.efficiency)
    exchange = 0.0
    for elements, group in ((mu.dense, dp), (mu.experts, edp)):
        if not elements:
            continue
        if group > 1:  # the dp hop, there and back
            sent = 2 * elements / group * (group - 1) / group
            bw = bandwidth(group_is_intra_node(layout.tp, group, cluster.gpus_per_node), cluster)
            exchange += 2 * collective_time(sent, 1, bw, cluster)
        if layout.tp > 1:  # the tp hop for the parameters this dp rank owns
            sent = 2 * elements / group * (layout.tp - 1) / layout.tp
            bw = bandwidth(group_is_intra_node(1, layout.tp, cluster.gpus_per_node), cluster)
            exchange += 2 * collective_time(sent, 1, bw, cluster)
    return compute + exchange

