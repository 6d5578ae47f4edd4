"""Training across slow links: replicas, the hierarchical synchronous reduction, DiLoCo and Streaming DiLoCo.

`--replicas K` splits the data-parallel ranks into K replicas of dp/K consecutive dp ranks (whole model copies,
tpzoo.parallel.dims); inside a replica everything works as without (tp, sp, cp, pp, ep, ZeRO 0-3, overlap), its
gradients summed and ZeRO-sharded over its own dp x cp ranks (`replica_dp`). What crosses replicas:

- `--sync-every 1` (synchronous): every step's reduced gradients are summed over the replicas hierarchically
  (tpzoo.parallel.data_parallel: reduce-scatter inside, all-reduce of each rank's shard across, all-gather inside),
  so a rank sends 1 / (dp/K) of the gradient over the slow link; the result equals flat data parallelism.
- `--sync-every H > 1` (DiLoCo, Douillard et al. 2023): each replica takes H inner AdamW steps alone (its own
  batches, its gradients scaled by its own tokens, its own norm and clipping); then the outer gradient, global
  parameters minus the replica's, is averaged over the replicas (`cross_replica` only; under ZeRO each rank sends
  its owned segments) and applied to the global parameters by Nesterov SGD in fp32 (`--outer-lr`,
  `--outer-momentum`; torch.optim.SGD(nesterov=True)'s arithmetic), and every replica continues from the new
  global parameters with its inner AdamW state kept. Only trained parameters take part (LoRA: the adapters).
- Streaming DiLoCo (Douillard et al. 2025; torchft's DiLoCo): `--sync-fragments F` puts the layers in F strided
  fragments (layer i in fragment i % F; embeddings, final norm and head in fragment 0), fragment f applied after
  the steps t with t = floor((f + 1) H / F) (mod H); `--sync-overlap T` starts its exchange T steps earlier and
  waits for it T inner steps later (the exchange in flight meanwhile: asynchronous through comm's handles, carried
  across the steps in strict mode); the local progress of those T steps on the fragment is replaced by the new
  global parameters (torchft's default mixing, alpha = 0). `--sync-dtype bf16|fp8`: the outer gradients cross in
  low precision and are summed in fp32 (tpzoo.parallel.replica_exchange).

Per step nothing else crosses the replicas under DiLoCo: the reported loss, the token count that scales the
gradients, the norm and the held-out loss are each replica's own (rank 0 reports replica 0's). The step's
`sync_bytes` (sent across replicas by this rank, comm's counters) and `sync_s` (seconds blocked on it) go into the
metrics; `--emulate-link GBPS[:LATENCY_MS]` makes every collective across replicas last at least bytes /
bandwidth + latency (tpzoo.parallel.comm.emulate_link). Checkpoints: tpzoo.train.diloco_state.
"""
from __future__ import annotations

import os
import re
from dataclasses import dataclass, field

import torch

from tpzoo.errors import ConfigError
from tpzoo.parallel import comm, strict
from tpzoo.parallel.replica_exchange import Exchange

from .config_values import parse_link

LINK_ENV = "TPZOO_EMULATE_LINK"
KILL_ENV = "TPZOO_TEST_KILL_DURING_SYNC"  # testing aid: "RANK:N" SIGKILLs that rank inside its N-th exchange
_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")


def diloco(cfg) -> bool:
    """Whether the replicas train alone between syncs."""
    return cfg.sync_every > 1


def optimizer_groups(cfg, dims) -> dict:
    """The DistributedAdamW / ExpertParallelAdamW keywords of a run with replicas: gradients summed and sharded
    inside the replica; synchronous: also summed across the replicas; the norm over the replica's ranks (its
    reduced gradients are every replica's, or its own)."""
    if dims.replicas == 1:
        return {}
    kw = {"group": "replica_dp", "norm_group": "replica",
          "cross_group": None if diloco(cfg) else "cross_replica"}
    if dims.ep > 1:
        kw["expert_group"] = "replica_edp"
    return kw


def loss_group(cfg, dims):
    """Where the step's token count, loss and held-out loss are summed: the replica's own ranks under DiLoCo."""
    return dims.group("replica_dp") if diloco(cfg) and dims.replicas > 1 else dims.grad_group


def eval_share(cfg, dims) -> tuple[int, int]:
    """(rank, ranks) the held-out sequences are split over (tpzoo.train.heldout): under DiLoCo a replica's own dp
    ranks evaluate all of them (its model's held-out loss on the set every layout evaluates)."""
    if diloco(cfg) and dims.replicas > 1:
        per = dims.dp // dims.replicas
        return dims.dp_rank % per, per
    return dims.dp_rank, dims.dp


# Groups whose ranks may sit in different replicas: what crosses the slow link. Besides cross_replica, the
# synchronous form sums its token counts and loss over dp_cp every step; DiLoCo issues nothing else per step.
SPANNING = ("cross_replica", "dp_cp", "dp", "edp", "world")


def _spanning_groups(dims) -> dict:
    """{counter name: group} of the groups that cross replicas (none with one replica). The world is both the
    default group object and None (comm's name for it)."""
    if dims.replicas == 1:
        return {}
    import torch.distributed as dist

    out = {name: dims.group(name) for name in SPANNING[:-1] if name in dims.groups and dims.group_size(name) > 1}
    out["world"] = dist.group.WORLD
    return out


def fragment_of(name: str, fragments: int) -> int:
    """A parameter's fragment: its layer's index modulo F (strided); outside the blocks, fragment 0."""
    m = _LAYER.search(name)
    return int(m.group(1)) % fragments if m else 0


@dataclass
class Fragment:
    index: int
    offset: int                                     # applied after the steps t with t % H == offset % H
    runs: list = field(default_factory=list)        # (part, owned start, owned end, flat start)


def _fragments(parts, chunks, count: int, every: int) -> list[Fragment]:
    """Every fragment's runs of owned positions (merged where contiguous), over the optimizer parts."""
    names = {id(p): n for c in chunks for n, p in c.named_parameters()}
    frags = [Fragment(f, (f + 1) * every // count) for f in range(count)]
    for i, part in enumerate(parts):
        for lo, hi, pos in part.owned:
            for p, o in zip(part.params, part.offsets):
                a, b = max(o, lo), min(o + p.numel(), hi)
                if a >= b:
                    continue
                runs = frags[fragment_of(names[id(p)], count)].runs
                start = pos + a - lo
                if runs and runs[-1][0] == i and runs[-1][2] == start and runs[-1][3] + start - runs[-1][1] == a:
                    runs[-1] = (i, runs[-1][1], pos + b - lo, runs[-1][3])
                else:
                    runs.append((i, start, pos + b - lo, a))
    return frags


class ReplicaSync:
    """What a run with replicas or DiLoCo adds to the loop: the cross-replica bytes and seconds of every step
    (`after_step`), and under DiLoCo the outer optimizer (its global parameters and Nesterov momentum over the
    optimizer's owned segments, fp32) on its fragments' schedule."""

    def __init__(self, cfg, dims, optimizer, chunks):
        if diloco(cfg) and cfg.sync_fragments > chunks[0].cfg.num_layers:  # (preflight says it first)
            raise ConfigError(f"sync_fragments={cfg.sync_fragments} is more than the model's "
                              f"{chunks[0].cfg.num_layers} layers")
        self.cfg, self.dims, self.optimizer = cfg, dims, optimizer
        self.parts = getattr(optimizer, "parts", (optimizer,))
        self.every, self.overlap, self.dtype = cfg.sync_every, cfg.sync_overlap, cfg.sync_dtype
        self.lr, self.momentum = cfg.outer_lr, cfg.outer_momentum
        self.cross = dims.group("cross_replica")
        self.link = parse_link(cfg.emulate_link or os.environ.get(LINK_ENV, ""),
                               "emulate_link" if cfg.emulate_link else LINK_ENV)
        self.spanning = _spanning_groups(dims)
        if self.link:
            for group in self.spanning.values():
                comm.emulate_link(group, *self.link)
        self.counter_cm = comm.count_collectives()
        self.counter = self.counter_cm.__enter__()  # the whole run's; after_step reports each step's share
        self.seen = (0.0, 0.0)
        self.fragments: list[Fragment] = []
        self.in_flight: dict[int, Exchange] = {}  # fragment -> its exchange, in start order
        self.ready: dict[int, torch.Tensor] = {}  # fragment -> its mean outer gradient, received, not applied
        self.syncs = 0
        if diloco(cfg):
            self.fragments = _fragments(self.parts, chunks, cfg.sync_fragments, self.every)
            self.global_ = [self._owned_master(i) for i in range(len(self.parts))]
            self.velocity = [torch.zeros_like(g) for g in self.global_]

    @classmethod
    def create(cls, cfg, dims, optimizer, chunks) -> "ReplicaSync | None":
        """None for a run without replicas or DiLoCo."""
        if dims.replicas == 1 and not diloco(cfg):
            return None
        return cls(cfg, dims, optimizer, chunks)

    def describe(self) -> str:
        link = f" | emulated link {self.link[0]:g} Gbit/s + {self.link[1]:g} ms" if self.link else ""
        if not diloco(self.cfg):
            return f"replicas: {self.dims.replicas}, gradients summed across them every step{link}"
        stream = (f", {len(self.fragments)} fragments, overlap {self.overlap}" if len(self.fragments) > 1
                  or self.overlap else "")
        return (f"replicas: {self.dims.replicas}, DiLoCo every {self.every} steps{stream}, outer Nesterov lr "
                f"{self.lr:g} momentum {self.momentum:g}, outer gradients in {self.dtype}{link}")

    # -- the outer optimizer's state ----------------------------------------------------------------------
    def _owned_master(self, i: int) -> torch.Tensor:
        """Part i's fp32 master weights over its owned vector (the global parameters at the start)."""
        part = self.parts[i]
        out = torch.zeros(part.exp_avg.numel(), dtype=torch.float32, device=part.device)
        for lo, hi, pos in part.owned:
            out[pos:pos + hi - lo] = part.master_range(pos, pos + hi - lo, lo)
        return out

    def _runs(self, f: Fragment, tensors):
        return [tensors[i][a:b] for i, a, b, _ in f.runs]

    def _masters(self, f: Fragment):
        return [self.parts[i].master_range(a, b, flat) for i, a, b, flat in f.runs]

    # -- one step -----------------------------------------------------------------------------------------
    def after_step(self, step: int) -> dict:
        """After the inner optimizer step `step` (taken or skipped: the schedule follows the step number): apply
        the fragments due (their exchanges waited), start those due; then this step's sync_bytes and sync_s."""
        if self.fragments:
            h = self.every
            due = [f for f in self.fragments if step % h == f.offset % h]
            for f in due:
                if f.index in self.in_flight or f.index in self.ready:
                    self._apply(f)
            for f in self.fragments:
                if (step + self.overlap) % h == f.offset % h:
                    self._start(f)
            for f in due:
                if f.index in self.in_flight or f.index in self.ready:  # no overlap: started just now
                    self._apply(f)
        across = [s for (_, g), s in self.counter.stats.items() if g in self.spanning]
        sent, secs = sum(s.sent_bytes for s in across), sum(s.seconds for s in across)
        out = {"sync_bytes": int(round(sent - self.seen[0])), "sync_s": secs - self.seen[1]}
        self.seen = (sent, secs)
        return out

    def _start(self, f: Fragment) -> None:
        """The fragment's outer gradient (global minus this replica's parameters, fp32), sent to be averaged."""
        if not f.runs:
            # nothing of it on this rank, nor on its peers across replicas (the same coordinates); its apply still
            # publishes (collective inside the replica, where other ranks may own some of it)
            self.ready[f.index] = torch.zeros(0, device=self.dims.device)
            return
        delta = torch.cat(torch._foreach_sub(self._runs(f, self.global_), self._masters(f)))
        ex = Exchange(delta, self.cross, self.dtype)
        strict.carry(ex.pending)  # waited T steps later (or at once without overlap, or at a save)
        self.in_flight[f.index] = ex
        self.syncs += 1
        _maybe_die_for_test(self.syncs)

    def settle(self) -> None:
        """Wait for the exchanges in flight (before a checkpoint, at the end): their means are kept until their
        fragment's step applies them."""
        for index in list(self.in_flight):
            self.ready[index] = self.in_flight.pop(index).wait()

    def _apply(self, f: Fragment) -> None:
        """Outer Nesterov SGD on the fragment's global parameters with the mean outer gradient; every replica
        continues from the result (its masters set to it, the weights published inside the replica)."""
        ex = self.in_flight.pop(f.index, None)
        mean = ex.wait() if ex is not None else self.ready.pop(f.index)
        if f.runs:
            grads = list(torch.split(mean, [b - a for _, a, b, _ in f.runs]))
            velocity, params = self._runs(f, self.velocity), self._runs(f, self.global_)
            mu = self.momentum
            # torch.optim.SGD(momentum=mu, nesterov=True), foreach: buf = mu buf + g; g += mu buf; p -= lr g
            torch._foreach_mul_(velocity, mu)
            torch._foreach_add_(velocity, grads)
            torch._foreach_add_(grads, velocity, alpha=mu)
            torch._foreach_add_(params, grads, alpha=-self.lr)
            torch._foreach_copy_(self._masters(f), params)
        for part in self.parts:  # collective inside the replica: every rank, runs or none
            part.publish()

    def close(self) -> None:
        """The end of the run: nothing left in flight, the counter and the emulated link gone."""
        self.settle()
        if self.counter_cm is not None:
            self.counter_cm.__exit__(None, None, None)
            self.counter_cm = None
        for group in self.spanning.values() if self.link else ():
            comm.emulate_link(group, None)


def _maybe_die_for_test(n: int) -> None:
    spec = os.environ.get(KILL_ENV)
    if spec:
        rank, _, at = spec.partition(":")
        if int(os.environ.get("RANK", "-1")) == int(rank) and n == int(at):
            import signal

            os.kill(os.getpid(), signal.SIGKILL)
