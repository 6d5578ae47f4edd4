"""Plan costs of multi-head latent attention, the "mla" token mixer (models/mla.py LatentAttention; DeepSeek-V3,
Kimi K2, Moonlight), tested against that module (tests/test_plan_kinds.py).

On one tp rank with Hl = heads / tp, qk = qk_nope_head_dim + qk_rope_head_dim, v = v_head_dim, ranks qr
(q_lora_rank; None: one q_proj) and kvr (kv_lora_rank): the down projections q_a_proj [qr, h] and
kv_a_proj_with_mqa [kvr + rope, h] and their RMSNorms are replicated (their gradients partial under SP, like a
norm's: each rank computes them on its own tokens, its sequence shard under SP); q_b_proj [Hl qk, qr] (or q_proj
[Hl qk, h]) and kv_b_proj [Hl (nope + v), kvr] are column-parallel by heads, o_proj [h, Hl v] row-parallel.
Kept for the backward per token of the shard: x (the down projections' input), each latent norm's saved tensors
and the normalized latent the up projection keeps (its SP entry gathers the latents, not x); per token of the full
sequence (this rank's heads): q and k after the concatenation with the shared rotary key (e Hl qk each), kv_b's
output (v is a view of it), the attention output and its fp32 log-sum-exp (flash or memory-efficient SDPA,
o_proj reads the output in place). The CPU's SDPA has no fused kernel for v != qk: its math path keeps fp32 q, k, v
and the [Hl, s, s] probabilities instead, and o_proj a copy of the output ("reference" kernels).
Collectives (tp > 1): the column entries of the two latents and of the rotary key (without SP: all-reduces of
their gradients; with SP: all-gathers of the latents, qr + kvr wide, and of the rope-wide key, and their
conjugates), o_proj's exit; under cp ring attention sends K|V of Hl (qk + v) features per token.
Cache (decoding): the normalized latent and the rotated key, kvr + rope per token, on every tp rank.
"""
from __future__ import annotations

from tpzoo.parallel.dims import ParallelLayoutError

from ..costs import Collective, Matmul, Weights, register_cost
from .attention import mean_keys


class _Shape:
    """MLA's sizes from the config: the `mla` sub-config (models/mla.py MLAConfig's fields)."""

    def __init__(self, cfg, tp: int):
        m = mla_config(cfg)
        self.h, self.heads = cfg.hidden_size, getattr(m, "num_heads", None) or cfg.attention.num_heads
        self.local = self.heads // tp
        self.qr, self.kvr = m.q_lora_rank, m.kv_lora_rank
        self.nope, self.rope, self.v = m.qk_nope_head_dim, m.qk_rope_head_dim, m.v_head_dim
        self.qk = self.nope + self.rope
        # biases: the building block's attention_bias (all three), or as the "mla" kind reads them, the attention
        # sub-config's qkv_bias (q_a_proj, kv_a_proj_with_mqa) and out_bias (o_proj)
        both = getattr(m, "attention_bias", None)
        self.in_bias = bool(cfg.attention.qkv_bias if both is None else both)
        self.out_bias = bool(cfg.attention.out_bias if both is None else both)


def mla_config(cfg):
    """The latent attention's settings: ModelConfig.mla (the sub-config issue 32 phase 2 adds, with MLAConfig's
    field names)."""
    m = getattr(cfg, "mla", None)
    if m is None:
        raise ParallelLayoutError("an 'mla' layer needs the model config's mla settings (ModelConfig.mla)")
    return m


def latent_norm_saved(width: int, stored: int, e: int, kernels: str) -> int:
    """Bytes per token an RMSNorm over a latent of `width` saves; `stored`: the width of the tensor the latent is a
    view of (kv_a's output also holds the rotary key). Torch reference: an fp32 copy of the input (in fp32 the
    input's whole storage itself), the row statistic and the normalized tensor before the weight; fused: the
    input (made contiguous) and the statistic."""
    if kernels != "reference":
        return e * width + 4
    return (4 * stored if e == 4 else 4 * width) + 4 + e * width


@register_cost("mla")
class MLACost:
    @staticmethod
    def plan_weights(cfg, layer, at) -> Weights:
        s = _Shape(cfg, at.tp)
        h, b, ob = s.h, s.in_bias, s.out_bias
        if s.qr is None:
            q, q_rep, q_tensors = h * s.local * s.qk, 0, 1
        else:  # q_a_proj (+ bias) and q_a_layernorm replicated, q_b_proj split
            q_rep = h * s.qr + (s.qr if b else 0) + s.qr
            q, q_tensors = q_rep + s.qr * s.local * s.qk, 3 + b
        kv_rep = h * (s.kvr + s.rope) + (s.kvr + s.rope if b else 0) + s.kvr
        kv = kv_rep + s.kvr * s.local * (s.nope + s.v)
        out = s.local * s.v * h + (h if ob else 0)
        return Weights(numel=q + kv + out, tensors=q_tensors + 3 + b + 1 + ob,
                       partial_sp=q_rep + kv_rep + (h if ob else 0))

    @staticmethod
    def plan_matmuls(cfg, layer, at) -> list:
        s = _Shape(cfg, at.tp)
        if s.qr is None:
            q = [Matmul("q_proj", s.local * s.qk, s.h)]
        else:
            q = [Matmul("q_a_proj", s.qr, s.h, shard=True, fp8=False), Matmul("q_b_proj", s.local * s.qk, s.qr)]
        return q + [Matmul("kv_a_proj_with_mqa", s.kvr + s.rope, s.h, shard=True, fp8=False),
                    Matmul("kv_b_proj", s.local * (s.nope + s.v), s.kvr), Matmul("o_proj", s.h, s.local * s.v)]

    @staticmethod
    def plan_mixing_flops(cfg, layer, at, seq_len: int) -> float:
        """Scores over qk and values over v: 2 * keys * (qk + v) per head and query, causal."""
        s = _Shape(cfg, at.tp)
        return 2 * mean_keys(seq_len, None) * s.local * (s.qk + s.v)

    @staticmethod
    def plan_activations(cfg, layer, at, micro_batch: int, seq_len: int) -> int:
        if at.recompute == "full":
            return 0
        s, e, k = _Shape(cfg, at.tp), at.act_bytes, at.kernels
        tokens, hl = micro_batch * seq_len, s.local
        shard = e * s.h + latent_norm_saved(s.kvr, s.kvr + s.rope, e, k) + e * s.kvr
        if s.qr is not None:
            shard += latent_norm_saved(s.qr, s.qr, e, k) + e * s.qr
        inputs = e * hl * (2 * s.qk + s.nope + s.v)  # q, k and kv_b's output (v is a view of it)
        if k == "reference" and s.qk != s.v:  # CPU math SDPA: fp32 q, k, v, the probabilities; o_proj's own copy
            core = 4 * hl * (2 * s.qk + s.v) * tokens + 4 * hl * seq_len * tokens
            full = (inputs if at.recompute == "selective" else 0) * tokens + core * (at.recompute != "selective")
            full += e * hl * s.v * tokens
        else:  # flash / memory-efficient: q, k, v, the output (o_proj's input in place), the log-sum-exp
            full = (inputs + e * hl * s.v + (4 * hl if at.recompute != "selective" else 0)) * tokens
        return full + shard * tokens // at.sp_div

    @staticmethod
    def plan_collectives(cfg, layer, at, tokens: int) -> list:
        if at.tp == 1:
            return []
        s, e = _Shape(cfg, at.tp), at.act_bytes
        full = tokens * s.h * e
        latents = [s.kvr] + ([s.qr] if s.qr is not None else [])
        entries = [tokens * w * e for w in latents] + [tokens * s.rope * e]  # each enters the TP region alone
        if s.qr is None:
            entries.append(full)  # q_proj's input: x itself
        if at.sequence_parallel:
            out = [Collective("all_gather", "tp", p) for p in entries]
            out += [Collective("reduce_scatter", "tp", p, phase="backward") for p in entries]
            # the column layers' inputs gathered again for their weight gradients (not the rotary key: no weight)
            out += [Collective("all_gather", "tp", p, phase="regather") for p in entries[:len(latents)]]
            if s.qr is None:
                out.append(Collective("all_gather", "tp", full, phase="regather"))
            return out + [Collective("reduce_scatter", "tp", full),
                          Collective("all_gather", "tp", full, phase="backward")]
        return ([Collective("all_reduce", "tp", p, phase="backward") for p in entries]
                + [Collective("all_reduce", "tp", full)])

    @staticmethod
    def plan_context_features(cfg, layer, at) -> int:
        s = _Shape(cfg, at.tp)
        return s.local * (s.qk + s.v)  # K and V of every local head (the rotary key broadcast): one transfer

    @staticmethod
    def plan_rotary(cfg, layer):
        """The kind's RotarySpec (its rope width, the attention sub-config's theta and scaling): a table shared with
        any attention layer of the same spec; none on a NoPE layer (Kimi Linear)."""
        from tpzoo.models.kinds.mla import LatentAttention

        spec = LatentAttention.rotary_of(cfg, layer)
        return None if spec is None else (spec, spec.dim)

    @staticmethod
    def plan_cache_bytes(cfg, layer, at, batch: int, length: int) -> int:
        s = _Shape(cfg, at.tp)
        return batch * length * (s.kvr + s.rope) * at.act_bytes
