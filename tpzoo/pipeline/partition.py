"""Which layers each pipeline stage holds, and this rank's model chunks.

Model stages are numbered 0 .. pp*v-1 along the network. With interleaving (v virtual stages per rank), rank r
holds the chunks c = 0 .. v-1, chunk c being model stage c*pp + r (Megatron's order): activations travel
rank 0 -> 1 -> ... -> pp-1 -> 0 -> ... v times, so the pipeline is a ring.
"""
from __future__ import annotations

import torch

from tpzoo.errors import UserError


class PartitionError(UserError, ValueError):
    """A layer split that cannot work (empty stage, fewer layers than stages, malformed boundaries)."""


def layer_parameters(cfg) -> list[int]:
    """Parameters of each transformer layer (ModelConfig.layer_parameters: its norms and its two kinds')."""
    return cfg.layer_parameters()


def _end_costs(cfg) -> tuple[int, int]:
    """Extra parameters of the first stage (the embedding) and of the last (final norm, head, MTP depths)."""
    final_norm = cfg.hidden_size * (2 if cfg.norm == "layernorm" else 1)
    embedding = cfg.vocab_size * cfg.hidden_size
    if cfg.position == "learned":
        embedding += cfg.max_position_embeddings * cfg.hidden_size
    # The last stage always holds a head (its own copy of the tied embedding when pp > 1) and the
    # multi-token-prediction depths beside it (models/mtp.py), with their copy of the embedding when pp > 1.
    head = cfg.vocab_size * cfg.hidden_size * (2 if cfg.mtp is not None else 1) + final_norm + cfg.mtp_parameters()
    return embedding, head


def check_boundaries(boundaries: list[int], num_layers: int, stages: int) -> list[tuple[int, int]]:
    b = list(boundaries)
    if len(b) != stages + 1:
        raise PartitionError(f"boundaries {b} must have {stages + 1} entries (one more than the {stages} stages)")
    if b[0] != 0 or b[-1] != num_layers:
        raise PartitionError(f"boundaries {b} must start at 0 and end at num_layers={num_layers}")
    for k in range(stages):
        if b[k + 1] <= b[k]:
            raise PartitionError(f"boundaries {b}: stage {k} would be empty ([{b[k]}, {b[k + 1]}))")
    return [(b[k], b[k + 1]) for k in range(stages)]


def partition_layers(cfg, pp: int, boundaries: list[int] | None = None, virtual_stages: int = 1,
                     weights: list[float] | None = None, ends: tuple | None = None) -> list[tuple[int, int]]:
    """Layer range [start, end) of every model stage (index vstage*pp + pp_rank), pp*virtual_stages of them.

    Default: balanced by parameters, each layer weighing its own (layer_parameters: an MoE layer many times a
    dense one), the embedding counted on the first stage and the head on the last (so with a large vocabulary the
    end stages get fewer layers). `weights` and `ends`: another cost per layer and of the (first, last) stage's
    extras, in one unit (the plan's time per layer, the head's). `boundaries=[0, 3, 8]` gives stage 0 the layers [0, 3) and
    stage 1 [3, 8); uneven splits are allowed, empty stages are not."""
    if pp < 1 or virtual_stages < 1:
        raise PartitionError(f"pp and virtual_stages must be >= 1, got pp={pp}, virtual_stages={virtual_stages}")
    stages, num_layers = pp * virtual_stages, cfg.num_layers
    if boundaries is not None:
        return _readers_with_sources(cfg, check_boundaries(boundaries, num_layers, stages), given=True)
    if num_layers < stages:
        raise PartitionError(f"{num_layers} layers cannot fill {stages} pipeline stages "
                             f"(pp={pp} x virtual_stages={virtual_stages}): every stage needs at least one layer")
    cost = list(weights) if weights is not None else layer_parameters(cfg)
    if len(cost) != num_layers:
        raise PartitionError(f"{len(cost)} layer weights for {num_layers} layers")
    embedding, head = ends if ends is not None else _end_costs(cfg)
    extra = [0] * stages
    extra[0] += embedding
    extra[-1] += head
    if len(set(cost)) > 1:
        counts = _min_max_counts(cost, extra)
    else:
        # Water-filling: every stage starts with one layer; each further layer goes to the stage that would be the
        # cheapest after taking it. With identical layers this minimizes the most expensive stage.
        counts, per_layer = [1] * stages, cost[0]
        for _ in range(num_layers - stages):
            k = min(range(stages), key=lambda i: ((counts[i] + 1) * per_layer + extra[i], i))
            counts[k] += 1
    out, start = [], 0
    for n in counts:
        out.append((start, start + n))
        start += n
    return _readers_with_sources(cfg, out, given=False)


def _readers_with_sources(cfg, ranges: list, given: bool) -> list[tuple[int, int]]:
    """Each stage holding the layers its layers read within the forward (ModelConfig.reads_layer: GLM-5's shared
    sparse attention layers and the layer whose selection they reuse): given boundaries that part them are refused;
    a balanced split moves the stage's start back to the source (refused when that empties the stage before)."""
    reads = getattr(cfg, "reads_layer", None)
    if reads is None:
        return ranges
    out = list(ranges)
    for k in range(1, len(out)):
        start, end = out[k]
        need = min(reads(i) for i in range(start, end))
        if need >= start:
            continue
        reader = next(i for i in range(start, end) if reads(i) == need)
        if given or need <= out[k - 1][0]:
            raise PartitionError(f"pipeline stage {k} starts at layer {start}, but layer {reader} reuses what layer "
                                 f"{need} computes in the same forward: start the stage at layer {need} or earlier "
                                 f"(--pp-boundaries)")
        out[k - 1], out[k] = (out[k - 1][0], need), (need, end)
    return out


def _fill_from_the_end(cost: list, extra: list, cap: float) -> list[int] | None:
    """Layers per stage when each stage, from the last one back, takes as many layers as fit under `cap` (leaving
    one for every stage before it); None when a stage cannot hold even one layer under it or the first cannot
    hold what is left."""
    counts, end = [0] * len(extra), len(cost)
    for k in range(len(extra) - 1, -1, -1):
        start, total = end, extra[k]
        while start > k and total + cost[start - 1] <= cap:
            total += cost[start - 1]
            start -= 1
        if start == end or (k == 0 and start > 0):
            return None
        counts[k], end = end - start, start
    return counts


def _min_max_counts(cost: list, extra: list) -> list[int]:
    """Contiguous layers per stage for layers of different costs (dense-first MoE stacks, hybrid linear attention):
    the fullest stage as small as it can be (`cap`, by bisection), and under that cap each stage, from the last one
    back, as close as it can get to an even share of what is left: an unavoidably heavy stage (the head's) does not
    let the others fill up to it."""
    lo, hi = 0.0, float(sum(cost) + sum(extra))
    for _ in range(64):
        mid = (lo + hi) / 2
        if _fill_from_the_end(cost, extra, mid) is None:
            lo = mid
        else:
            hi = mid
    cap, counts, end = hi, [0] * len(extra), len(cost)
    for k in range(len(extra) - 1, 0, -1):
        share = (sum(cost[:end]) + sum(extra[:k + 1])) / (k + 1)
        start, total = end, extra[k]
        while start > k and total + cost[start - 1] <= cap and (
                start == end or abs(total + cost[start - 1] - share) <= abs(total - share)):
            total += cost[start - 1]
            start -= 1
        while _fill_from_the_end(cost[:start], extra[:k], cap) is None:  # what is left must still fit the cap
            start -= 1
        counts[k], end = end - start, start
    counts[0] = end
    return counts


def model_stages(cfg, pp: int, boundaries: list[int] | None = None, virtual_stages: int = 1) -> list:
    """Every model stage (index vstage*pp + pp_rank) as a tpzoo.models.Stage: its layers, whether it embeds
    (the first) and whether it holds the head (the last)."""
    from tpzoo.models import Stage

    ranges = partition_layers(cfg, pp, boundaries, virtual_stages)
    return [Stage(range(*r), i == 0, i == len(ranges) - 1) for i, r in enumerate(ranges)]


def build_model_chunks(cfg, layout=None, *, stages: list | None = None, virtual_stages: int = 1,
                       boundaries: list[int] | None = None, recompute: str = "none", seed: int = 0,
                       **layout_fields) -> list:
    """This rank's model chunks at `layout` (a tpzoo.models.ModelLayout, or a ParallelDims; default: the default
    dims; `layout_fields`, ModelLayout's fields such as sequence_parallel=True or device="meta", set on it): the one
    path that builds models, for training, tpzoo.checkpoint.load_model, eval and generation.

    `stages`: this rank's chunks' Stages (a checkpoint's); default: the model stages c*pp + pp_rank for c < virtual
    stages of `partition_layers` (boundaries), the first embedding, the last with the final norm and head.
    Weights are layout independent (per-module seeds in Transformer), so any (tp, pp, v) starts from the same
    full model. A tied head on another stage starts equal to the embedding; finalize_grads keeps them equal.
    layout.device "meta" builds them unallocated (then materialize_chunks, or a checkpoint loader). `recompute`
    is applied to each chunk once built (tpzoo.models.apply_recompute)."""
    from tpzoo.models import ModelLayout, Transformer, apply_recompute  # models depend on tpzoo.parallel: import late

    layout = ModelLayout.of(layout).replace(**layout_fields)
    dims = layout.dims
    if stages is None:
        every = model_stages(cfg, dims.pp, boundaries, virtual_stages)
        stages = [every[c * dims.pp + dims.pp_rank] for c in range(virtual_stages)]
    return tie_chunks([apply_recompute(Transformer(cfg, layout, stage, seed), recompute) for stage in stages])


def as_chunks(model_or_chunks) -> list:
    """This rank's model chunks as a list, whether given one Transformer or several (a list, an nn.ModuleList)."""
    if isinstance(model_or_chunks, (list, tuple, torch.nn.ModuleList)):
        return list(model_or_chunks)
    return [model_or_chunks]


def tie_chunks(chunks: list) -> list:
    """pp == 1 with several chunks: the first and last model stage live on this rank, so the head (when tied) and
    multi-token prediction's copy of the embedding are the embedding itself, as in an unsplit model."""
    first, last = chunks[0], chunks[-1]
    if len(chunks) > 1 and first.pre_process and last.post_process:
        if first.cfg.tie_embeddings:
            last.lm_head.weight = first.embed.weight
        if last.mtp is not None:
            last.mtp.embed.weight = first.embed.weight
    return chunks


def materialize_chunks(chunks: list, device, *, init: bool = True) -> list:
    """Allocate chunks built on meta on `device` and (init) give them the layout-independent initial weights;
    without init their weights are left to a checkpoint loader."""
    for chunk in chunks:
        chunk.materialize(device)
        if init:
            chunk.init_weights()
    return tie_chunks(chunks)
