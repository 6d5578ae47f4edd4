"""The search over layouts: every layout tpzoo can run on a cluster, estimated and ranked (plan/estimate.py)."""
from __future__ import annotations

from tpzoo.errors import ConfigError
from tpzoo.models.config import ModelConfig
from tpzoo.parallel.dims import ParallelLayoutError

from .balance import layers_differ, time_balanced_boundaries
from .estimate import Estimate, estimate
from .layers import has_experts
from .spec import RECOMPUTE, ClusterSpec, Layout, TrainingSpec, check_layout


def _divisors(n: int) -> list[int]:
    return [k for k in range(1, n + 1) if n % k == 0]


LONG_SEQ = 16384  # from this sequence length on, the search also tries context parallelism
BAR_FROM = 200  # estimates from which search(progress=True) draws a bar


def enumerate_layouts(cfg: ModelConfig, cluster: ClusterSpec, training: TrainingSpec, max_micro_batch: int = 64,
                      tp: int | None = None, pp: int | None = None, recompute: str | None = None,
                      max_virtual_stages: int = 8, cp: int | None = None, ep: int | None = None,
                      boundaries: tuple | None = None, keep=None) -> list[Layout]:
    """Every layout tpzoo can run on this cluster (check_layout passes): tp within a node, pp <= layers, dp
    the rest; micro-batch sizes dividing the per-replica batch; recompute none/selective/full; sequence
    parallelism with tp > 1; 1F1B, zero-bubble, and interleaved with 2 <= v <= max_virtual_stages chunks per
    stage (pp * v <= layers; tpzoo splits unevenly when they do not divide); context parallelism (powers of two)
    for sequences of LONG_SEQ tokens or more; for a mixture of experts expert parallelism ep (the divisors of
    num_experts that divide dp * cp). `tp`, `pp`, `recompute`, `cp`, `ep` restrict the search to one value;
    `boundaries` (--pp-boundaries) fixes the split and the pp * v it implies. A pipeline layout of a model whose
    layers differ is also tried with its time-balanced split (plan/balance.py) where that differs from the
    default. `keep(layout)` False leaves a layout out (before its time-balanced twin is worked out)."""
    out = []
    split = differ = None
    if boundaries is not None:
        split = check_boundaries(cfg, boundaries)
    else:
        differ = layers_differ(cfg)
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
            if split is not None:
                scheds = [(s, v) for s, v in scheds if pp * v == len(split) - 1]
            for mbs in _divisors(training.global_batch_size // dp):
                if mbs > max_micro_batch:
                    break
                for rec in (RECOMPUTE if recompute is None else (recompute,)):
                    for sp in ((False, True) if tp > 1 else (False,)):
                        for (sched, v), e in ((sv, e) for sv in scheds for e in eps):
                            lay = Layout(tp, pp, dp, mbs, rec, sp, sched, v, cp, e, split)
                            try:
                                check_layout(cfg, lay, cluster, training)
                            except ParallelLayoutError:
                                continue
                            if keep is not None and not keep(lay):
                                continue
                            out.append(lay)
                            if differ and pp > 1:
                                cuts = time_balanced_boundaries(cfg, lay, training)
                                if cuts != default_boundaries(cfg, lay):
                                    out.append(lay.replace(boundaries=cuts))
    return out


def check_boundaries(cfg: ModelConfig, boundaries) -> tuple[int, ...]:
    """--pp-boundaries as a tuple, checked against the model in one line (tpzoo.pipeline's PartitionError)."""
    from tpzoo.pipeline.partition import PartitionError, check_boundaries

    b = tuple(boundaries)
    try:
        check_boundaries(list(b), cfg.num_layers, max(len(b) - 1, 1))
    except PartitionError as exc:
        raise ConfigError(f"--pp-boundaries: {exc}") from None
    return b


def default_boundaries(cfg: ModelConfig, layout: Layout) -> tuple[int, ...]:
    from .spec import chunk_layer_ranges

    return tuple(a for a, _ in chunk_layer_ranges(cfg, layout.replace(boundaries=None))) + (cfg.num_layers,)


class Estimates(list):
    """search()'s estimates (a list), with what the search left out: `considered` valid layouts in all, `ruled_out`
    of them not estimated because their memory floor (plan/bound.py) is over the GPU's memory."""
    considered: int = 0
    ruled_out: int = 0


def search(cfg: ModelConfig, cluster: ClusterSpec, training: TrainingSpec, max_micro_batch: int = 64,
           progress: bool = False, **only) -> Estimates:
    """Every valid layout (enumerate_layouts; `only`: tp=, pp=, recompute=, cp=, ep=, boundaries=), estimated: the
    ones that fit first, fastest first; then the rest, fastest first. A layout whose memory floor (plan/bound.py:
    the average stage's training state and one micro-batch's activations) is over the GPU's memory cannot fit and
    is not estimated, except, for each (tp, cp, pp, dp, ep) none of whose layouts is left, its lowest-floor one (the
    table says why it does not fit). `progress`: a bar on stderr. A fixed ep that the model cannot take (ep not
    dividing its experts, ep > 1 for a dense model), or boundaries whose stages no pp * v of a fixed pp gives, is
    one ConfigError line; so is --lora-experts on a dense model."""
    if training.lora_experts and not has_experts(cfg):
        raise ConfigError(f"--lora-experts: {cfg.name or cfg.family} has no routed experts (a dense model); drop "
                          f"--lora-experts")
    ep = only.get("ep")
    if ep is not None and (ep < 1 or (cfg.num_experts or 1) % ep or (ep > 1 and not has_experts(cfg))):
        raise ConfigError(f"--ep {ep}: " + (f"does not divide num_experts={cfg.num_experts}" if cfg.num_experts
                                            else "the model has no experts (ep needs a mixture of experts)"))
    cuts, pp = only.get("boundaries"), only.get("pp")
    if cuts is not None and pp and (len(cuts) - 1) % pp:
        raise ConfigError(f"--pp-boundaries gives {len(cuts) - 1} model stages: not pp * virtual stages for "
                          f"--pp {pp}")
    floors = LayoutFloors(cfg, training, cluster)
    layouts = enumerate_layouts(cfg, cluster, training, max_micro_batch, keep=floors.keep, **only)
    layouts += floors.representatives({_group(lay) for lay in layouts})
    from tpzoo.progress import progress_bar

    with progress_bar(progress and len(layouts) >= BAR_FROM, total=len(layouts), desc="tpzoo plan", unit=" layouts",
                      leave=False) as bar:
        ests = []
        for lay in layouts:
            ests.append(estimate(cfg, lay, cluster, training))
            bar.update()
    out = Estimates(sorted(ests, key=lambda est: (not est.fits, est.time.total, est.memory.total)))
    out.considered, out.ruled_out = len(layouts) - len(floors.ruled) + floors.count, floors.count
    return out


def _group(lay: Layout) -> tuple:
    return lay.tp, lay.cp, lay.pp, lay.dp, lay.ep


class LayoutFloors:
    """The memory floor of each layout the enumeration offers (computed once per what it depends on), and the
    layouts left out for it: their number, and per (tp, cp, pp, dp, ep) the one with the lowest floor."""

    def __init__(self, cfg: ModelConfig, training: TrainingSpec, cluster: ClusterSpec):
        from .estimate import GIB

        self.cfg, self.training = cfg, training
        self.limit, self.reserve = cluster.gpu_memory_gib * GIB, cluster.reserve_gib * GIB
        self.states, self.acts, self.ruled, self.count = {}, {}, {}, 0

    def floor(self, lay: Layout) -> float:
        from .bound import activation_floor, state_floor

        group = _group(lay)
        if group not in self.states:
            self.states[group] = state_floor(self.cfg, lay, self.training)
        key = (lay.tp, lay.cp, lay.pp, lay.ep, lay.micro_batch_size, lay.recompute, lay.sequence_parallel)
        if key not in self.acts:
            self.acts[key] = activation_floor(self.cfg, lay, self.training)
        return self.states[group] + self.acts[key] + self.reserve

    def keep(self, lay: Layout) -> bool:
        f = self.floor(lay)
        if f <= self.limit:
            return True
        self.count += 1
        group = _group(lay)
        if group not in self.ruled or f < self.ruled[group][0]:
            self.ruled[group] = (f, lay)
        return False

    def representatives(self, kept_groups: set) -> list[Layout]:
        """The lowest-floor layout of each group none of whose layouts was kept (to say why it does not fit)."""
        reps = [lay for group, (_, lay) in self.ruled.items() if group not in kept_groups]
        self.ruled = {group: v for group, v in self.ruled.items() if group not in kept_groups}
        return reps
