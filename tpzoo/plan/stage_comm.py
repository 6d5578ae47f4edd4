"""Seconds of one micro-batch's collectives on a pipeline stage, by phase, from what its layers' kinds send
(plan/kinds, plan/volume.py micro_batch_collectives) and the cluster's bandwidths.

A collective costs latency + ring bytes sent / bandwidth: tp groups within a node (NVLink); cp and ep groups
intra-node when the whole group sits in one node (ranks tp apart), else the per-GPU inter-node bandwidth. TP, ep
and the cp all-to-alls (Gated DeltaNet's heads exchange) are synchronous: the compute waits for them. Ring
attention's K|V transfers (a layer kind's plan_context_features) overlap the attention of the block at hand: only
what a transfer takes beyond one block's attention is exposed (forward cp-1 K|V sends beside one block each;
backward cp-1 steps of a K|V and a dK|dV send beside two blocks' work, then the last dK|dV alone); recomputation
replays the forward ring.
"""
from __future__ import annotations

from dataclasses import dataclass

from tpzoo.models.config import ModelConfig

from .layers import layer_cost, layer_flops, signature
from .memory import stage_layer_ids
from .spec import ClusterSpec, Layout, RankLayout, TrainingSpec, group_is_intra_node, local_seq_len
from .volume import _SENT, micro_batch_collectives, ring_layer_volume, step_collectives


def collective_time(sent_bytes: float, calls: int, bw_gbps: float, cluster: ClusterSpec) -> float:
    return sent_bytes / (bw_gbps * 1e9) + calls * cluster.latency_us * 1e-6


def bandwidth(intra: bool, cluster: ClusterSpec) -> float:
    return cluster.intra_node_gbps if intra else cluster.inter_node_gbps


def group_bandwidth(group: str, layout: Layout, cluster: ClusterSpec) -> float:
    if group == "tp":
        return cluster.intra_node_gbps
    size = {"cp": layout.cp, "ep": layout.ep}[group]
    return bandwidth(group_is_intra_node(layout.tp, size, cluster.gpus_per_node), cluster)


@dataclass
class StageComm:
    """Seconds per micro-batch (step: per step) of a stage's synchronous collectives."""
    tp_fwd: float = 0.0       # forward TP collectives
    tp_bwd: float = 0.0       # backward ones: input gradients, the SP re-gathers, full recomputation's replay
    tp_regather: float = 0.0  # of tp_bwd: the SP column layers' inputs gathered again (W under zero-bubble)
    tp_replay: float = 0.0    # of tp_bwd: the forward collectives full recomputation replays
    tp_step: float = 0.0      # once per step after the backward: finish_tp_grads
    cp_fwd: float = 0.0       # context parallelism: exposed ring transfers and all-to-alls, forward
    cp_bwd: float = 0.0
    ep_fwd: float = 0.0       # expert parallelism's all-to-alls, forward
    ep_bwd: float = 0.0       # backward (+ full recomputation's replay)


def stage_comm(cfg: ModelConfig, layout: Layout, training: TrainingSpec, cluster: ClusterSpec, stage: int,
               peak: float) -> StageComm:
    """The collectives of one micro-batch on pipeline stage `stage` (module docstring); `peak`: the FLOP/s the
    compute runs at (for what a ring transfer hides behind)."""
    at = RankLayout.of(layout, training)
    s_local = local_seq_len(layout, training)
    out, full = StageComm(), layout.recompute == "full"
    sizes = {"tp": layout.tp, "cp": layout.cp, "ep": layout.ep}
    once = [(c, False) for c in step_collectives(cfg, layout, stage, at)]
    for c, again in micro_batch_collectives(cfg, layout, stage, s_local, at, training.fused_linear_cross_entropy) + once:
        if sizes[c.group] == 1:
            continue
        t = collective_time(_SENT[c.op](sizes[c.group]) * c.payload * c.calls, c.calls,
                            group_bandwidth(c.group, layout, cluster), cluster)
        replay = t if (full and again and c.phase == "forward") else 0.0
        if c.group == "tp":
            if c.phase == "step":
                out.tp_step += t
            elif c.phase == "forward":
                out.tp_fwd, out.tp_bwd, out.tp_replay = out.tp_fwd + t, out.tp_bwd + replay, out.tp_replay + replay
            else:
                out.tp_bwd += t
                out.tp_regather += t if c.phase == "regather" else 0.0
        elif c.phase == "forward":
            setattr(out, f"{c.group}_fwd", getattr(out, f"{c.group}_fwd") + t)
            setattr(out, f"{c.group}_bwd", getattr(out, f"{c.group}_bwd") + replay)
        elif c.phase != "step":
            setattr(out, f"{c.group}_bwd", getattr(out, f"{c.group}_bwd") + t)
    ring_fwd, ring_bwd = ring_exposed(cfg, layout, training, cluster, stage_layer_ids(cfg, layout, stage), peak)
    out.cp_fwd, out.cp_bwd = out.cp_fwd + ring_fwd, out.cp_bwd + ring_bwd
    return out


def ring_exposed(cfg: ModelConfig, layout: Layout, training: TrainingSpec, cluster: ClusterSpec, layers: list,
                 peak: float) -> tuple[float, float]:
    """(forward, backward) seconds per micro-batch of the ring transfers of `layers` that their attention cannot
    hide: each step's transfer runs beside one block's attention (1/cp of the rank's; twice that in backward).
    Recomputation (full or selective) replays the forward ring."""
    c = layout.cp
    if c == 1 or not layers:
        return 0.0, 0.0
    at = RankLayout.of(layout, training)
    bw = group_bandwidth("cp", layout, cluster)
    tokens = layout.micro_batch_size * local_seq_len(layout, training)
    fwd = bwd = 0.0
    groups: dict = {}
    for i in layers:
        groups.setdefault(signature(cfg, i), []).append(i)
    for ids in groups.values():
        i = ids[0]
        if not layer_cost(cfg, i, at).context_features:
            continue
        vol = ring_layer_volume(cfg, layout, training.seq_len, training.act_bytes, i)
        block = layer_flops(cfg, i, at, training.seq_len) * tokens / c / peak  # one block's attention
        fwd_calls, fwd_bytes = vol["forward"]
        bwd_calls, bwd_bytes = vol["backward"]
        one_kv = collective_time(fwd_bytes / fwd_calls, 1, bw, cluster)
        f = fwd_calls * max(0.0, one_kv - block)
        # backward: c - 1 steps with a K|V and a dK|dV transfer beside 2 blocks of work, then the last dK|dV alone
        per_dkv = collective_time((bwd_bytes - fwd_bytes) / c, 1, bw, cluster)
        b = (c - 1) * max(0.0, one_kv + per_dkv - 2 * block) + per_dkv
        if layout.recompute != "none":
            b += f
        fwd, bwd = fwd + len(ids) * f, bwd + len(ids) * b
    return fwd, bwd
