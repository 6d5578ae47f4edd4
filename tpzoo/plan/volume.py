"""The collectives one rank issues in a training step, in tpzoo.parallel.comm's units (calls, payload bytes, bytes
a ring sends), per (kind, group): tested equal to count_collectives().

Per layer and micro-batch, each layer's kinds say what they send (plan/kinds plan_collectives: for attention and
the MLP the TP region's entry and exit, 2 all-reduces each way without SP, all-gathers and reduce-scatters with it
plus the backward's re-gather of the column inputs; an MoE's top-k weights and ep all-to-alls; ...); full
recomputation repeats a layer's forward collectives in the backward, except what follows its last saved tensor
(the MLP's output reduction: torch's non-reentrant checkpoint stops early) unless a post-norm needs it.
Embedding: forward all-reduce (SP: reduce-scatter, backward all-gather). Head and loss: plan/head.py.
After the backward, tpzoo.parallel.finish_tp_grads: one all-reduce of the partial gradients of replicated
parameters (under SP every one of them: norms, row biases, learned positions, ...; without SP the per-head ones),
and the kinds' "step" collectives (the replicated kv heads' gradients gathered and summed).
"""
from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

from tpzoo.models.aux import model_rules
from tpzoo.models.config import ModelConfig
from tpzoo.models.registry import layer_kinds

from .head import head_collectives
from .costs import Collective
from .layers import layer_collectives, layer_cost
from .memory import stage_layer_ids, stage_params
from .spec import Layout, RankLayout


@dataclass
class Volume:
    calls: int = 0
    payload_bytes: int = 0
    sent_bytes: float = 0.0


_SENT = {"all_reduce": lambda p: 2 * (p - 1) / p, "all_gather": lambda p: (p - 1) / p,
         "reduce_scatter": lambda p: (p - 1) / p, "send": lambda p: 1.0, "recv": lambda p: 0.0,
         # all_to_all: (p-1)/p leaves the rank; all_to_all_v: the same in expectation (balanced routing)
         "all_to_all": lambda p: (p - 1) / p, "all_to_all_v": lambda p: (p - 1) / p}


class VolumeTable:
    """(kind, group) -> Volume, in the shape of CollectiveCounter.summary()."""

    def __init__(self):
        self.table: dict[tuple[str, str], Volume] = defaultdict(Volume)

    def add(self, kind: str, group: str, group_size: int, payload: int, calls: int = 1) -> None:
        if group_size == 1 or calls == 0:
            return  # tpzoo skips collectives over a group of one
        v = self.table[(kind, group)]
        v.calls += calls
        v.payload_bytes += payload * calls
        v.sent_bytes += _SENT[kind](group_size) * payload * calls

    def summary(self) -> dict:
        return {f"{k}@{g}": {"calls": v.calls, "payload_bytes": v.payload_bytes, "sent_bytes": v.sent_bytes}
                for (k, g), v in sorted(self.table.items())}

    def sent(self, group: str) -> float:
        return sum(v.sent_bytes for (_, g), v in self.table.items() if g == group)

    def calls(self, group: str) -> int:
        return sum(v.calls for (_, g), v in self.table.items() if g == group)


def embedding_collectives(cfg: ModelConfig, at: RankLayout, tokens: int) -> list:
    """The vocab-parallel embedding's exit from the TP region (its lookup is local)."""
    if at.tp == 1:
        return []
    full = tokens * cfg.hidden_size * at.act_bytes
    if at.sequence_parallel:
        return [Collective("reduce_scatter", "tp", full), Collective("all_gather", "tp", full, phase="backward")]
    return [Collective("all_reduce", "tp", full)]


def micro_batch_collectives(cfg: ModelConfig, layout: Layout, stage: int, seq_len: int, at: RankLayout,
                            fused_loss: bool = True) -> list[tuple[Collective, bool]]:
    """Every collective of one micro-batch on pipeline stage `stage` (its layers, the embedding on the first stage,
    the head and loss on the last), each with whether full recomputation replays it; "step" ones once per step."""
    tokens, ids = layout.micro_batch_size * seq_len, stage_layer_ids(cfg, layout, stage)
    out = [c for i in ids for c in layer_collectives(cfg, i, at, tokens)]
    if stage == 0:
        out += [(c, False) for c in embedding_collectives(cfg, at, tokens)]
    if stage == layout.pp - 1:
        out += [(c, False) for c in head_collectives(cfg, at, tokens, fused_loss)]
        out += [(c, False) for c in router_report_collectives(cfg, layout, at, ids)]
    return out


def router_report_collectives(cfg: ModelConfig, layout: Layout, at: RankLayout, ids) -> list[Collective]:
    """The router statistics' tp all-reduce under SP (models/kinds/moe.py router_losses: the fp32 totals of
    stats_size = 2E + 2 values, summed over the sequence shards), once per forward on the last stage: when the
    router loss trains (the totals carried through every stage), and on a one-chunk model whose layers record them
    whenever (it reduces its own reports, loss or not)."""
    rule = model_rules(cfg).get("router")
    if rule is None or not (at.sequence_parallel and at.tp > 1):
        return []
    records = any(getattr(r, "key", None) == "router" for i in ids for kind in layer_kinds(cfg, i)
                  for r in getattr(kind, "aux_rules", ()))
    if rule.trains(cfg) or (layout.pp == 1 and records):
        return [Collective("all_reduce", "tp", rule.size(cfg) * 4)]
    return []


def tp_step_volume(cfg: ModelConfig, layout: Layout, stage: int, micro_batches: int, seq_len: int,
                   act_bytes: int, grad_bytes: int, vocab_padding_multiple: int = 1,
                   fused_loss: bool = True) -> VolumeTable:
    """Tensor-parallel collectives of one step (forward + backward of every micro-batch, then finish_tp_grads,
    which reduces the parameters' .grad: `grad_bytes` = the model dtype's) on pipeline stage `stage`. The stage's
    first and last model chunks hold the embedding and the head (`fused_loss`: the fused linear cross-entropy, the
    default)."""
    at = RankLayout.of(layout).replace(act_bytes=act_bytes, vocab_padding_multiple=vocab_padding_multiple)
    return step_volume(cfg, layout, stage, micro_batches, seq_len, at, "tp", fused_loss, grad_bytes)


def step_volume(cfg: ModelConfig, layout: Layout, stage: int, micro_batches: int, seq_len: int, at: RankLayout,
                group: str, fused_loss: bool = True, grad_bytes: int | None = None) -> VolumeTable:
    """The collectives over `group` ("tp", "cp", "ep") of one step of `micro_batches` micro-batches on a stage."""
    vt = VolumeTable()
    sizes = {"tp": at.tp, "cp": at.cp, "ep": at.ep}
    full = at.recompute == "full"
    for c, again in micro_batch_collectives(cfg, layout, stage, seq_len, at, fused_loss):
        if c.group == group and c.phase != "step":
            vt.add(c.op, group, sizes[group], c.payload, micro_batches * c.calls * (
                1 + (full and again and c.phase == "forward")))
    if group == "tp":
        for c in step_collectives(cfg, layout, stage, at, grad_bytes):
            vt.add(c.op, "tp", at.tp, c.payload, c.calls)
    return vt


def step_collectives(cfg: ModelConfig, layout: Layout, stage: int, at: RankLayout,
                     grad_bytes: int | None = None) -> list[Collective]:
    """finish_tp_grads on a stage, once per step: the partial gradients of replicated parameters all-reduced (under
    SP all of them; without SP only the per-head ones), and what the kinds do once per step (the replicated kv
    heads' gradients gathered), at the gradients' dtype (`grad_bytes`, default the activations')."""
    if at.tp == 1:
        return []
    g = at.act_bytes if grad_bytes is None else grad_bytes
    count = stage_params(cfg, layout, stage, at.vocab_padding_multiple)
    partial = count.sequence_parallel if at.sequence_parallel else count.partial
    out = [Collective("all_reduce", "tp", partial * g, phase="step")] if partial else []
    for i in stage_layer_ids(cfg, layout, stage):
        out += [c for c, _ in layer_collectives(cfg, i, at.replace(act_bytes=g), 1)
                if c.group == "tp" and c.phase == "step"]
    return out


def ring_layer_volume(cfg: ModelConfig, layout: Layout, seq_len: int, act_bytes: int, layer: int = 0) -> dict:
    """Ring attention's sends of layer `layer` per micro-batch and cp rank (tpzoo.parallel.ring_attention): forward
    cp-1 K|V blocks in the activation dtype; backward cp-1 K|V blocks and cp dK|dV blocks in fp32 (or wider). A block
    is this rank's keys and values, b * (seq_len / cp) tokens of the kind's K|V features (plan_context_features).
    {"forward"|"backward": (calls, bytes)}."""
    c = layout.cp
    at = RankLayout.of(layout).replace(act_bytes=act_bytes)
    features = layer_cost(cfg, layer, at).context_features
    if c == 1 or not features:
        return {"forward": (0, 0), "backward": (0, 0)}
    elems = layout.micro_batch_size * (seq_len // c) * features
    acc = max(act_bytes, 4)
    return {"forward": (c - 1, (c - 1) * elems * act_bytes),
            "backward": (2 * c - 1, (c - 1) * elems * act_bytes + c * elems * acc)}


def layer_volume(cfg: ModelConfig, layer: int, layout: Layout, seq_len: int, act_bytes: int,
                 group: str = "ep") -> VolumeTable:
    """The collectives over `group` of layer `layer`, one micro-batch of micro_batch_size x seq_len tokens on this
    rank, forward + backward (+ full recomputation's replay). For an MoE layer at ep > 1 (models/kinds/moe.py): 1
    all_to_all of the E per-expert counts (int64) and 2 all_to_all_v of the T*k rows of h elements forward
    (dispatch, return), the two row exchanges again in backward (a call's payload is its input: the rows this rank
    received are T*k in expectation; summed over the ep group, exact)."""
    at = RankLayout.of(layout).replace(act_bytes=act_bytes)
    vt, full = VolumeTable(), at.recompute == "full"
    sizes = {"tp": at.tp, "cp": at.cp, "ep": at.ep}
    for c, again in layer_collectives(cfg, layer, at, layout.micro_batch_size * seq_len):
        if c.group == group and c.phase != "step":
            vt.add(c.op, group, sizes[group], c.payload, c.calls * (1 + (full and again and c.phase == "forward")))
    return vt
