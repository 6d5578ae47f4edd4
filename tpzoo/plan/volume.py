"""The collectives one tensor-parallel rank issues in a training step, in tpzoo.parallel.comm's units
(calls, payload bytes, bytes a ring sends), per (kind, group): tested equal to count_collectives().

Per layer and micro-batch of T tokens (e = activation bytes, t = tp), from tpzoo.models.kinds (attention.py, mlp.py):
  without SP: forward  2 all-reduce of T*h*e (attention out, MLP out: row-parallel)
              backward 2 all-reduce of T*h*e (qkv and fc_in inputs: column-parallel copy_to_tp)
  with SP:    forward  2 all-gather + 2 reduce-scatter, backward the same, of T*h*e (full tensor)
  full recompute repeats the layer's forward collectives in the backward, except the last (the MLP output
  reduction): torch's non-reentrant checkpoint stops recomputing once the last saved tensor is rebuilt.
Embedding: forward all-reduce (SP: reduce-scatter, backward all-gather). Head and loss: plan/head.py (unfused:
the output layer's backward all-reduce or SP gathers, and the loss's all-reduces of T and 3T fp32; fused: the
same input-gradient reduction, in the forward, and one all-gather of 4 fp32 per token and rank per chunk).
After the backward, tpzoo.parallel.finish_tp_grads: under SP one all-reduce of the partial gradients of
replicated parameters (norms, row biases, learned positions; per-head q/k norms also without SP); OLMo 2's
full-width q/k norms all-reduce 2 fp32 per token per layer, forward and backward; with kv heads replicated
(kv_heads < tp) one all-gather of each qkv weight (and bias, and OLMo 2's k_norm weight) gradient to sum the
copies.
"""
from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

from tpzoo.models.config import ModelConfig

from .head import add_head_volume
from .memory import local_dims, stage_params
from .spec import Layout, stage_chunks, stage_layers


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


def tp_step_volume(cfg: ModelConfig, layout: Layout, stage: int, micro_batches: int, seq_len: int,
                   act_bytes: int, grad_bytes: int, vocab_padding_multiple: int = 1,
                   fused_loss: bool = True) -> VolumeTable:
    """Tensor-parallel collectives of one step (forward + backward of every micro-batch, then
    finish_tp_grads, which reduces the parameters' .grad: `grad_bytes` = the model dtype's) on pipeline stage
    `stage`. The stage's first and last model chunks hold the embedding and the head (`fused_loss`: the fused
    linear cross-entropy, the default)."""
    t, sp, p = layout.tp, layout.sequence_parallel, layout.pp
    vt = VolumeTable()
    if t == 1:
        return vt
    m, tokens, h = micro_batches, layout.micro_batch_size * seq_len, cfg.hidden_size
    full = tokens * h * act_bytes  # one [b, s, h] activation, whole sequence
    layers = stage_layers(cfg, p, stage, layout.virtual_stages)
    # Full recompute re-runs the layer forward up to the last tensor the backward needs (torch's non-reentrant
    # checkpoint stops early): every collective but the MLP's final row-parallel reduction.
    again = layout.recompute == "full"
    # ... unless a post-norm follows the MLP (OLMo 2, Gemma): the backward needs its input, the reduced output
    outs = again * (2 if cfg.post_norm else 1)
    if sp:
        # fwd in x2, bwd of row out x2, bwd re-gather of the column inputs x2 (they keep only their shard)
        vt.add("all_gather", "tp", t, full, m * layers * (6 + 2 * again))
        vt.add("reduce_scatter", "tp", t, full, m * layers * (4 + outs))       # fwd row out x2, bwd of in x2
    else:
        vt.add("all_reduce", "tp", t, full, m * layers * (4 + outs))
    moe = moe_layers(cfg, p, stage, layout.virtual_stages)
    if moe:  # the router's top-k weights (and under SP its expert indices) enter the TP region with the tokens
        weights = tokens * cfg.num_experts_per_tok * act_bytes
        if sp:  # and the MoE MLP gathers its input itself: no column layer re-gathers it in the backward
            vt.add("all_gather", "tp", t, full, -m * moe)
            vt.add("all_gather", "tp", t, weights, m * moe * (1 + again))
            vt.add("all_gather", "tp", t, weights // act_bytes * 8, m * moe * (1 + again))  # int64 indices
            vt.add("reduce_scatter", "tp", t, weights, m * moe)
        else:
            vt.add("all_reduce", "tp", t, weights, m * moe)
    if moe and sp and stage == p - 1 and cfg.output_router_logits and (cfg.router_aux_loss_coef
                                                                     or cfg.router_z_loss_coef):
        # the router loss: every MoE layer's statistics summed over the tp shards (fp32 counts, probability sums
        # per expert, one z sum per layer), once per forward (models/kinds/moe.py router_losses)
        vt.add("all_reduce", "tp", t, (2 * cfg.num_experts + moe) * 4, m)
    if stage == 0:  # vocab-parallel embedding
        if sp:
            vt.add("reduce_scatter", "tp", t, full, m)
            vt.add("all_gather", "tp", t, full, m)
        else:
            vt.add("all_reduce", "tp", t, full, m)
    if stage == p - 1:  # the head and the vocab-parallel loss, fused or not (plan/head.py)
        add_head_volume(vt, cfg, t, sp, tokens, act_bytes, m, fused_loss)
    if cfg.qk_norm == "full":  # OLMo 2: the q/k norms' sums of squares (2 fp32 per token), forward and backward
        vt.add("all_reduce", "tp", t, tokens * 2 * 4, m * layers * (2 + again))
    count = stage_params(cfg, t, p, stage, layout.virtual_stages, vocab_padding_multiple)
    # partial gradients of replicated parameters: under SP all of them; without SP only per-head q/k norms
    partial = count.sequence_parallel if sp else (layers * 2 * cfg.head_dim if cfg.qk_norm == "head" else 0)
    if partial:
        vt.add("all_reduce", "tp", t, partial * grad_bytes)
    if cfg.num_kv_heads < t and layers:  # gather each qkv gradient (payload: the gathered, t x local)
        d = local_dims(cfg, t)
        qkv_out = d.q + 2 * d.kv
        vt.add("all_gather", "tp", t, t * qkv_out * h * grad_bytes, layers)
        if cfg.qkv_bias:
            vt.add("all_gather", "tp", t, t * qkv_out * grad_bytes, layers)
        if cfg.qk_norm == "full":  # k_norm's weight holds the replicated heads too
            vt.add("all_gather", "tp", t, t * d.kv * grad_bytes, layers)
    return vt


def ring_layer_volume(cfg: ModelConfig, layout: Layout, seq_len: int, act_bytes: int) -> dict:
    """Ring attention's sends per layer, micro-batch and cp rank (tpzoo.parallel.ring_attention): forward cp-1
    K|V blocks in the activation dtype; backward cp-1 K|V blocks and cp dK|dV blocks in fp32 (or wider). A block is
    this rank's keys and values: 2 * b * (seq_len / cp) * kv features. {"forward"|"backward": (calls, bytes)}."""
    c = layout.cp
    if c == 1:
        return {"forward": (0, 0), "backward": (0, 0)}
    elems = 2 * layout.micro_batch_size * (seq_len // c) * local_dims(cfg, layout.tp).kv
    acc = max(act_bytes, 4)
    return {"forward": (c - 1, (c - 1) * elems * act_bytes),
            "backward": (2 * c - 1, (c - 1) * elems * act_bytes + c * elems * acc)}


def moe_layer_volume(cfg: ModelConfig, layout: Layout, seq_len: int, act_bytes: int) -> VolumeTable:
    """Expert-parallel all-to-alls of one MoE layer and micro-batch on one rank (models/kinds/moe.py), T = b * seq_len
    tokens on the tp rank (the full sequence under SP too: tokens enter the TP region first), k experts each.
    Forward: 1 all_to_all of the E per-expert counts (int64), the T*k rows of h elements dispatched, and the
    rows this rank's experts computed sent back; backward: the two row exchanges again, reversed. A call's
    payload is its input: the dispatch and the backward of the return send T*k rows exactly, the return and the
    backward of the dispatch the rows this rank received (T*k in expectation; summed over the ep group, exact).
    Full recomputation re-runs the forward's three. Sent: (ep-1)/ep of the rows in expectation."""
    ep = layout.ep
    vt = VolumeTable()
    again = layout.recompute == "full"
    rows = layout.micro_batch_size * seq_len * cfg.num_experts_per_tok
    vt.add("all_to_all", "ep", ep, cfg.num_experts * 8, 1 + again)
    vt.add("all_to_all_v", "ep", ep, rows * cfg.hidden_size * act_bytes, 4 + 2 * again)
    return vt


def moe_layers(cfg: ModelConfig, pp: int, stage: int, virtual_stages: int = 1) -> int:
    """MoE layers on pipeline stage `stage` (all its chunks)."""
    return sum(cfg.is_moe_layer(i) for lo, hi in stage_chunks(cfg, pp, stage, virtual_stages) for i in range(lo, hi))
