"""Plan costs of the "attention" token mixer (models/kinds/attention.py), exact (tests/test_plan_*.py).

On one tp rank, with q = heads/tp * head_dim, kv = local kv heads * head_dim (a replicated kv head when
kv_heads < tp), e = activation bytes: q|k|v one column-parallel matmul [q + 2kv, h], the output row-parallel
[h, q]. Kept for the backward per token: q|k|v's input (this rank's shard under SP: the column layer gathers it
again), the q|k|v buffer (v is a view of it), the rotated q and k (a rotary layer), the core's output and its fp32
log-sum-exp (flash attention: no scores; selective recomputation drops only the log-sum-exp). Collectives: the TP
region's entry and exit (plan/kinds/__init__.py entry_exit), OLMo 2's full-width q/k norm all-reduce (2 fp32 per
token each way), and after the backward the replicated kv heads' gradients gathered and summed.
"""
from __future__ import annotations

from dataclasses import dataclass


from ..costs import Acts, Collective, Matmul, Weights, entry_exit, register_cost


@dataclass(frozen=True)
class Heads:
    """One tp rank's share of an attention layer."""
    q: int          # query features
    kv: int         # key (= value) features, a replicated kv head included
    heads: int


def heads(cfg, tp: int) -> Heads:
    a = cfg.attention
    kv_heads = max(1, a.num_kv_heads // tp)  # each rank keeps one replicated kv head when kv_heads < tp
    return Heads(a.num_heads // tp * a.head_dim, kv_heads * a.head_dim, a.num_heads // tp)


def mean_keys(seq_len: int, window: int | None) -> float:
    """Keys a query attends to on average: causal, within a sliding window of `window`."""
    s, w = seq_len, window
    return (s + 1) / 2 if (w is None or w >= s) else (w * s - w * (w - 1) / 2) / s


def rotates(cfg, layer: int) -> bool:
    """Whether the layer turns q and k (rotary positions; SmolLM3's NoPE layers do not)."""
    return AttentionCost.plan_rotary(cfg, layer) is not None


@register_cost("attention")
class AttentionCost:
    @staticmethod
    def plan_weights(cfg, layer, at) -> Weights:
        a, h, d = cfg.attention, cfg.hidden_size, heads(cfg, at.tp)
        qkv = d.q + 2 * d.kv
        qk = {"none": 0, "head": 2 * a.head_dim, "full": d.q + d.kv}[a.qk_norm]
        numel = h * qkv + d.q * h + (qkv if a.qkv_bias else 0) + (h if a.out_bias else 0) + qk
        replicated = 0
        if a.num_kv_heads < at.tp:  # the q|k|v weight (and bias, and OLMo 2's k norm) holds the copied kv head
            replicated = h * qkv + (qkv if a.qkv_bias else 0) + (d.kv if a.qk_norm == "full" else 0)
        return Weights(numel=numel, tensors=2 + a.qkv_bias + a.out_bias + (2 if a.qk_norm != "none" else 0),
                       partial_sp=h if a.out_bias else 0, partial=qk if a.qk_norm == "head" else 0,
                       replicated=replicated)

    @staticmethod
    def plan_matmuls(cfg, layer, at) -> list:
        h, d = cfg.hidden_size, heads(cfg, at.tp)
        return [Matmul("qkv", d.q + 2 * d.kv, h), Matmul("out", h, d.q)]

    @staticmethod
    def plan_mixing_flops(cfg, layer, at, seq_len: int) -> float:
        """QK^T and AV: 4 * keys * head_dim per head and query (load-balanced chunks under cp: the same mean)."""
        a = cfg.attention
        return 4 * mean_keys(seq_len, a.window(layer)) * heads(cfg, at.tp).heads * a.head_dim

    @staticmethod
    def plan_activations(cfg, layer, at, micro_batch: int, seq_len: int) -> int:
        if at.recompute == "full":
            return 0
        e, d = at.act_bytes, heads(cfg, at.tp)
        full = e * (d.q + 2 * d.kv) + e * d.q + (e * (d.q + d.kv) if rotates(cfg, layer) else 0)
        if at.recompute != "selective":
            full += 4 * d.heads  # the log-sum-exp (selective recomputation recomputes it)
        return Acts(full=full, shard=e * cfg.hidden_size).bytes(micro_batch * seq_len, at.sp_div)

    @staticmethod
    def plan_collectives(cfg, layer, at, tokens: int) -> list:
        out = entry_exit(cfg, at, tokens, tail=False)
        if at.tp == 1:
            return out
        a, h, t = cfg.attention, cfg.hidden_size, at.tp
        if a.qk_norm == "full":  # OLMo 2: the sums of squares over the full width (2 fp32 per token)
            out += [Collective("all_reduce", "tp", tokens * 2 * 4),
                    Collective("all_reduce", "tp", tokens * 2 * 4, phase="backward")]
        if a.num_kv_heads < t:  # finish_tp_grads: each copied tensor's gradient gathered (t x local) and summed
            d = heads(cfg, t)
            qkv = d.q + 2 * d.kv
            e = at.act_bytes
            out.append(Collective("all_gather", "tp", t * qkv * h * e, phase="step"))
            if a.qkv_bias:
                out.append(Collective("all_gather", "tp", t * qkv * e, phase="step"))
            if a.qk_norm == "full":
                out.append(Collective("all_gather", "tp", t * d.kv * e, phase="step"))
        return out

    @staticmethod
    def plan_context_features(cfg, layer, at) -> int:
        """Ring attention's K|V: this rank's kv features for keys and for values."""
        return 2 * heads(cfg, at.tp).kv

    @staticmethod
    def plan_rotary(cfg, layer):
        from tpzoo.models.kinds.attention import Attention

        spec = Attention.rotary_of(cfg, layer)
        return None if spec is None else (spec, spec.dim)

    @staticmethod
    def plan_cache_bytes(cfg, layer, at, batch: int, length: int) -> int:
        """KVCache: keys and values of every token, [b, kv heads / tp, max length, head_dim] each."""
        return 2 * batch * length * heads(cfg, at.tp).kv * at.act_bytes
