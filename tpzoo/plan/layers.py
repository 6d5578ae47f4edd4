"""One layer of the model as the plan sees it: its block (the hidden-size norms around the two mixers) plus the costs
of its token mixer and channel mixer kinds (plan/kinds), at one rank's layout (spec.RankLayout).

Every part of the advisor that depends on what a layer is (parameters, FLOPs, activations, collectives, FP8, the
pipeline's cost-balanced split) goes through layer_cost / layer_flops; nothing reads a family's name or a kind's
fields elsewhere. Layers with the same kinds and attention window cost the same: they are computed once
(`signature`); a kind the plan has no exact costs for is computed per layer.
"""
from __future__ import annotations

from dataclasses import dataclass

from tpzoo.models.config import ModelConfig
from tpzoo.models.registry import distinct_kinds, layer_kinds
from tpzoo.parallel.dims import ParallelLayoutError

from .costs import COSTS, Collective, Weights, cost_of
from .spec import RankLayout


def kinds_of(cfg: ModelConfig, layer: int) -> tuple[type, type]:
    """(token mixer kind, channel mixer kind) of layer `layer`: models.registry.layer_kinds, looked up once per
    config (the search asks millions of times)."""
    # (multi-token prediction's blocks too: layers num_layers and on, models/mtp.py)
    return memo(cfg, ("kinds",), lambda: tuple(layer_kinds(cfg, i)
                                               for i in range(cfg.num_layers + cfg.mtp_depths)))[layer]


def signature(cfg: ModelConfig, layer: int) -> tuple:
    """Layers with equal signatures cost the same: their kinds and attention window, and what a kind's costs say
    distinguishes its layers (`plan_signature`: a sparse attention layer with or without its own indexer); a kind
    without registered costs may depend on the layer in ways the plan cannot see: its layer index is part of the
    signature."""
    t, c = cfg.token_mixer(layer), cfg.channel_mixer(layer)
    known = t in COSTS and c in COSTS
    own = tuple(getattr(COSTS[k], "plan_signature")(cfg, layer) for k in (t, c)
                if k in COSTS and hasattr(COSTS[k], "plan_signature"))
    return (t, c, cfg.attention.window(layer)) + own + (() if known else (layer,))


def norm_saved(cfg: ModelConfig, e: int, kernels: str) -> int:
    """Bytes per token a hidden-size norm saves: its input and fp32 row statistics (the torch RMSNorm saves an fp32
    copy of its input instead, and the normalized tensor before the weight)."""
    h = cfg.hidden_size
    if cfg.norm == "layernorm":
        return e * h + 8  # input, mean, rstd (torch and Triton alike)
    return (4 * h + e * h + 4) if kernels == "reference" else (e * h + 4)


def block_norms(cfg: ModelConfig) -> int:
    """Hidden-size norms per layer (pre-norms before both mixers, post-norms after them)."""
    return 2 * (int(cfg.pre_norm) + int(cfg.post_norm))


@dataclass(frozen=True)
class LayerCost:
    """One layer on one rank at `at` (plan/kinds for the units)."""
    weights: Weights
    matmuls: tuple            # (Matmul, replayed by full recomputation)
    context_features: int     # K|V features per token ring attention sends (0: none)

    def matmul_elements(self) -> int:
        """Weights one token goes through (FLOPs per token = 2 * this, forward): ParamCount.matmul's unit."""
        return int(sum(m.elements * m.per_token for m, _ in self.matmuls))

    def matmul_flops(self, tokens: int, sp_div: int, replayed_only: bool = False) -> float:
        """Forward matmul FLOPs of `tokens` tokens (this rank's sequence; a shard matmul sees tokens / sp_div)."""
        return sum(2 * m.elements * m.per_token * (tokens // sp_div if m.shard else tokens)
                   for m, again in self.matmuls if again or not replayed_only)

    def largest_weight_grad(self, e: int, unfused: bool) -> int:
        """Bytes of the largest 16-bit weight gradient autograd hands over in this layer's backward: a projection's
        when gradient-accumulation fusion is off (or a bucket boundary stops it), a stacked or replicated weight's
        always (they never fuse)."""
        return max([e * m.elements * m.count for m, _ in self.matmuls if unfused or not m.fp8] + [0])


_CACHE: dict = {}


def memo(cfg: ModelConfig, key: tuple, compute):
    """compute() once per config object and key (configs are values: change them with replace(), not in place)."""
    full = (id(cfg),) + key
    hit = _CACHE.get(full)
    if hit is not None and hit[0] is cfg:
        return hit[1]
    if len(_CACHE) > 1 << 18:  # (a large search holds tens of thousands)
        _CACHE.clear()
    value = compute()
    _CACHE[full] = (cfg, value)
    return value


def layer_cost(cfg: ModelConfig, layer: int, at: RankLayout) -> LayerCost:
    """The cost of layer `layer` at `at` (computed once per signature)."""
    return memo(cfg, ("layer", signature(cfg, layer), at), lambda: _layer_cost(cfg, layer, at))


def replayed(cfg: ModelConfig, item, channel: bool) -> bool:
    """Whether full recomputation replays a matmul or collective: it stops once the last tensor the backward needs
    is rebuilt, so what the channel mixer computes after its last saved tensor (the MLP's output matmul and
    reduction: `tail`) is not replayed, unless a post-norm follows it (OLMo 2, Gemma: its backward needs that
    output)."""
    return not (item.tail and channel and not cfg.post_norm)


def _layer_cost(cfg: ModelConfig, layer: int, at: RankLayout) -> LayerCost:
    token, channel = (cost_of(k) for k in kinds_of(cfg, layer))
    h, n = cfg.hidden_size, block_norms(cfg)
    norm = h * (2 if cfg.norm == "layernorm" else 1)
    weights = (Weights(numel=n * norm, tensors=n * (2 if cfg.norm == "layernorm" else 1), partial_sp=n * norm)
               + token.weights(cfg, layer, at) + channel.weights(cfg, layer, at))
    matmuls = tuple((m, replayed(cfg, m, False)) for m in token.matmuls(cfg, layer, at)) + tuple(
        (m, replayed(cfg, m, True)) for m in channel.matmuls(cfg, layer, at))
    return LayerCost(weights, matmuls, token.context_features(cfg, layer, at) + channel.context_features(cfg, layer, at))


def layer_collectives(cfg: ModelConfig, layer: int, at: RankLayout, tokens: int) -> tuple[tuple[Collective, bool], ...]:
    """The layer's collectives for one micro-batch of `tokens` tokens, each with whether full recomputation
    replays it (computed once per signature)."""
    def compute() -> tuple:
        token, channel = (cost_of(k) for k in kinds_of(cfg, layer))
        return tuple([(c, replayed(cfg, c, False)) for c in token.collectives(cfg, layer, at, tokens)]
                     + [(c, replayed(cfg, c, True)) for c in channel.collectives(cfg, layer, at, tokens)])

    return memo(cfg, ("collectives", signature(cfg, layer), at, tokens), compute)


def layer_activation_bytes(cfg: ModelConfig, layer: int, at: RankLayout, micro_batch: int, seq_len: int) -> int:
    """Bytes layer `layer` keeps for the backward of one micro-batch of micro_batch x seq_len tokens (this cp rank's)
    at at.recompute: its norms' and its kinds', or under full recomputation the checkpoint's input and what the
    kinds keep beyond it."""
    def compute() -> int:
        token, channel = (cost_of(k) for k in kinds_of(cfg, layer))
        tokens, e = micro_batch * seq_len, at.act_bytes
        if at.recompute == "full":
            block = e * cfg.hidden_size * tokens // at.sp_div
        else:
            block = block_norms(cfg) * norm_saved(cfg, e, at.kernels) * tokens // at.sp_div
        return (block + token.activations(cfg, layer, at, micro_batch, seq_len)
                + channel.activations(cfg, layer, at, micro_batch, seq_len))

    return memo(cfg, ("acts", signature(cfg, layer), at, micro_batch, seq_len), compute)


def layer_flops(cfg: ModelConfig, layer: int, at: RankLayout, seq_len: int) -> float:
    """Forward FLOPs per token of the layer's parameterless cores (attention, a recurrence) on this rank."""
    token, channel = (cost_of(k) for k in kinds_of(cfg, layer))
    return token.mixing_flops(cfg, layer, at, seq_len) + channel.mixing_flops(cfg, layer, at, seq_len)


def rotary_tables_bytes(cfg: ModelConfig, layers, seq_len: int) -> int:
    """The rotary tables a chunk holding `layers` computes once per forward: cos and sin of each distinct table its
    layers read, seq_len x dim/2 fp32 each."""
    def compute() -> int:
        tables = {}
        for i in layers:
            for kind in kinds_of(cfg, i):
                spec = cost_of(kind).rotary(cfg, i)
                if spec is not None:
                    tables[spec[0]] = spec[1]
        return sum(4 * seq_len * dim for dim in tables.values())

    return memo(cfg, ("rope", tuple(layers), seq_len), compute)


def cache_bytes(cfg: ModelConfig, layer: int, at: RankLayout, batch: int, length: int) -> int:
    """Generation state of the layer on this rank for `batch` sequences of up to `length` tokens."""
    token, channel = (cost_of(k) for k in kinds_of(cfg, layer))
    return (token.cache_bytes(cfg, layer, at, batch, length) + channel.cache_bytes(cfg, layer, at, batch, length))


def check_kinds(cfg: ModelConfig, at: RankLayout) -> None:
    """Every kind of the model can split at `at` (raises the kind's ParallelLayoutError; decided once per `at`)."""
    def compute() -> str:
        try:
            for i, kind in distinct_kinds(cfg):
                cost_of(kind).check(cfg, i, at)
        except ParallelLayoutError as exc:
            return str(exc)
        return ""

    problem = memo(cfg, ("check", at), compute)
    if problem:
        raise ParallelLayoutError(problem)


def has_experts(cfg: ModelConfig) -> bool:
    """Whether any layer holds expert-parallel weights."""
    at = RankLayout()
    return memo(cfg, ("experts",), lambda: any(layer_cost(cfg, i, at).weights.expert for i in range(cfg.num_layers)))
