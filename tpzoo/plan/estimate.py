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
    + optimizer step, memory bound: ~40 bytes of HBM traffic per owned element
    + with --optimizer muon, the orthogonalization of the slowest stage's share and its exchange (plan/muon.py).
Context parallelism (cp > 1): each rank computes seq_len / cp tokens and 1/cp of the causal attention; ring
attention's K|V (and in the backward dK|dV) transfers per layer overlap the attention of the block at hand, and
only what a transfer takes beyond one block's attention is exposed (cp_comm; plan/stage_comm.py); all-to-alls over
cp (a linear-attention kind's heads exchange) are synchronous. Gradients are reduced over dp x cp.
Mixtures of experts (ep > 1): each MoE layer's all-to-alls are synchronous on the ep group (ep_comm); the expert
weights' gradients are reduced over edp = dp x cp / ep, the rest over dp x cp; FLOPs count the active parameters
(the router and k experts per token).
What a layer computes and sends is what its kinds say (plan/kinds, plan/layers.py): FLOPs of a micro-batch on one
GPU from their local shapes (replicated kv heads, replicated down projections, vocab padding included): matmuls
2 * tokens * weights (F), the same again for W, and for B; each kind's core (causal attention 4 * keys * heads *
head_dim per token, a recurrence's) in F and twice that in B; full recompute adds a forward without what follows
the last saved tensor (the MLP's output matmul: torch's checkpoint stops recomputing early), selective the cores.
tpzoo's zero-bubble W runs only the weight-gradient work (and, under full recomputation, the recomputed forward
again: stage_times). Collectives by phase: plan/stage_comm.py.
MFU counts the model's FLOPs, ModelConfig.flops_per_token (non-causal attention, the usual convention).
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field

from tpzoo.models.config import ModelConfig

from .fp8 import at_fp8_rate, fp8_flops
from .layers import layer_cost, layer_flops, memo, signature
from .lora import lora_layer_flops, lora_layer_params
from .memory import MemoryBreakdown, ParamCount, bucket_size, late_params, stage_layer_ids, stage_memory, stage_params
from .muon import muon_time
from .head import local_vocab
from .schedule import bubble_time
from .spec import (ClusterSpec, Layout, RankLayout, TrainingSpec, check_layout, chunk_layer_ranges,
                   group_is_intra_node, local_seq_len, num_micro_batches)
from .stage_comm import bandwidth as _bandwidth
from .stage_comm import collective_time as _collective_time
from .stage_comm import stage_comm

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
    muon: float = 0.0         # --optimizer muon: the orthogonalization and its exchange (plan/muon.py)

    @property
    def total(self) -> float:
        return (self.compute + self.recompute + self.tp_comm + self.cp_comm + self.ep_comm + self.pp_comm
                + self.bubble + self.dp_comm + self.optimizer + self.muon)


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
    stage_busy_s: list = field(default_factory=list)   # per stage: m * (F + B + W), its compute and collectives
    stage_layers: list = field(default_factory=list)   # the model stages' [start, end) layers, in model order

    def to_dict(self) -> dict:
        mem = asdict(self.memory)
        mem = {k: (v / GIB if k != "stage" else v) for k, v in mem.items()}
        mem["total"] = self.memory.total / GIB
        return {"layout": self.layout.to_dict(), "label": self.layout.label(), "micro_batches": self.micro_batches,
                "fits": self.fits, "reason": self.reason, "memory_gib": mem, "slowest_stage": self.slowest_stage,
                "stage_memory_gib": self.stage_memory_gib, "stage_busy_s": self.stage_busy_s,
                "stage_layers": self.stage_layers,
                "time_s": {**{k: v for k, v in asdict(self.time).items()
                              if (k != "ep_comm" or self.layout.ep > 1) and (k != "muon" or v)},
                           "total": self.time.total},
                "tokens_per_s": self.tokens_per_s, "mfu": self.mfu}


def stage_flops(cfg: ModelConfig, layout: Layout, training: TrainingSpec, stage: int) -> dict:
    """FLOPs of one micro-batch on one GPU of stage `stage`: forward, input gradients (dgrad), weight
    gradients (wgrad) and the forward work of recomputation (each time the backward walks the graph)."""
    at = RankLayout.of(layout, training)
    tokens = layout.micro_batch_size * local_seq_len(layout, training)
    ids = stage_layer_ids(cfg, layout, stage)
    matmul = replay = core = 0.0
    for i in ids:
        c = layer_cost(cfg, i, at)
        matmul += c.matmul_flops(tokens, at.sp_div)
        replay += c.matmul_flops(tokens, at.sp_div, replayed_only=True)
        core += tokens * layer_flops(cfg, i, at, training.seq_len)  # load-balanced: 1/cp of the causal work
    if stage == layout.pp - 1:  # the head, once more per multi-token-prediction depth beside its projection
        heads = 1 + cfg.mtp_depths
        matmul += heads * 2 * tokens * cfg.hidden_size * local_vocab(cfg, layout.tp, training.vocab_padding_multiple)
        matmul += cfg.mtp_depths * 2 * tokens * 2 * cfg.hidden_size ** 2 // layout.tp
    if layout.recompute == "full":
        extra = replay + core
    else:
        extra = core if layout.recompute == "selective" else 0.0
    if training.lora_rank:  # frozen base: no weight gradients but the adapters' (whose matmuls are small)
        lora = sum(lora_layer_flops(cfg, i, layout.tp, training.lora_rank, tokens, layout.ep, training.lora_experts)
                   for i in ids)
        return {"forward": matmul + core + lora, "dgrad": matmul + 2 * core + lora, "wgrad": lora,
                "recompute": extra + (lora if layout.recompute == "full" else 0)}
    return {"forward": matmul + core, "dgrad": matmul + 2 * core, "wgrad": matmul, "recompute": extra}


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


def synced_params(cfg: ModelConfig, layout: Layout, training: TrainingSpec) -> ParamCount:
    """The trained parameters of one rank on the stage holding the most: what its data-parallel sync, and DiLoCo's
    exchange (plan/replicas.py), move. LoRA: only the adapters (of the stage with the most)."""
    p, pad = layout.pp, training.vocab_padding_multiple
    if training.lora_rank:  # only the adapters are reduced, updated and (tied copies aside) kept in sync
        return max((ParamCount(sum(lora_layer_params(cfg, i, layout.tp, training.lora_rank, layout.ep,
                                                     training.lora_experts)
                                   for i in stage_layer_ids(cfg, layout, s)), 0, 0, 0, 0, 0) for s in range(p)),
                   key=lambda c: c.numel)
    return max((stage_params(cfg, layout, s, pad) for s in range(p)), key=lambda c: c.numel)


def estimate(cfg: ModelConfig, layout: Layout, cluster: ClusterSpec, training: TrainingSpec) -> Estimate:
    """Memory and step time of `layout`; raises ParallelLayoutError when tpzoo cannot run it."""
    check_layout(cfg, layout, cluster, training)
    t, p, dp, v = layout.tp, layout.pp, layout.dp, layout.virtual_stages
    m, e, K = num_micro_batches(layout, training), training.act_bytes, cluster.gpus_per_node
    peak = cluster.gpu_tflops * 1e12 * cluster.efficiency
    pad = training.vocab_padding_multiple
    mems = [stage_memory(cfg, layout, training, s, int(cluster.reserve_gib * GIB)) for s in range(p)]
    worst = max(mems, key=lambda mb: mb.total)

    # Stages differ by their layers' kinds and whether they are first or last: time each kind of stage once (a
    # 126-layer model on 64 stages has a handful).
    kinds = {s: (tuple(signature(cfg, i) for i in stage_layer_ids(cfg, layout, s)), s == 0, s == p - 1)
             for s in range(p)}
    times, s_local = {}, local_seq_len(layout, training)
    for s in sorted({kind: s for s, kind in kinds.items()}.values()):
        comm = stage_comm(cfg, layout, training, cluster, s, peak)
        flops = stage_flops(cfg, layout, training, s)
        if training.fp8 != "none":  # the projections' GEMMs at twice the rate (plan/fp8.py)
            flops = at_fp8_rate(flops, fp8_flops(cfg, t, layout.micro_batch_size * s_local,
                                                 stage_layer_ids(cfg, layout, s), bool(training.lora_rank),
                                                 layout.recompute))
        sync_fwd, sync_bwd = comm.cp_fwd + comm.ep_fwd, comm.cp_bwd + comm.ep_bwd  # beside the tp collectives
        st = stage_times(flops, comm.tp_fwd + sync_fwd, comm.tp_bwd + sync_bwd, peak,
                         layout.schedule == "zb" and p > 1, s == 0, comm.tp_regather, comm.tp_replay)
        times[kinds[s]] = (st, comm)
    stage_time = [sum(times[kinds[s]][0][a] for a in "FBW") for s in range(p)]
    slow = max(range(p), key=lambda s: stage_time[s])
    tau, (st, comm) = stage_time[slow], times[kinds[slow]]
    ring, ep_mb = comm.cp_fwd + comm.cp_bwd, comm.ep_fwd + comm.ep_bwd

    pp_intra = group_is_intra_node(t * layout.cp * dp, p, K)  # pipeline peers are tp*cp*dp ranks apart
    tokens = layout.micro_batch_size * s_local
    msg = e * cfg.hidden_size * tokens // (t if layout.sequence_parallel else 1)
    p2p = 2 * (p - 1) * _collective_time(msg, 1, _bandwidth(pp_intra, cluster), cluster)

    # The gradient sync lasts as long as the stage holding the most parameters.
    count = synced_params(cfg, layout, training)
    replicas = layout.grad_replicas  # the optimizer shards over dp x cp
    experts = 0
    if layout.ep > 1 and count.expert:  # the experts in their own optimizer over edp (tp * ep ranks apart)
        experts = count.expert
        count = ParamCount(count.numel - experts, count.tensors, count.matmul, count.sequence_parallel,
                           count.replicated_kv, count.embedding, 0, count.partial)
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

    # Muon: every stage orthogonalizes its own matrices after the reduction; the step waits for the slowest
    muon = max(muon_time(cfg, layout, training, cluster, s) for s in range(p)) if training.optimizer == "muon" else 0.0
    tb = TimeBreakdown(compute=m * (tau - st["recompute"] - st["tp"]), recompute=m * st["recompute"],
                       tp_comm=m * (st["tp"] - ring - ep_mb) + comm.tp_step, cp_comm=m * ring, ep_comm=m * ep_mb,
                       pp_comm=p2p,
                       bubble=bubble_time(layout, m, st["F"], st["B"], st["W"]), dp_comm=dp_time, optimizer=opt,
                       dp_hidden=dp_hidden, muon=muon)
    step_tokens = training.global_batch_size * training.seq_len
    tokens_per_s = step_tokens / tb.total
    # LoRA computes no weight gradients of the base: its model FLOPs are forward + input gradients, 2/3 of these.
    per_token = memo(cfg, ("flops_per_token", training.seq_len), lambda: cfg.flops_per_token(training.seq_len))
    model_flops = per_token * (2 / 3 if training.lora_rank else 1)
    mfu = model_flops * tokens_per_s / (cluster.gpus * cluster.gpu_tflops * 1e12)
    fits = worst.total <= cluster.gpu_memory_gib * GIB
    states = worst.params + worst.grads + worst.master + worst.optimizer
    reason = "" if fits else (f"needs {worst.total / GIB:.1f} GiB > {cluster.gpu_memory_gib:g} GiB (stage "
                              f"{worst.stage}: weights+grads+optimizer {states / GIB:.1f}, activations "
                              f"{worst.activations / GIB:.1f})")
    return Estimate(layout, m, worst, tb, tokens_per_s, mfu, fits, reason, slow,
                    [round(mb.total / GIB, 2) for mb in mems], [m * x for x in stage_time],
                    [list(r) for r in chunk_layer_ranges(cfg, layout)])


