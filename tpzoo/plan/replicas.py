"""Across replicas over a slow link: the step time of synchronous training vs DiLoCo, and the H and F to use.

`tpzoo plan --replicas K --replica-link-gbps G` plans one replica (gpus / K GPUs, global batch / K: the layout
search and its step time as usual), then adds what crosses the link between replicas, as tpzoo.train.diloco runs
it. G is the bandwidth each rank gets across replicas (what `--emulate-link` emulates per rank): two clusters of
n GPUs joined by a W Gbit/s link give G = W / n. A collective across replicas costs its bytes / G + the link's
latency; K replicas, r = dp x cp / K ranks per replica holding the same parameters, N this rank's trained
parameters (the fullest stage; LoRA: the adapters), experts sharded over their own r / ep ranks.

- synchronous (--sync-every 1): every step, the all-reduce across replicas of the rank's shard of the fp32
  gradients (N / r elements, 2 (K-1)/K x 4 bytes each: hierarchical reduction), after the replica's own
  reduction: exposed, plus the step's two scalar sums (token count, loss): their latency.
- DiLoCo (H, F fragments, overlap T, sync dtype): every H steps each fragment's outer gradient crosses once:
  N / F elements per exchange (N / (r F) under ZeRO: owned segments), 2 (K-1)/K x 4 bytes each in fp32 (an
  all-reduce), (K-1) x 2 in bf16 and (K-1) x (1 + 4/128) in fp8 (an all-gather: summed in fp32 by each rank).
  Without overlap an exchange is exposed; with T it runs beside T inner steps and only what exceeds them is.
  The outer step (about 40 bytes of memory traffic per owned element) and, under ZeRO, the all-gather of the
  updated weights inside the replica follow each exchange. Amortized over the H steps.
- memory: DiLoCo keeps the global parameters and the Nesterov momentum in fp32 (8 bytes per owned element)
  and the fragment's outer gradient while it is exchanged; the synchronous form's ZeRO-0 keeps a 4 / r-byte shard.

The recommendation: synchronous when the link costs at most 5 % of its step; else the smallest H (of 2, 5, 10, 20,
50, 100, 200, 500, 1000), then the fewest fragments F (powers of two up to the layers and H), then overlap T (0,
else 1 from H = 20 on: an overlapped fragment's last T inner steps give way to the global parameters, T/H of its
progress) with which the link costs at most 5 % of the step; only forms whose extra memory fits are recommended
(the cheapest link when none that fits is within). `plan_replicas` takes the fastest layout of one replica for
which such a form exists: a layout that fills its GPUs leaves no room for DiLoCo's outer state, so a less-full one
may be the better plan; when none has room, nothing is recommended, and the table says so.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass

from tpzoo.models.config import ModelConfig

from .estimate import GIB, Estimate, _collective_time, synced_params
from .spec import ClusterSpec, TrainingSpec, group_is_intra_node

BUDGET = 0.05
CANDIDATE_H = (2, 5, 10, 20, 50, 100, 200, 500, 1000)
SYNC_BYTES = {"fp32": 4.0, "bf16": 2.0, "fp8": 1.0 + 4.0 / 128}
OUTER_BYTES = 40  # memory traffic of the outer step per owned element (delta, momentum, global, master)
OVERLAP_FROM = 20  # the recommendation overlaps (T = 1) only from this H on


@dataclass(frozen=True)
class ReplicaSpec:
    replicas: int
    link_gbps: float                  # gigabits per second each rank gets across replicas
    latency_ms: float = 0.0
    sync_every: int = 0               # a DiLoCo form to estimate besides the recommendation (0: none)
    fragments: int = 1
    overlap: int = 0
    dtype: str = "fp32"

    def __post_init__(self):
        if self.replicas < 2:
            raise ValueError(f"replicas must be at least 2 to plan across replicas, got {self.replicas}")
        if not self.link_gbps > 0 or self.latency_ms < 0:
            raise ValueError(f"the link between replicas needs --replica-link-gbps > 0 and a latency >= 0, got "
                             f"{self.link_gbps} Gbit/s, {self.latency_ms} ms")
        if self.dtype not in SYNC_BYTES:
            raise ValueError(f"sync dtype must be one of {', '.join(SYNC_BYTES)}, got {self.dtype!r}")
        if self.sync_every and (self.fragments > self.sync_every
                                or (self.overlap and self.overlap >= self.sync_every // self.fragments)):
            raise ValueError(f"sync_fragments <= sync_every and sync_overlap < sync_every / sync_fragments, got "
                             f"H={self.sync_every} F={self.fragments} T={self.overlap}")


@dataclass
class SyncEstimate:
    form: str                         # "synchronous", "DiLoCo", "Streaming DiLoCo"
    sync_every: int
    fragments: int
    overlap: int
    dtype: str
    bytes_per_step: float             # sent across replicas by one rank, per step (amortized)
    link_s: float                     # exposed seconds of the link per step (amortized)
    outer_s: float                    # the outer step and the weights' all-gather inside the replica, per step
    step_s: float                     # the whole step
    tokens_per_s: float
    extra_gib: float                  # memory per GPU beyond the replica's plan
    fits: bool

    @property
    def link_share(self) -> float:
        return self.link_s / self.step_s

    def flags(self) -> str:
        if self.sync_every == 1:
            return "--sync-every 1"
        return (f"--sync-every {self.sync_every}" + (f" --sync-fragments {self.fragments}" if self.fragments > 1
                                                     else "")
                + (f" --sync-overlap {self.overlap}" if self.overlap else "")
                + (f" --sync-dtype {self.dtype}" if self.dtype != "fp32" else ""))

    def to_dict(self) -> dict:
        return {**asdict(self), "link_share": self.link_share, "flags": self.flags()}


def _link_s(nbytes: float, calls: int, spec: ReplicaSpec) -> float:
    return nbytes * 8 / (spec.link_gbps * 1e9) + calls * spec.latency_ms / 1e3


def _elements(cfg: ModelConfig, est: Estimate, training: TrainingSpec) -> tuple[float, float]:
    """(elements a rank holds of the trained parameters, of those its sharded part) for one replica's layout."""
    lay = est.layout
    count = synced_params(cfg, lay, training)
    r = lay.grad_replicas
    experts = count.expert if lay.ep > 1 else 0
    dense = count.numel - experts
    return count.numel, dense / r + experts / max(r // lay.ep, 1)


def synchronous(cfg: ModelConfig, est: Estimate, cluster: ClusterSpec, training: TrainingSpec,
                spec: ReplicaSpec) -> SyncEstimate:
    k = spec.replicas
    _, shard = _elements(cfg, est, training)
    nbytes = 2 * (k - 1) / k * 4 * shard
    link = _link_s(nbytes, 1 + 2, spec)  # the shard's all-reduce, the token count and the loss
    extra = 4 * shard if not training.zero_level and est.layout.grad_replicas > 1 else 0.0
    return _finish("synchronous", 1, 1, 0, "fp32", nbytes, link, 0.0, extra, cfg, est, cluster, training, spec)


def diloco(cfg: ModelConfig, est: Estimate, cluster: ClusterSpec, training: TrainingSpec, spec: ReplicaSpec,
           every: int, fragments: int = 1, overlap: int = 0, dtype: str = "fp32") -> SyncEstimate:
    k, lay = spec.replicas, est.layout
    full, shard = _elements(cfg, est, training)
    owned = shard if training.zero_level else full
    per_fragment = owned / fragments
    wire = 2 * (k - 1) / k * 4 if dtype == "fp32" else (k - 1) * SYNC_BYTES[dtype]
    one = _link_s(wire * per_fragment, 1, spec)
    exposed = max(0.0, one - overlap * est.time.total)
    outer = OUTER_BYTES * per_fragment / (cluster.hbm_gbps * 1e9)
    if training.zero_level and lay.grad_replicas > 1:  # publish: the updated weights all-gathered in the replica
        bw = cluster.intra_node_gbps if group_is_intra_node(lay.tp, lay.grad_replicas, cluster.gpus_per_node) \
            else cluster.inter_node_gbps
        r = lay.grad_replicas
        outer += _collective_time((r - 1) / r * full * training.act_bytes, 1, bw, cluster)
    extra = 8 * owned + 4 * per_fragment + (per_fragment * SYNC_BYTES[dtype] * k if dtype != "fp32" else 0)
    form = "DiLoCo" if fragments == 1 and not overlap else "Streaming DiLoCo"
    return _finish(form, every, fragments, overlap, dtype, wire * owned / every, fragments * exposed / every,
                   fragments * outer / every, extra, cfg, est, cluster, training, spec)


def _finish(form, every, fragments, overlap, dtype, nbytes, link, outer, extra, cfg, est, cluster, training,
            spec) -> SyncEstimate:
    step = est.time.total + link + outer
    tokens = training.global_batch_size * training.seq_len * spec.replicas  # est plans one replica's batch
    fits = est.memory.total + extra <= cluster.gpu_memory_gib * GIB
    return SyncEstimate(form, every, fragments, overlap, dtype, nbytes, link, outer, step, tokens / step,
                        extra / GIB, fits)


def recommend(cfg: ModelConfig, est: Estimate, cluster: ClusterSpec, training: TrainingSpec,
              spec: ReplicaSpec, budget: float = BUDGET) -> SyncEstimate | None:
    """The cheapest form that fits and whose link costs at most `budget` of the step (module docstring); the
    fitting form with the cheapest link when none is within; None when no form fits."""
    candidates = [synchronous(cfg, est, cluster, training, spec)]
    for every in CANDIDATE_H:
        for f in (f for f in (1, 2, 4, 8, 16, 32) if f <= min(cfg.num_layers, every)):
            # an overlapped fragment's last T inner steps give way to the global parameters: T/H of its
            # progress, so overlap only from H = OVERLAP_FROM on
            for t in (0, 1) if every >= OVERLAP_FROM and every // f > 1 else (0,):
                candidates.append(diloco(cfg, est, cluster, training, spec, every, f, t, spec.dtype))
    fitting = [e for e in candidates if e.fits]
    within = [e for e in fitting if e.link_share <= budget]
    return within[0] if within else min(fitting, key=lambda e: e.link_share, default=None)


def replica_estimates(cfg: ModelConfig, est: Estimate, cluster: ClusterSpec, training: TrainingSpec,
                      spec: ReplicaSpec) -> list[SyncEstimate]:
    """Synchronous, the DiLoCo form asked for (spec.sync_every > 1), and the recommendation (last; absent when no
    form fits)."""
    out = [synchronous(cfg, est, cluster, training, spec)]
    if spec.sync_every > 1:
        out.append(diloco(cfg, est, cluster, training, spec, spec.sync_every, spec.fragments, spec.overlap,
                          spec.dtype))
    best = recommend(cfg, est, cluster, training, spec)
    return out + ([best] if best is not None else [])


def plan_replicas(cfg: ModelConfig, fitting: list[Estimate], cluster: ClusterSpec, training: TrainingSpec,
                  spec: ReplicaSpec) -> tuple[Estimate, list[SyncEstimate]]:
    """(layout of one replica, its forms): the fastest of the `fitting` layouts (fastest first) with a form that fits
    beside it within the link budget; failing that, the layout whose fitting form trains fastest; failing that
    (no layout has room for any form), the fastest layout, with no recommendation."""
    best = None
    for est in fitting:
        rec = recommend(cfg, est, cluster, training, spec)
        if rec is not None and rec.link_share <= BUDGET:
            return est, replica_estimates(cfg, est, cluster, training, spec)
        if rec is not None and (best is None or rec.tokens_per_s > best[1].tokens_per_s):
            best = est, rec
    est = best[0] if best else fitting[0]
    return est, replica_estimates(cfg, est, cluster, training, spec)


def table(cfg: ModelConfig, est: Estimate, rows: list[SyncEstimate], spec: ReplicaSpec, rank: int = 1) -> str:
    """The forms (the last one recommended when it fits) and the recommendation's line; `rank`: est's place among
    the fitting layouts (plan_replicas may pass over faster ones that leave no room)."""
    lay, recommended = est.layout, bool(rows) and rows[-1].fits and (len(rows) > 1 + (spec.sync_every > 1))
    lines = [f"across {spec.replicas} replicas over {spec.link_gbps:g} Gbit/s per rank (+{spec.latency_ms:g} ms), "
             f"each replica as layout #{rank} ({lay.label()}, {est.memory.total / GIB:.1f} GiB, step "
             f"{est.time.total:.2f} s; --dp {lay.dp * spec.replicas} --replicas {spec.replicas} in all)" + (":" if rank == 1 else f": the faster ones leave no room beside them "
                                           f"for a form within the link budget")]
    cols = ["form", "H", "F", "T", "dtype", "MB/step across", "link s/step", "step s", "tokens/s", "link share",
            "+GiB"]
    body = [[r.form + (" (recommended)" if recommended and i == len(rows) - 1 else ""), str(r.sync_every),
             str(r.fragments),
             str(r.overlap), r.dtype, f"{r.bytes_per_step / 1e6:,.1f}", f"{r.link_s:.3f}", f"{r.step_s:.3f}",
             f"{r.tokens_per_s:,.0f}", f"{100 * r.link_share:.1f}%", f"{r.extra_gib:.2f}" + ("" if r.fits else " !")]
            for i, r in enumerate(rows)]
    widths = [max(len(x[c]) for x in [cols] + body) for c in range(len(cols))]
    lines += ["  ".join(c.ljust(w) if j == 0 else c.rjust(w) for j, (c, w) in enumerate(zip(x, widths)))
              for x in [cols] + body]
    if not recommended:
        lines.append(f"recommended: none: no form fits in memory beside any fitting layout of one replica (! marks "
                     f"what does not fit: a higher --zero shards the outer state, more GPUs leave room for it)")
        return "\n".join(lines)
    best = rows[-1]
    verdict = "within" if best.link_share <= BUDGET else "above (no candidate that fits is within)"
    lines.append(f"recommended: --replicas {spec.replicas} {best.flags()}  (the link {100 * best.link_share:.1f}% of "
                 f"the step, {verdict} {100 * BUDGET:g}%)")
    return "\n".join(lines)
