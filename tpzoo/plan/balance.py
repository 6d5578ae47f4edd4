"""Pipeline stages balanced by time (issue 32 item 7, issue 33 item 6): where a model's layers differ (dense-first
mixtures of experts, Gated DeltaNet among attention layers), the default split (tpzoo.pipeline.partition_layers:
balanced by each layer's parameters, what the trainer does without --pp-boundaries) can leave one stage much slower
than the others: an MoE layer holds many times a dense layer's weights but computes about as much per token.

time_balanced_boundaries weighs each layer by its compute on one GPU of the layout (forward, input and weight
gradients and recomputation: what plan/estimate.py times, from the kinds' FLOPs) and the last stage's head by its
own, and splits so that the slowest stage is fastest. The search estimates that split beside the default one for
every pipeline layout of a model whose layers differ; memory decides between them (a split that balances time may
not fit: a stage of MoE layers holds more weights), so the plan picks the fastest that fits, and prints its
boundaries for `--pp-boundaries`.
"""
from __future__ import annotations

from tpzoo.models.config import ModelConfig

from .head import local_vocab
from .layers import layer_cost, layer_flops, memo, signature
from .spec import Layout, RankLayout, TrainingSpec, local_seq_len


def layers_differ(cfg: ModelConfig) -> bool:
    """Whether the model's layers are not all the same kind (the default split is then not time balanced)."""
    return len({signature(cfg, i)[:2] for i in range(cfg.num_layers)}) > 1


def layer_step_flops(cfg: ModelConfig, layout: Layout, training: TrainingSpec) -> list[float]:
    """FLOPs of one micro-batch through each layer on one GPU of `layout`: forward, input and weight gradients
    (3x the matmuls, 3x the cores: the backward's cores are twice the forward's) and what recomputation replays."""
    at = RankLayout.of(layout, training)
    tokens = layout.micro_batch_size * local_seq_len(layout, training)
    out = []
    for i in range(cfg.num_layers):
        c = layer_cost(cfg, i, at)
        matmul, core = c.matmul_flops(tokens, at.sp_div), tokens * layer_flops(cfg, i, at, training.seq_len)
        again = {"full": c.matmul_flops(tokens, at.sp_div, replayed_only=True) + core, "selective": core}
        out.append(3 * matmul + 3 * core + again.get(layout.recompute, 0.0))
    return out


def time_balanced_boundaries(cfg: ModelConfig, layout: Layout, training: TrainingSpec) -> tuple[int, ...]:
    """The pp * v model stages' boundaries (0, ..., num_layers) that make the slowest stage's compute smallest.
    Every term is proportional to the micro-batch's tokens, so the split is computed once per (pp, v, rank
    layout), at one sequence per micro-batch."""
    from tpzoo.pipeline import partition_layers

    one = layout.replace(micro_batch_size=1, dp=1, schedule="1f1b", boundaries=None)

    def compute() -> tuple[int, ...]:
        tokens = local_seq_len(one, training)
        head = 3 * 2 * tokens * cfg.hidden_size * local_vocab(cfg, one.tp, training.vocab_padding_multiple)
        ranges = partition_layers(cfg, one.pp, virtual_stages=one.virtual_stages,
                                  weights=layer_step_flops(cfg, one, training), ends=(0, head))
        return tuple(a for a, _ in ranges) + (cfg.num_layers,)

    key = ("time cuts", one.pp, one.virtual_stages, RankLayout.of(one, training), training.seq_len)
    return memo(cfg, key, compute)
