"""Step time, throughput and MFU of a layout, and the search over layouts.

Time of one optimizer step, as tpzoo runs it (tpzoo.train.loop: forward_backward, finalize_grads,
DistributedAdamW.reduce_grads, step):
    pipeline  m * (F + B + W) of the slowest stage + its bubble (plan/schedule.py, equal to
              tpzoo.pipeline.simulate), per micro-batch
                F = forward FLOPs / (peak * efficiency) + forward tensor-parallel collectives,
                B = input-gradient FLOPs (+ recomputation) + backward collectives,  W = weight-gradient FLOPs;
              tensor-parallel collectives are synchronous (on the critical path); pipeline sends are posted
              asynchronously and overlap compute, except on the fill and drain path ((pp - 1) hops each way)
    + gradient sync: finish_tp_grads, the tied-embedding sum (model dtype), and what the backward does not
              hide of the data-parallel reduction in fp32 (2^24-element buckets, all-reduced; ZeRO-1:
              reduce-scattered, ZeRO-2: reduce-scattered every micro-batch; overlapped with the backward passes,
              dp_sync_time) + under ZeRO the all-gather of the updated parameters in the model dtype
    + optimizer step, memory bound: ~40 bytes of HBM traffic per owned element.
Context parallelism (cp > 1): each rank computes seq_len / cp tokens and 1/cp of the causal attention; ring
attention's K|V (and in the backward dK|dV) transfers per layer (plan/volume.py ring_layer_volume) overlap the
attention of the block at hand, and only what a transfer takes beyond one block's attention is exposed (cp_comm);
activation recomputation runs the forward ring again. Gradients are reduced over dp x cp.
Mixtures of experts (ep > 1): each MoE layer's all-to-alls (plan/volume.py moe_layer_volume) are synchronous on
the ep group (ep_comm); the expert weights' gradients are reduced over edp = dp x cp / ep, the rest over dp x cp;
FLOPs count the active parameters (the router and k experts per token).
A collective costs latency + ring bytes sent / bandwidth: intra-node when its whole group sits in one node,
else the per-GPU inter-node bandwidth.
FLOPs of a micro-batch on one GPU, from its local shapes (replicated kv heads and vocab padding included):
matmuls 2 * tokens * weights (F), the same again for W, and for B; causal attention 4 * b * s * (s + 1)/2 *
heads * head_dim per layer in F and twice that in B; full recompute adds a forward without the MLP's output
matmul (torch's checkpoint stops recomputing early), selective the attention core. tpzoo's zero-bubble W
runs only the weight-gradient work (and, under full recomputation, the recomputed forward again: stage_times).
MFU counts the model's FLOPs, ModelConfig.flops_per_token (non-causal attention, the usual convention).
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field

from tpzoo.errors import ConfigError
from tpzoo.models.config import ModelConfig
from tpzoo.parallel.dims import ParallelLayoutError

from .fp8 import at_fp8_rate, fp8_flops
from .lora import lora_layer_params
from .memory import (MemoryBreakdown, ParamCount, bucket_size, late_params, local_dims, stage_memory,
                     stage_params)
from .schedule import bubble_time
from .spec import (RECOMPUTE, ClusterSpec, Layout, TrainingSpec, check_layout, group_is_intra_node,
                   local_seq_len, num_micro_batches, stage_chunks, stage_layers)
from .volume import moe_layer_volume, moe_layers, ring_layer_volume, tp_step_volume

GIB = 1024 ** 3
BUCKET = 1 << 24  # DistributedAdamW's all-reduce bucket (elements)


@dataclass
class TimeBreakdown:
    compute: float = 0.0      # forward + backward FLOPs of m micro-batches on the slowest stage
    recompute: float = 0.0    # the extra forward work of activation recomputation
    tp_comm: float = 0.0      # tensor/sequence-parallel collectives, incl. finish_tp_grads
    cp_comm: float = 0.0      # ring attention transfers not hidden behind the attention of a block
    ep_comm: float = 0.0      # MoE token dispatch and return (all-to-all over the ep group, synchronous)
    pp_comm: float = 0.0      # pipeline sends on the fill and drain path (the rest overlaps compute)
    bubble: float = 0.0       # pipeline fill and drain
    dp_comm: float = 0.0      # data-parallel reduction not hidden behind backward (+ ZeRO all-gather), tied sync
    optimizer: float = 0.0
    dp_hidden: float = 0.0    # data-parallel reduction overlapped with the backward passes (not in the total)

    @property
    def total(self) -> float:
        return (self.compute + self.recompute + self.tp_comm + self.cp_comm + self.ep_comm + self.pp_comm
                + self.bubble + self.dp_comm + self.optimizer)


@dataclass
class Estimate:
    layout: Layout
    micro_batches: int
    memory: MemoryBreakdown          # the fullest pipeline stage
    time: TimeBreakdown
    tokens_per_s: float
    mfu: float
    fits: bool
    reason: str = ""                 # why it does not fit
    slowest_stage: int = 0           # the stage that sets the pipeline's pace
    stage_memory_gib: list = field(default_factory=list)

    def to_dict(self) -> dict:
        mem = asdict(self.memory)
        mem = {k: (v / GIB if k != "stage" else v) for k, v in mem.items()}
        mem["total"] = self.memory.total / GIB
        return {"layout": self.layout.to_dict(), "label": self.layout.label(), "micro_batches": self.micro_batches,
                "fits": self.fits, "reason": self.reason, "memory_gib": mem, "slowest_stage": self.slowest_stage,
                "stage_memory_gib": self.stage_memory_gib,
                "time_s": {**{k: v for k, v in asdict(self.time).items() if k != "ep_comm" or self.layout.ep > 1},
                           "total": self.time.total},
                "tokens_per_s": self.tokens_per_s, "mfu": self.mfu}


def _collective_time(sent_bytes: float, calls: int, bw_gbps: float, cluster: ClusterSpec) -> float:
    return sent_bytes / (bw_gbps * 1e9) + calls * cluster.latency_us * 1e-6


def _bandwidth(intra: bool, cluster: ClusterSpec) -> float:
    return cluster.intra_node_gbps if intra else cluster.inter_node_gbps


def stage_flops(cfg: ModelConfig, layout: Layout, training: TrainingSpec, stage: int) -> dict:
    """FLOPs of one micro-batch on one GPU of stage `stage`: forward, input gradients (dgrad), weight
    gradients (wgrad) and the forward work of recomputation (each time the backward walks the graph)."""
    t, b, s = layout.tp, layout.micro_batch_size, training.seq_len
    tokens, h, d = b * s // layout.cp, cfg.hidden_size, local_dims(cfg, t, training.vocab_padding_multiple)
    count = stage_params(cfg, t, layout.pp, stage, layout.virtual_stages, training.vocab_padding_multiple, layout.ep)
    layers = stage_layers(cfg, layout.pp, stage, layout.virtual_stages)
    moe = moe_layers(cfg, layout.pp, stage, layout.virtual_stages)
    # the MLP's output matmul per token (not recomputed under full recompute): k experts' on an MoE layer
    mlp_out = (layers - moe) * d.ffn * h + moe * cfg.num_experts_per_tok * (cfg.expert_ffn // t) * h
    def mean_keys(w):  # mean keys per query, causal, within a window of w
        return (s + 1) / 2 if (w is None or w >= s) else (w * s - w * (w - 1) / 2) / s
    keys = sum(mean_keys(cfg.attention.window(i)) for i in range(cfg.num_layers)) / cfg.num_layers  # mixed layers
    attn = layers * 4 * b * s * keys * d.heads * cfg.head_dim / layout.cp  # load-balanced: 1/cp of the causal work
    matmul = 2 * tokens * count.matmul + (2 * tokens * h * d.vocab if stage == layout.pp - 1 else 0)
    if layout.recompute == "full":
        extra = 2 * tokens * count.matmul + attn - 2 * tokens * mlp_out
    else:
        extra = attn if layout.recompute == "selective" else 0.0
    if training.lora_rank:  # frozen base: no weight gradients but the adapters' (whose matmuls are small)
        lora = 2 * tokens * layers * lora_layer_params(cfg, t, training.lora_rank)
        return {"forward": matmul + attn + lora, "dgrad": matmul + 2 * attn + lora, "wgrad": lora,
                "recompute": extra + (lora if layout.recompute == "full" else 0)}
    return {"forward": matmul + attn, "dgrad": matmul + 2 * attn, "wgrad": matmul, "recompute": extra}


def stage_times(f: dict, tp_fwd: float, tp_bwd: float, peak: float, zero_bubble: bool, first: bool,
                tp_regather: float = 0.0, tp_replay: float = 0.0) -> dict:
    """Seconds of one micro-batch's F, B and W actions on a stage, and their compute / recompute / comm parts.

    tpzoo's zero-bubble split (tpzoo.pipeline.weight_grad): B computes only input gradients; W restarts autograd
    where each weight's branch leaves the input path, so it runs only the weight-gradient matmuls and the SP
    column layers' re-gathers (`tp_regather`, part of tp_bwd). Under full recomputation W is a second graph task
    that re-runs the checkpointed forward: its FLOPs and its collectives (`tp_replay`, > 0 only then) once more.
    On the first stage B has no input to differentiate and W does the whole backward once."""
    fwd = f["forward"] / peak + tp_fwd
    walk = (f["dgrad"] + f["recompute"]) / peak + tp_bwd  # the whole backward but the weight gradients
    rec, tp = f["recompute"] / peak, tp_fwd + tp_bwd
    if not zero_bubble:
        return {"F": fwd, "B": walk, "W": f["wgrad"] / peak, "recompute": rec, "tp": tp}
    if first:
        return {"F": fwd, "B": 0.0, "W": walk + f["wgrad"] / peak, "recompute": rec, "tp": tp}
    again = rec if tp_replay else 0.0
    return {"F": fwd, "B": walk - tp_regather, "W": f["wgrad"] / peak + tp_regather + again + tp_replay,
            "recompute": rec + again, "tp": tp + tp_replay}


def ring_exposed(cfg: ModelConfig, layout: Layout, training: TrainingSpec, cluster: ClusterSpec, layers: int,
                 peak: float) -> tuple[float, float]:
    """(forward, backward) seconds per micro-batch of ring transfers a stage of `layers` layers cannot hide: each
    step's transfer runs beside one block's attention (1/cp of the rank's attention; twice that in backward).
    Recomputation (full or selective) replays the forward ring in the backward."""
    c = layout.cp
    if c == 1 or layers == 0:
        return 0.0, 0.0
    vol = ring_layer_volume(cfg, layout, local_seq_len(layout, training), training.act_bytes)
    bw = _bandwidth(group_is_intra_node(layout.tp, c, cluster.gpus_per_node), cluster)
    keys = (training.seq_len + 1) / 2  # mean keys per query, causal
    heads = local_dims(cfg, layout.tp).heads
    block = 4 * layout.micro_batch_size * training.seq_len * keys * heads * cfg.head_dim / c / c / peak  # one block
    fwd_calls, fwd_bytes = vol["forward"]
    bwd_calls, bwd_bytes = vol["backward"]
    fwd = fwd_calls * max(0.0, _collective_time(fwd_bytes / fwd_calls, 1, bw, cluster) - block)
    # backward: c - 1 steps with a K|V and a dK|dV transfer beside 2 blocks of work, then the last dK|dV alone
    per_dkv = (bwd_bytes - fwd_bytes) / c
    step = _collective_time(fwd_bytes / fwd_calls, 1, bw, cluster) + _collective_time(per_dkv, 1, bw, cluster)
    bwd = (c - 1) * max(0.0, step - 2 * block) + _collective_time(per_dkv, 1, bw, cluster)
    if layout.recompute != "none":
        bwd += fwd
    return layers * fwd, layers * bwd


def dp_sync_time(count, layout: Layout, training: TrainingSpec, cluster: ClusterSpec, m: int,
                 backward: float, replicas: int | None = None, stride: int | None = None) -> tuple[float, float]:
    """(exposed, hidden) seconds of one stage's data-parallel gradient sync, as DistributedAdamW runs it: fp32
    gradients all-reduced (ZeRO 0) or reduce-scattered (ZeRO-1; ZeRO-2 once per micro-batch) bucket by bucket,
    then under ZeRO the updated parameters all-gathered (model dtype, after the step: exposed). With overlap a
    bucket reduces as soon as its gradients are final: behind the stage's last backward (`backward`: one
    micro-batch's B + W) at ZeRO 0/1, behind each micro-batch's own backward at ZeRO-2; the bucket finished
    last (the first layers) and the late buckets (reduced after finalize_grads) stay exposed. ZeRO-3 adds the
    weights' all-gathers of every micro-batch's forward and backward (prefetched: mostly hidden) and keeps of the
    after-step all-gather only the late buckets. The group is dp x cp (the ranks holding the same parameters), or
    `replicas` ranks `stride` apart (the expert weights' edp group: dp x cp / ep ranks, tp * ep apart)."""
    dp, zero, e = replicas or layout.grad_replicas, training.zero_level, training.act_bytes  # dp x cp
    if dp == 1 or count.numel == 0:
        return 0.0, 0.0
    padded = -(-count.numel // dp) * dp
    bw = _bandwidth(group_is_intra_node(stride or layout.tp, dp, cluster.gpus_per_node), cluster)
    size = bucket_size(training, dp)
    buckets = -(-padded // size)
    ring = (dp - 1) / dp * padded * 4 * (1 if zero else 2)
    passes = m if zero >= 2 else 1
    reduce = passes * _collective_time(ring, buckets, bw, cluster)
    gather = _collective_time((dp - 1) / dp * padded * e, buckets, bw, cluster) if zero else 0.0
    late = min(late_params(count, layout.tp, layout.sequence_parallel), count.numel) / max(count.numel, 1)
    weights_exposed = weights_hidden = 0.0
    if zero >= 3:
        # ZeRO-3: every micro-batch's forward and backward all-gather the weights layer by layer, the next
        # layer's gather prefetched behind the current one's compute (a forward ~ half a backward): exposed only
        # the first bucket of each pass, or what the pass's compute cannot cover. After the step only the late
        # buckets are all-gathered.
        first = gather * min(1.0, size / max(count.numel, 1))
        weights_exposed = m * (max(gather - backward / 2, first) + max(gather - backward, first))
        weights_hidden = 2 * m * gather - weights_exposed
        gather *= late
    if not training.overlap_grad_reduce:
        return reduce + gather + weights_exposed, weights_hidden
    normal = reduce * (1 - late)
    last_bucket = normal * min(1.0, size / max(count.numel * (1 - late), 1))
    exposed = reduce * late + max(normal - passes * backward, last_bucket)
    return exposed + gather + weights_exposed, reduce - exposed + weights_hidden + 0.0


def ep_exposed(cfg: ModelConfig, layout: Layout, cluster: ClusterSpec, moe: int, seq_len: int,
               e: int) -> tuple[float, float]:
    """(forward, backward) seconds per micro-batch of the `moe` MoE layers' all-to-alls (moe_layer_volume): on
    the critical path (the experts wait for their rows), over the ep group (ep ranks tp apart: intra-node when
    tp * ep fits a node). Forward: the counts and two row exchanges; backward: two row exchanges, and under full
    recomputation the forward's three again."""
    if layout.ep == 1 or not moe:
        return 0.0, 0.0
    vol = moe_layer_volume(cfg, layout, seq_len, e).table
    bw = _bandwidth(group_is_intra_node(layout.tp, layout.ep, cluster.gpus_per_node), cluster)
    counts, rows = vol[("all_to_all", "ep")], vol[("all_to_all_v", "ep")]
    one_count = _collective_time(counts.sent_bytes / counts.calls, 1, bw, cluster)
    one_rows = _collective_time(rows.sent_bytes / rows.calls, 1, bw, cluster)
    fwd = one_count + 2 * one_rows
    bwd = 2 * one_rows + (fwd if layout.recompute == "full" else 0.0)
    return moe * fwd, moe * bwd


def refuse_moe_lora(cfg: ModelConfig, training: TrainingSpec) -> None:
    """LoRA's plan (plan/lora.py) puts adapters on a dense MLP; on a mixture of experts tpzoo adapts only the
    linear layers (the experts are not one), which the plan does not model: one line."""
    if training.lora_rank and cfg.num_experts:
        raise ConfigError(f"tpzoo plan does not model LoRA on a mixture of experts ({cfg.name or cfg.family}: "
                          f"{cfg.num_experts} experts); plan full training, or LoRA on a dense model")


def synced_params(cfg: ModelConfig, layout: Layout, training: TrainingSpec) -> ParamCount:
    """The trained parameters of one rank on the stage holding the most (the first, the last: embedding, head;
    or one with the most layers): what its data-parallel sync, and DiLoCo's exchange (plan/replicas.py), move.
    LoRA: only the adapters."""
    p, v = layout.pp, layout.virtual_stages
    fullest = max(range(p), key=lambda s: stage_layers(cfg, p, s, v))
    if training.lora_rank:  # only the adapters are reduced, updated and (tied copies aside) kept in sync
        layers = stage_layers(cfg, p, fullest, v)
        return ParamCount(layers * lora_layer_params(cfg, layout.tp, training.lora_rank), 0, 0, 0, 0, 0)
    return max((stage_params(cfg, layout.tp, p, s, v, training.vocab_padding_multiple, layout.ep)
                for s in {0, fullest, p - 1}), key=lambda c: c.numel)


def estimate(cfg: ModelConfig, layout: Layout, cluster: ClusterSpec, training: TrainingSpec) -> Estimate:
    """Memory and step time of `layout`; raises ParallelLayoutError when tpzoo cannot run it."""
    refuse_moe_lora(cfg, training)
    check_layout(cfg, layout, cluster, training)
    t, p, dp, v = layout.tp, layout.pp, layout.dp, layout.virtual_stages
    m, e, K = num_micro_batches(layout, training), training.act_bytes, cluster.gpus_per_node
    peak = cluster.gpu_tflops * 1e12 * cluster.efficiency
    pad = training.vocab_padding_multiple
    # Stages differ only by their layers and whether they are first or last (and, for memory, their place in
    # the schedule): time each kind once (a 126-layer model on 64 stages has a handful).
    kinds = {s: (stage_layers(cfg, p, s, v), s == 0, s == p - 1) for s in range(p)}
    mems = [stage_memory(cfg, layout, training, s, int(cluster.reserve_gib * GIB)) for s in range(p)]
    worst = max(mems, key=lambda mb: mb.total)

    best = None
    s_local = local_seq_len(layout, training)
    for s in sorted({kind: s for s, kind in kinds.items()}.values()):
        fin = tp_step_volume(cfg, layout, s, 0, s_local, e, e, pad, training.fused_linear_cross_entropy)
        one = tp_step_volume(cfg, layout, s, 1, s_local, e, e, pad, training.fused_linear_cross_entropy)
        tp_mb = _collective_time(one.sent("tp") - fin.sent("tp"), one.calls("tp") - fin.calls("tp"),
                                 cluster.intra_node_gbps, cluster)
        tp_fin = _collective_time(fin.sent("tp"), fin.calls("tp"), cluster.intra_node_gbps, cluster)
        # The forward's share of a layer's collectives (equal sizes): without SP 2 all-reduces of 4, the backward
        # 2 more; with SP 2 all-gathers + 2 reduce-scatters of 10, the backward 4 all-gathers (2 re-gather the
        # column inputs) + 2 reduce-scatters. Full recomputation repeats most forward ones (1 resp. 3).
        again, sp = layout.recompute == "full", layout.sequence_parallel
        unit = tp_mb / ((10 + 3 * again) if sp else (4 + again))
        tp_fwd = unit * (4 if sp else 2)
        # Zero-bubble's W: the re-gathers (SP), and under full recomputation the replayed forward's collectives
        flops = stage_flops(cfg, layout, training, s)
        if training.fp8 != "none":  # the projections' GEMMs at twice the rate (plan/fp8.py)
            ids = [i for lo, hi in stage_chunks(cfg, p, s, v) for i in range(lo, hi)]
            flops = at_fp8_rate(flops, fp8_flops(cfg, t, layout.micro_batch_size * training.seq_len // layout.cp,
                                                 ids, bool(training.lora_rank), layout.recompute))
        ring_fwd, ring_bwd = ring_exposed(cfg, layout, training, cluster, kinds[s][0], peak)
        ep_fwd, ep_bwd = ep_exposed(cfg, layout, cluster, moe_layers(cfg, p, s, v), s_local, e)
        ring_fwd, ring_bwd = ring_fwd + ep_fwd, ring_bwd + ep_bwd  # synchronous, beside the tp collectives
        st = stage_times(flops, tp_fwd + ring_fwd, tp_mb - tp_fwd + ring_bwd, peak,
                         layout.schedule == "zb" and p > 1, s == 0, unit * 2 * sp,
                         unit * (3 if sp else 1) * again)
        total = st["F"] + st["B"] + st["W"]
        if best is None or total > best[0]:
            best = (total, st, tp_fin, s, ring_fwd + ring_bwd - ep_fwd - ep_bwd, ep_fwd + ep_bwd)
    tau, st, tp_fin, slow, ring, ep_mb = best

    pp_intra = group_is_intra_node(t * layout.cp * dp, p, K)  # pipeline peers are tp*cp*dp ranks apart
    tokens = layout.micro_batch_size * s_local
    msg = e * cfg.hidden_size * tokens // (t if layout.sequence_parallel else 1)
    p2p = 2 * (p - 1) * _collective_time(msg, 1, _bandwidth(pp_intra, cluster), cluster)

    count = synced_params(cfg, layout, training)
    replicas = layout.grad_replicas  # the optimizer shards over dp x cp
    experts = 0
    if layout.ep > 1 and count.expert:  # the experts in their own optimizer over edp (tp * ep ranks apart)
        experts = count.expert
        count = ParamCount(count.numel - experts, count.tensors, count.matmul, count.sequence_parallel,
                           count.replicated_kv, count.embedding)
    padded = -(-count.numel // replicas) * replicas
    dp_time, dp_hidden = dp_sync_time(count, layout, training, cluster, m, st["B"] + st["W"])
    owned = padded // replicas if training.zero_level else padded
    if experts:
        edp = layout.expert_replicas
        ex_time, ex_hidden = dp_sync_time(ParamCount(experts, 0, 0, 0, 0, 0), layout, training, cluster, m,
                                          st["B"] + st["W"], edp, t * layout.ep)
        dp_time, dp_hidden = dp_time + ex_time, dp_hidden + ex_hidden
        ex_padded = -(-experts // edp) * edp
        padded, owned = padded + ex_padded, owned + (ex_padded // edp if training.zero_level else ex_padded)
    if count.embedding:  # tied embedding and head on two stages: all-reduce their gradients (model dtype)
        dp_time += _collective_time(count.embedding * e, 1, _bandwidth(pp_intra, cluster), cluster)
    opt = (40 * owned + e * padded) / (cluster.hbm_gbps * 1e9) + cluster.latency_us * 1e-6  # + the norm's

    tb = TimeBreakdown(compute=m * (tau - st["recompute"] - st["tp"]), recompute=m * st["recompute"],
                       tp_comm=m * (st["tp"] - ring - ep_mb) + tp_fin, cp_comm=m * ring, ep_comm=m * ep_mb,
                       pp_comm=p2p,
                       bubble=bubble_time(layout, m, st["F"], st["B"], st["W"]), dp_comm=dp_time, optimizer=opt,
                       dp_hidden=dp_hidden)
    step_tokens = training.global_batch_size * training.seq_len
    tokens_per_s = step_tokens / tb.total
    # LoRA computes no weight gradients of the base: its model FLOPs are forward + input gradients, 2/3 of these.
    model_flops = cfg.flops_per_token(training.seq_len) * (2 / 3 if training.lora_rank else 1)
    mfu = model_flops * tokens_per_s / (cluster.gpus * cluster.gpu_tflops * 1e12)
    fits = worst.total <= cluster.gpu_memory_gib * GIB
    states = worst.params + worst.grads + worst.master + worst.optimizer
    reason = "" if fits else (f"needs {worst.total / GIB:.1f} GiB > {cluster.gpu_memory_gib:g} GiB (stage "
                              f"{worst.stage}: weights+grads+optimizer {states / GIB:.1f}, activations "
                              f"{worst.activations / GIB:.1f})")
    return Estimate(layout, m, worst, tb, tokens_per_s, mfu, fits, reason, slow,
                    [round(mb.total / GIB, 2) for mb in mems])


def _divisors(n: int) -> list[int]:
    return [k for k in range(1, n + 1) if n % k == 0]


LONG_SEQ = 16384  # from this sequence length on, the search also tries context parallelism


def enumerate_layouts(cfg: ModelConfig, cluster: ClusterSpec, training: TrainingSpec, max_micro_batch: int = 64,
                      tp: int | None = None, pp: int | None = None, recompute: str | None = None,
                      max_virtual_stages: int = 8, cp: int | None = None, ep: int | None = None) -> list[Layout]:
    """Every layout tpzoo can run on this cluster (check_layout passes): tp within a node, pp <= layers, dp
    the rest; micro-batch sizes dividing the per-replica batch; recompute none/selective/full; sequence
    parallelism with tp > 1; 1F1B, zero-bubble, and interleaved with 2 <= v <= max_virtual_stages chunks per
    stage (pp * v <= layers; tpzoo splits unevenly when they do not divide); context parallelism (powers of two)
    for sequences of LONG_SEQ tokens or more; for a mixture of experts expert parallelism ep (the divisors of
    num_experts that divide dp * cp). `tp`, `pp`, `recompute`, `cp`, `ep` restrict the search to one value."""
    out = []
    g, want_tp, want_pp = cluster.gpus, tp, pp
    if cp is not None:
        cps = [cp]
    else:
        cps = [1] + ([2 ** k for k in range(1, g.bit_length()) if g % 2 ** k == 0]
                     if training.seq_len >= LONG_SEQ else [])
    for tp, cp in ((t, c) for t in _divisors(min(cluster.gpus_per_node, g)) for c in cps):
        for pp in range(1, min(cfg.num_layers, g // (tp * cp)) + 1):
            if g % (tp * cp * pp) or want_tp not in (None, tp) or want_pp not in (None, pp):
                continue
            dp = g // (tp * cp * pp)
            if training.global_batch_size % dp:
                continue
            eps = [ep] if ep is not None else [k for k in _divisors(cfg.num_experts or 1) if dp * cp % k == 0]
            scheds = [("1f1b", 1)] if pp == 1 else [("1f1b", 1), ("zb", 1)] + [
                ("interleaved", v) for v in range(2, min(max_virtual_stages, cfg.num_layers // pp) + 1)]
            for mbs in _divisors(training.global_batch_size // dp):
                if mbs > max_micro_batch:
                    break
                for rec in (RECOMPUTE if recompute is None else (recompute,)):
                    for sp in ((False, True) if tp > 1 else (False,)):
                        for (sched, v), e in ((sv, e) for sv in scheds for e in eps):
                            lay = Layout(tp, pp, dp, mbs, rec, sp, sched, v, cp, e)
                            try:
                                check_layout(cfg, lay, cluster, training)
                            except ParallelLayoutError:
                                continue
                            out.append(lay)
    return out


def search(cfg: ModelConfig, cluster: ClusterSpec, training: TrainingSpec, max_micro_batch: int = 64,
           **only) -> list[Estimate]:
    """Every valid layout (enumerate_layouts; `only`: tp=, pp=, recompute=, cp=, ep=), estimated: the ones that
    fit first, fastest first; then the rest, fastest first. A fixed ep that the model cannot take (ep not
    dividing its experts, ep > 1 for a dense model) is one ConfigError line."""
    refuse_moe_lora(cfg, training)
    ep = only.get("ep")
    if ep is not None and (ep < 1 or (cfg.num_experts or 1) % ep or (ep > 1 and not cfg.num_experts)):
        raise ConfigError(f"--ep {ep}: " + (f"does not divide num_experts={cfg.num_experts}" if cfg.num_experts
                                            else "the model has no experts (ep needs a mixture of experts)"))
    layouts = enumerate_layouts(cfg, cluster, training, max_micro_batch, **only)
    ests = [estimate(cfg, lay, cluster, training) for lay in layouts]
    return sorted(ests, key=lambda est: (not est.fits, est.time.total, est.memory.total))
