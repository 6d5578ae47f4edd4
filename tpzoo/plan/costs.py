"""The plan's per-kind cost protocol: what one layer kind (models/kinds: a token or channel mixer) costs on one rank.

The advisor never reads a family's name nor a kind's fields itself: for each layer it asks the layer's token mixer
and channel mixer kinds (ModelConfig.token_mixer(i) / channel_mixer(i)) for their costs at a RankLayout (spec.py:
tp, sequence_parallel, cp, ep, recompute, activation bytes, kernels), and adds the block's norms (plan/layers.py).
Nine static methods, each optional (units: elements, bytes, FLOPs; "per token" = per token of this rank's part of the
sequence, b * s / cp, the whole sequence under SP unless it says shard):

    plan_check(cfg, layer, at) -> None           raise ParallelLayoutError where the kind cannot split at `at`
                                                 (default: the kind's own check_parallel(cfg, layer, tp, cp, ep),
                                                 never a second copy of it)
    plan_weights(cfg, layer, at) -> Weights      parameters on this rank (tensors, elements, which are replicated
                                                 with a partial gradient, replicated copies, expert-parallel)
    plan_matmuls(cfg, layer, at) -> [Matmul]     its weight matrices on this rank as a token meets them: FLOPs,
                                                 FP8, 16-bit weight gradients, what full recomputation replays
    plan_mixing_flops(cfg, layer, at, seq_len) -> float
                                                 forward FLOPs per token of its parameterless core (attention
                                                 scores and values, a recurrence), causal and windows counted,
                                                 1/tp of the heads; the backward is twice that; selective
                                                 recomputation replays it
    plan_activations(cfg, layer, at, micro_batch, seq_len) -> int
                                                 bytes kept for the backward of one micro-batch of micro_batch
                                                 sequences of seq_len tokens (this cp rank's) at at.recompute
                                                 ("full": what it keeps beyond the block's checkpointed input)
    plan_collectives(cfg, layer, at, tokens) -> [Collective]
                                                 its tp / cp / ep collectives for one micro-batch of `tokens`
    plan_context_features(cfg, layer, at) -> int K|V features per token ring attention sends under cp (0: none)
    plan_cache_bytes(cfg, layer, at, batch, length) -> int
                                                 its generation state on this rank (KV, latent, recurrent state)
    plan_rotary(cfg, layer) -> (key, dim) | None the rotary table it reads (the model computes each distinct one
                                                 once per forward: cos and sin, seq_len x dim/2 fp32 each)
    plan_signature(cfg, layer) -> tuple          (of a registered cost class only) what tells apart layers of the
                                                 kind that cost differently (the plan computes each signature once)

Resolution (cost_of): methods the kind class defines itself win; then the exact costs registered for its name (the
built-in kinds': tpzoo/plan/kinds/<kind>.py, every file of that folder imported by it); then Derived, which
approximates any kind from its num_parameters and sequence_flops (a kind plans, roughly, without new code).

A leaf of the plan: this module imports nothing of the costs that register into it.
"""
from __future__ import annotations

from dataclasses import dataclass, field

COSTS: dict[str, type] = {}


def register_cost(name: str):
    """Register the exact plan costs of the layer kind registered (models/kinds) under `name`."""
    def add(cls):
        COSTS[name] = cls
        return cls
    return add


class Stateless:
    """Defaults for a kind's costs that a channel mixer or a recurrence shares: no ring-attention features, no
    generation cache, no rotary table (a registered cost class overrides what it has)."""

    @staticmethod
    def plan_context_features(cfg, layer, at) -> int:
        return 0

    @staticmethod
    def plan_cache_bytes(cfg, layer, at, batch: int, length: int) -> int:
        return 0

    @staticmethod
    def plan_rotary(cfg, layer):
        return None


@dataclass(frozen=True)
class Weights:
    """A kind's parameters on one rank (elements)."""
    numel: int = 0          # stored on this rank
    tensors: int = 0        # parameter tensors
    partial_sp: int = 0     # replicated, gradient partial under SP (norms, row biases, replicated down projections)
    partial: int = 0        # replicated, gradient partial over tp at any layout (per-head q/k norms, a head norm)
    replicated: int = 0     # in tensors holding copies of another rank's part (kv heads): gathered and summed
    expert: int = 0         # expert-parallel (their own optimizer over edp at ep > 1)

    def __add__(self, other: "Weights") -> "Weights":
        return Weights(*(a + b for a, b in zip(self.astuple(), other.astuple())))

    def astuple(self) -> tuple:
        return (self.numel, self.tensors, self.partial_sp, self.partial, self.replicated, self.expert)


@dataclass(frozen=True)
class Matmul:
    """One weight matrix [out, inp] on this rank as tokens meet it."""
    name: str
    out: int
    inp: int
    count: int = 1            # stacked matrices stored (this rank's experts)
    per_token: float = 1.0    # how many of them one token goes through (top-k experts: k; over the ep group)
    shard: bool = False       # it sees this rank's sequence shard under SP (a replicated weight), else every token
    fp8: bool = True          # a column/row-parallel projection: FP8 runs it, its weight gradient can fuse into the
                              # fp32 main gradient (else autograd always hands over a 16-bit one)
    tail: bool = False        # computed after the layer's last saved tensor: full recomputation does not replay it

    @property
    def elements(self) -> int:
        return self.out * self.inp


@dataclass(frozen=True)
class Acts:
    """A helper for plan_activations: bytes per token of the rank's full sequence, per token of its sequence shard
    (the whole sequence without SP), and per layer."""
    full: int = 0
    shard: int = 0
    fixed: int = 0

    def bytes(self, tokens: int, sp_div: int) -> int:
        return self.full * tokens + self.shard * tokens // sp_div + self.fixed

    def __add__(self, other: "Acts") -> "Acts":
        return Acts(self.full + other.full, self.shard + other.shard, self.fixed + other.fixed)


@dataclass(frozen=True)
class Collective:
    """Collectives of one micro-batch (tpzoo.parallel.comm's kinds and units: payload = one call's input bytes).
    phase: "forward"; "backward" (input gradients: B); "regather" (an SP column layer's input gathered again for
    its weight gradient: W under zero-bubble); "step" (once per step after the backward: finish_tp_grads).
    tail: after the layer's last saved tensor (full recomputation does not replay it)."""
    op: str
    group: str
    payload: int
    calls: int = 1
    phase: str = "forward"
    tail: bool = False


@dataclass
class Cost:
    """A kind's costs resolved: the methods of the protocol as plain callables (cost_of)."""
    name: str
    check: object = None
    weights: object = None
    matmuls: object = None
    mixing_flops: object = None
    activations: object = None
    collectives: object = None
    context_features: object = None
    cache_bytes: object = None
    rotary: object = None
    derived: list = field(default_factory=list)  # which methods fell back to Derived


METHODS = ("check", "weights", "matmuls", "mixing_flops", "activations", "collectives", "context_features",
           "cache_bytes", "rotary")
_RESOLVED: dict = {}


def cost_of(kind: type) -> Cost:
    """The costs of a registered kind class (models/kinds), method by method: the class's own plan_* static methods,
    else the exact ones registered for its name, else Derived's approximations."""
    if kind not in _RESOLVED:
        exact = COSTS.get(getattr(kind, "kind", ""))
        cost = Cost(getattr(kind, "kind", kind.__name__))
        for m in METHODS:
            fn = getattr(kind, "plan_" + m, None) or (getattr(exact, "plan_" + m, None) if exact else None)
            if fn is None and m == "check" and hasattr(kind, "check_parallel"):
                fn = _asks_the_kind(kind)
            if fn is None:
                fn = getattr(Derived(kind), "plan_" + m)
                cost.derived.append(m)
            setattr(cost, m, fn)
        _RESOLVED[kind] = cost
    return _RESOLVED[kind]


def _asks_the_kind(kind: type):
    """plan_check from the kind's own check_parallel(cfg, layer, tp, cp, ep): the one copy of its validity checks,
    which its build and the preflight ask too."""
    def plan_check(cfg, layer, at) -> None:
        kind.check_parallel(cfg, layer, at.tp, at.cp, at.ep)
    return plan_check


class Derived:
    """Approximate costs of a kind that declares none, from its num_parameters(cfg, layer, active) and
    sequence_flops(cfg, layer, seq_len) alone: its parameters split over tp as one column and one row projection
    of equal size; it keeps its input (this rank's shard) and two e-byte values per weight column it produces
    (an attention or MLP keeps about that); it enters and leaves the TP region as a column and a row layer do;
    its core's FLOPs are half of sequence_flops (causal) over tp; its cache is zero (unknown). Good to the
    factor of the real thing, not exact: a kind with its own plan_* methods or a registered cost is exact."""

    def __init__(self, kind: type):
        self.kind = kind

    def _half(self, cfg, layer, at, active=False) -> int:
        return self.kind.num_parameters(cfg, layer, active) // (2 * at.tp)

    def plan_check(self, cfg, layer, at) -> None:
        return None

    def plan_weights(self, cfg, layer, at) -> Weights:
        return Weights(numel=2 * self._half(cfg, layer, at), tensors=2)

    def plan_matmuls(self, cfg, layer, at) -> list:
        h = cfg.hidden_size
        active = max(1, self._half(cfg, layer, at, True) // h)
        return [Matmul("in", active, h), Matmul("out", h, active, tail=True)]

    def plan_mixing_flops(self, cfg, layer, at, seq_len: int) -> float:
        flops = getattr(self.kind, "sequence_flops", None)
        return flops(cfg, layer, seq_len) / 2 / at.tp if flops else 0.0

    def plan_activations(self, cfg, layer, at, micro_batch: int, seq_len: int) -> int:
        if at.recompute == "full":
            return 0
        width = max(1, self._half(cfg, layer, at, True) // cfg.hidden_size)
        acts = Acts(full=2 * at.act_bytes * width, shard=at.act_bytes * cfg.hidden_size)
        return acts.bytes(micro_batch * seq_len, at.sp_div)

    def plan_collectives(self, cfg, layer, at, tokens: int) -> list:
        return entry_exit(cfg, at, tokens, tail=False)

    def plan_context_features(self, cfg, layer, at) -> int:
        return 0

    def plan_cache_bytes(self, cfg, layer, at, batch: int, length: int) -> int:
        return 0

    def plan_rotary(self, cfg, layer):
        spec = getattr(self.kind, "rotary", None)  # a class-level RotarySpec, if the kind declares one there
        return (spec, spec.dim) if spec is not None and hasattr(spec, "dim") else None


def entry_exit(cfg, at, tokens: int, tail: bool, regather: bool = True) -> list:
    """The TP region's entry (a column layer's input) and exit (a row layer's output) of [tokens, h] activations:
    without SP one all-reduce each way (the exit's forward, the entry's backward); with SP an all-gather in and a
    reduce-scatter out, their conjugates in the backward, and (`regather`) the column layer's input gathered again
    for its weight gradient (tpzoo.parallel.column_linear keeps only the shard). `tail`: the exit follows the
    layer's last saved tensor."""
    if at.tp == 1:
        return []
    full = tokens * cfg.hidden_size * at.act_bytes
    if at.sequence_parallel:
        out = [Collective("all_gather", "tp", full), Collective("reduce_scatter", "tp", full, tail=tail),
               Collective("all_gather", "tp", full, phase="backward"),
               Collective("reduce_scatter", "tp", full, phase="backward")]
        return out + ([Collective("all_gather", "tp", full, phase="regather")] if regather else [])
    return [Collective("all_reduce", "tp", full, tail=tail), Collective("all_reduce", "tp", full, phase="backward")]
