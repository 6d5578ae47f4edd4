"""ParallelDims: the parallel layout of one rank, passed to everything that needs it.

One small object holds the degrees (tp, cp, dp, pp, and ep for the experts), this rank's coordinates, its process groups and
the device this rank computes on. Models, layers, schedules, the executor and the trainer take it explicitly
(torchtitan's ParallelDims, Megatron's explicit tp_group); `tpzoo.init_parallel()` builds the real one and also
makes it the default for the simple public API (`ColumnParallelLinear(512, 2048)` without dims).

Megatron's rank order: tensor parallel varies fastest, then context parallel, then data parallel, then pipeline
parallel: rank = tp_rank + tp * (cp_rank + cp * (dp_rank + dp * pp_rank)), so the ranks of one tensor-parallel
group are neighbours (on one node, where the bandwidth is).

Expert parallelism (Megatron-Core's layout) is carved out of the data x context parallel ranks: the dp x cp
ranks that share a (tp, pp) coordinate are numbered j = cp_rank + cp * dp_rank, and split into consecutive groups of
ep: ep_rank = j % ep (the "ep" group: ranks that exchange tokens and each hold E / ep experts), edp_rank = j // ep
(the "edp" group, expert-data-parallel: ranks holding the same experts, where expert gradients are summed). Expert
tensor parallelism etp equals tp (each expert's matrices split over the tp group like the dense MLP's), so the
expert groups never cross a tp coordinate.

Replicas (DiLoCo, hierarchical data parallelism; tpzoo.train.diloco) split the dp ranks into `replicas` groups of
dp / replicas consecutive dp ranks: replica = dp_rank // (dp / replicas), every tp, cp and pp rank of those dp
ranks (whole model copies: whole nodes, or a whole cluster). With replicas > 1 four more groups exist, created
after all the others: `replica` (every rank of one replica), `replica_dp` (the dp x cp ranks of one replica at one
(tp, pp) coordinate: where a replica sums, and ZeRO-shards, its gradients; cp fastest as in dp_cp),
`cross_replica` (the ranks at the same coordinates in each replica: the slow link) and, with ep > 1,
`replica_edp` (the ranks of replica_dp holding the same experts). ep must divide the dp x cp ranks of one
replica, so token exchanges never cross replicas.

`ParallelDims.virtual(tp=4, pp=2, tp_rank=1, pp_rank=0)` describes one rank of a layout without any process
group, to build that rank's part of a model on the meta device in one process (checkpoint conversion, the plan
advisor, tests): sizes and coordinates answer, and asking for a group of size > 1 raises.
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass, field

import torch

from tpzoo.errors import UserError

AXES = ("tp", "cp", "dp", "pp")  # fastest first


class ParallelLayoutError(UserError, ValueError):
    """A parallel layout that cannot work (degrees that do not divide, a world size that does not match)."""


class _SelfGroup:
    """The group of one process: every collective over it is the identity. Stands for any group of size 1, so
    single-rank code needs neither torch.distributed nor a special case at each call."""

    def __repr__(self) -> str:
        return "SELF_GROUP"


SELF_GROUP = _SelfGroup()


def divide(numerator: int, denominator: int, what: str = "value") -> int:
    """numerator / denominator, or a clear error when it does not divide evenly."""
    if denominator <= 0 or numerator % denominator != 0:
        raise ParallelLayoutError(f"{what}: {numerator} is not divisible by {denominator}")
    return numerator // denominator


def check_layout(world_size: int, tp: int = 1, pp: int = 1, cp: int = 1, dp: int | None = None, ep: int = 1,
                 replicas: int = 1) -> int:
    """Validate degrees against a world size and return dp (inferred when None)."""
    for name, value in (("tp", tp), ("pp", pp), ("cp", cp), ("ep", ep), ("replicas", replicas)):
        if not isinstance(value, int) or value < 1:
            raise ParallelLayoutError(f"{name} must be a positive integer, got {value!r}")
    model_parallel = tp * pp * cp
    if world_size % model_parallel != 0:
        raise ParallelLayoutError(
            f"world size {world_size} is not divisible by tp*pp*cp = {tp}*{pp}*{cp} = {model_parallel}")
    inferred = world_size // model_parallel
    if dp is not None and dp != inferred:
        raise ParallelLayoutError(
            f"tp*pp*cp*dp = {tp}*{pp}*{cp}*{dp} = {model_parallel * dp} does not equal world size {world_size}")
    check_expert_layout(inferred, cp, ep, replicas)
    return inferred


def check_expert_layout(dp: int, cp: int, ep: int, replicas: int = 1) -> None:
    """ep is carved out of the data x context parallel ranks (of one replica): it must divide dp * cp / replicas;
    replicas must divide dp."""
    if dp % replicas:
        raise ParallelLayoutError(f"replicas={replicas} does not divide dp={dp} (a replica is dp/replicas whole "
                                  f"data-parallel ranks)")
    if (dp * cp // replicas) % ep:
        within, of = ((f" / replicas = {dp * cp // replicas}", " of one replica") if replicas > 1
                      else (f" = {dp * cp}", ""))
        raise ParallelLayoutError(f"ep={ep} does not divide dp*cp = {dp}*{cp}{within} (expert parallelism is "
                                  f"carved out of the data/context-parallel ranks{of})")


# Groups every rank creates, by name -> the coordinates that vary within one group.
GROUP_AXES = {"tp": ("tp",), "cp": ("cp",), "dp": ("dp",), "pp": ("pp",), "dp_cp": ("dp", "cp"),
              "mp": ("tp", "pp")}


P2P_PREFIX = "pp>"


def _p2p_name(src: int, dst: int) -> str:
    return f"{P2P_PREFIX}{src}>{dst}"


@dataclass(eq=False)
class ParallelDims:
    tp: int = 1
    pp: int = 1
    cp: int = 1
    dp: int = 1
    rank: int = 0
    world_size: int = 1
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    groups: dict = field(default_factory=dict)       # name -> this rank's ProcessGroup (real dims only)
    group_ranks: dict = field(default_factory=dict)  # name -> the global ranks of this rank's group
    ep: int = 1                                      # expert parallelism (carved out of dp x cp; see module doc)
    virtual: bool = False                            # True: no process groups (see module docstring)
    owns_default_group: bool = False                 # init_parallel created torch.distributed's default group
    replicas: int = 1                                # dp split into replicas of dp/replicas dp ranks (module doc)

    def __post_init__(self):
        self.device = torch.device(self.device)
        for name in ("ep", "replicas"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
                raise ParallelLayoutError(f"{name} must be a positive integer, got {getattr(self, name)!r}")
        check_expert_layout(self.dp, self.cp, self.ep, self.replicas)

    @property
    def etp(self) -> int:
        """Expert tensor parallelism: each expert's matrices are split over the tp group (etp = tp)."""
        return self.tp

    # -- construction ---------------------------------------------------------------------------------------
    @classmethod
    def for_rank(cls, tp: int = 1, pp: int = 1, cp: int = 1, dp: int = 1, *, tp_rank: int = 0, pp_rank: int = 0,
                 cp_rank: int = 0, dp_rank: int = 0, device="meta", ep: int = 1, replicas: int = 1) -> "ParallelDims":
        """One rank of a layout, with no process group: for building that rank's model part in one process."""
        for name, size, r in (("tp", tp, tp_rank), ("pp", pp, pp_rank), ("cp", cp, cp_rank), ("dp", dp, dp_rank)):
            if not 0 <= r < size:
                raise ParallelLayoutError(f"{name} rank {r} is outside a {name} size of {size}")
        dims = cls(tp=tp, pp=pp, cp=cp, dp=dp, ep=ep, world_size=tp * pp * cp * dp, device=device, virtual=True,
                   replicas=replicas)
        dims.rank = dims.rank_of(tp=tp_rank, cp=cp_rank, dp=dp_rank, pp=pp_rank)
        dims.group_ranks = {name: ranks for name, ranks in dims.enumerate_groups() if dims.rank in ranks}
        return dims

    def sizes(self) -> dict:
        return {"tp": self.tp, "cp": self.cp, "dp": self.dp, "pp": self.pp}

    def rank_of(self, tp: int = 0, cp: int = 0, dp: int = 0, pp: int = 0) -> int:
        return tp + self.tp * (cp + self.cp * (dp + self.dp * pp))

    def coords(self, rank: int | None = None) -> dict:
        r = self.rank if rank is None else rank
        return {"tp": r % self.tp, "cp": (r // self.tp) % self.cp, "dp": (r // (self.tp * self.cp)) % self.dp,
                "pp": r // (self.tp * self.cp * self.dp)}

    def enumerate_groups(self) -> list[tuple[str, list[int]]]:
        """(name, sorted ranks) of every group of every name, in the order each rank must create them (group
        creation is collective over the world): tp, cp, dp, pp, dp_cp, mp, then the embedding groups (first and
        last stage of each pipeline: they hold the tied input/output embeddings), then the pipeline's
        point-to-point channels (`p2p_group`)."""
        out = []
        for name, varying in GROUP_AXES.items():
            out += [(name, ranks) for ranks in self._groups_varying(varying)]
        for ranks in self._groups_varying(("pp",)):
            out.append(("embedding", sorted({ranks[0], ranks[-1]})))
        if self.pp > 1:
            for ranks in self._groups_varying(("pp",)):  # (pp is the slowest axis: sorted ranks are in pp order)
                p = len(ranks)
                pairs = {pair for i in range(p) for pair in ((ranks[i], ranks[(i + 1) % p]),
                                                              (ranks[(i + 1) % p], ranks[i]))}
                out += [(_p2p_name(a, b), sorted((a, b))) for a, b in sorted(pairs)]
        if self.ep > 1:  # only then: layouts without experts create exactly the groups they always did
            for dp_cp in self._groups_varying(("dp", "cp")):
                ordered = sorted(dp_cp, key=lambda r: self.coords(r)["cp"] + self.cp * self.coords(r)["dp"])
                n = len(ordered) // self.ep
                out += [("ep", sorted(ordered[i * self.ep:(i + 1) * self.ep])) for i in range(n)]
                out += [("edp", sorted(ordered[i::self.ep])) for i in range(self.ep)]
        if self.replicas > 1:  # only then: layouts without replicas create exactly the groups they always did
            out += self._replica_groups()
        return out

    def _replica_groups(self) -> list[tuple[str, list[int]]]:
        """replica, replica_dp, cross_replica (and replica_edp with ep > 1), in that order (module docstring)."""
        per = self.dp // self.replicas
        ranks = range(self.world_size)
        out = [("replica", [r for r in ranks if self.coords(r)["dp"] // per == k]) for k in range(self.replicas)]
        for tp, pp in itertools.product(range(self.tp), range(self.pp)):
            for k in range(self.replicas):
                out.append(("replica_dp", [self.rank_of(tp, cp, dp, pp) for dp in range(k * per, (k + 1) * per)
                                           for cp in range(self.cp)]))
        for tp, cp, dp, pp in itertools.product(range(self.tp), range(self.cp), range(per), range(self.pp)):
            out.append(("cross_replica", [self.rank_of(tp, cp, dp + k * per, pp) for k in range(self.replicas)]))
        if self.ep > 1:
            for name, members in [g for g in out if g[0] == "replica_dp"]:
                out += [("replica_edp", members[i::self.ep]) for i in range(self.ep)]
        return [(name, sorted(members)) for name, members in out]

    def _groups_varying(self, varying: tuple) -> list[list[int]]:
        sizes = self.sizes()
        fixed = [k for k in AXES if k not in varying]
        groups = []
        for fixed_vals in itertools.product(*(range(sizes[k]) for k in fixed)):
            base = dict(zip(fixed, fixed_vals))
            members = [self.rank_of(**{**base, **dict(zip(varying, vals))})
                       for vals in itertools.product(*(range(sizes[k]) for k in varying))]
            groups.append(sorted(members))
        return groups

    # -- coordinates ----------------------------------------------------------------------------------------
    @property
    def tp_rank(self) -> int:
        return self.rank % self.tp

    @property
    def cp_rank(self) -> int:
        return self.coords()["cp"]

    @property
    def dp_rank(self) -> int:
        return self.coords()["dp"]

    @property
    def pp_rank(self) -> int:
        return self.coords()["pp"]

    @property
    def dp_cp_rank(self) -> int:
        """Position in the data x context parallel group (the gradient-reduction group; cp varies fastest)."""
        return self.cp_rank + self.cp * self.dp_rank

    @property
    def ep_rank(self) -> int:
        """Position in the expert-parallel group: this rank holds experts [ep_rank * E/ep, (ep_rank + 1) * E/ep)."""
        return self.dp_cp_rank % self.ep

    @property
    def edp_rank(self) -> int:
        """Position in the expert-data-parallel group (the ranks holding the same experts)."""
        return self.dp_cp_rank // self.ep

    @property
    def replica(self) -> int:
        """Which replica this rank belongs to (0 without replicas)."""
        return self.dp_rank // (self.dp // self.replicas)

    @property
    def replica_dp_rank(self) -> int:
        """Position in the replica_dp group (cp fastest, as dp_cp_rank within the replica)."""
        return self.dp_cp_rank % (self.dp * self.cp // self.replicas)

    def group_rank(self, name: str) -> int:
        """This rank's position in a gradient-reduction group: dp_cp, edp, replica_dp or replica_edp."""
        return {"dp_cp": self.dp_cp_rank, "edp": self.edp_rank, "replica_dp": self.replica_dp_rank,
                "replica_edp": self.replica_dp_rank // self.ep}[name]

    @property
    def is_first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def is_last_stage(self) -> bool:
        return self.pp_rank == self.pp - 1

    def ranks(self, name: str) -> list[int]:
        """Global ranks of this rank's group `name` (this rank alone for a size-1 group)."""
        if name in self.group_ranks:
            return list(self.group_ranks[name])
        if self.group_size(name) == 1:
            return [self.rank]
        raise KeyError(f"no {name!r} group on rank {self.rank}")

    def pp_peer(self, stage: int) -> int:
        """Global rank of the pipeline rank `stage % pp` in this rank's pipeline."""
        return self.ranks("pp")[stage % self.pp]

    # -- groups ---------------------------------------------------------------------------------------------
    def group_size(self, name: str) -> int:
        if name.startswith(P2P_PREFIX):
            return 2
        if name == "embedding":
            return len(self.group_ranks.get("embedding", [self.rank]))
        k = self.replicas
        return {"dp_cp": self.dp * self.cp, "mp": self.tp * self.pp, "world": self.world_size, "ep": self.ep,
                "edp": self.dp * self.cp // self.ep, "replica": self.world_size // k,
                "replica_dp": self.dp * self.cp // k, "cross_replica": k,
                "replica_edp": self.dp * self.cp // (k * self.ep)}.get(name, self.sizes().get(name, 1))

    def group(self, name: str):
        """This rank's process group `name` (tp, cp, dp, pp, dp_cp, mp, embedding, world, ep, edp, replica,
        replica_dp, cross_replica, replica_edp); SELF_GROUP for a group of one. Virtual dims have no groups: asking
        for one of size > 1 is an error (nothing may communicate)."""
        if self.group_size(name) == 1:
            return SELF_GROUP
        if self.virtual:
            raise RuntimeError(f"virtual ParallelDims (tp={self.tp} pp={self.pp} cp={self.cp} dp={self.dp}) has "
                               f"no process groups: a model built for another rank cannot communicate")
        if name == "world":
            import torch.distributed as dist

            return dist.group.WORLD
        return self.groups[name]

    def p2p_group(self, src: int, dst: int):
        """The pipeline's channel for messages from global rank `src` to `dst` (neighbours on the pipeline ring,
        the last and first stage included): a two-rank group per direction. NCCL runs a group's point-to-point
        batches one after another on one stream, and a send may wait for its receive: with one group for both
        directions (or for both neighbours), a receive posted early blocks the sends queued behind it, and a
        pipeline deadlocks. One direction per group leaves only sends on one side and receives on the other,
        paired in order (docs/design.md, "Collectives on CUDA")."""
        return self.group(_p2p_name(src, dst))

    @property
    def tp_group(self):
        return self.group("tp")

    @property
    def pp_group(self):
        return self.group("pp")

    @property
    def dp_group(self):
        return self.group("dp")

    @property
    def cp_group(self):
        return self.group("cp")

    @property
    def grad_group(self):
        """Where gradients are summed: the data-parallel ranks (times context parallel when cp > 1)."""
        return self.group("dp_cp")

    @property
    def ep_group(self):
        return self.group("ep")

    @property
    def expert_grad_group(self):
        """Where expert gradients are summed: the ranks holding the same experts (dp x cp / ep of them)."""
        return self.group("edp")


def local_dims(device="cpu") -> ParallelDims:
    """A single process holding everything (no torch.distributed needed)."""
    return ParallelDims(device=device)
