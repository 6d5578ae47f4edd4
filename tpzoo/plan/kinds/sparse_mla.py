"""Plan costs of DeepSeek Sparse Attention, the "sparse_mla" token mixer (models/kinds/sparse_mla.py; DeepSeek-V3.2,
GLM-5): multi-head latent attention's costs (plan/kinds/mla.py) plus the lightning indexer's, and the context
parallelism this kind uses (an all-gather of the keys, not MLA's ring).

The indexer (a layer whose own indexer runs; a GLM-5 "shared" layer has none), with H = index_n_heads, D =
index_head_dim, qin = q_lora_rank (or hidden): wq_b [H D, qin], wk [D, h], k_norm (2 D), weights_proj [H, h], all
replicated, run on this rank's tokens (its sequence shard under SP: their gradients partial, like a norm's).
Mixing FLOPs per query: its scores, 2 H (D + 1) per visible key (split with the queries under SP, whole on every
rank without); the attention itself runs on the selection as a mask over every key, so its FLOPs are MLA's (the
model's useful work, what ModelConfig.flops_per_token counts, is over min(index_topk, keys) keys).
Kept for the backward per token of the sequence: the selection mask (1 byte per key, the core's attn_mask); with the
indexer trained (--dsa-indexer-loss-scale), the KL's target (the heads' probabilities, fp32: 4 bytes per key), the
indexer's queries (H D) and fp32 head weights (4 H) per query, its keys and their norm's input (2 D) per key; its
scores are recomputed block by block in the backward (sparse_mla_indexer.trained_kl), never kept whole.
Collectives under SP (tp > 1): the indexer's keys all-gathered over tp (D per token) and the selection (one byte per
query and key, all-gathered); with the indexer trained the heads' probabilities (fp32 [s, keys]) reduce-scattered.
Under cp: the latent, rotary key and indexer key of every token all-gathered over cp (kvr + rope + D per token),
their gradients reduce-scattered; no ring transfer.
Cache: MLA's latent and rotary key plus the indexer's keys, D per token.
"""
from __future__ import annotations

from ..costs import Collective, Matmul, Weights, register_cost
from .attention import mean_keys
from .mla import MLACost, _Shape


class _Indexer:
    def __init__(self, cfg, layer):
        d = cfg.sparse_mla
        self.on = d.has_indexer(layer)
        self.heads, self.dim, self.trains = d.index_n_heads, d.index_head_dim, d.indexer_loss_scale > 0
        self.q_in, self.h = cfg.mla.q_lora_rank or cfg.hidden_size, cfg.hidden_size

    @property
    def numel(self) -> int:
        return (self.q_in * self.heads * self.dim + self.h * self.dim + 2 * self.dim + self.h * self.heads
                if self.on else 0)


@register_cost("sparse_mla")
class SparseMLACost(MLACost):
    @staticmethod
    def plan_signature(cfg, layer) -> tuple:
        return (cfg.sparse_mla.has_indexer(layer),)  # a GLM-5 "shared" layer holds no indexer

    @staticmethod
    def plan_weights(cfg, layer, at) -> Weights:
        ix = _Indexer(cfg, layer)
        extra = Weights(numel=ix.numel, tensors=5, partial_sp=ix.numel) if ix.on else Weights()
        return MLACost.plan_weights(cfg, layer, at) + extra

    @staticmethod
    def plan_matmuls(cfg, layer, at) -> list:
        ix = _Indexer(cfg, layer)
        extra = [Matmul("indexer.wq_b", ix.heads * ix.dim, ix.q_in, shard=True, fp8=False),
                 Matmul("indexer.wk", ix.dim, ix.h, shard=True, fp8=False),
                 Matmul("indexer.weights_proj", ix.heads, ix.h, shard=True, fp8=False)] if ix.on else []
        return MLACost.plan_matmuls(cfg, layer, at) + extra

    @staticmethod
    def plan_mixing_flops(cfg, layer, at, seq_len: int) -> float:
        ix = _Indexer(cfg, layer)
        scores = 2 * mean_keys(seq_len, None) * ix.heads * (ix.dim + 1) / at.sp_div if ix.on else 0.0
        return MLACost.plan_mixing_flops(cfg, layer, at, seq_len) + scores

    @staticmethod
    def plan_activations(cfg, layer, at, micro_batch: int, seq_len: int) -> int:
        mla = MLACost.plan_activations(cfg, layer, at, micro_batch, seq_len)
        if at.recompute == "full":
            return mla
        ix, tokens, keys = _Indexer(cfg, layer), micro_batch * seq_len, seq_len * at.cp
        mask = tokens * keys  # the selection, one byte per query and key
        e = at.act_bytes
        # the KL's target (fp32 per key), what its blocks recompute from (the indexer's queries and fp32 head
        # weights), and its keys with their norm's input
        trained = (4 * keys + ix.heads * ix.dim * e + 4 * ix.heads) * tokens // at.sp_div + 2 * keys * ix.dim * e \
            * micro_batch if ix.on and ix.trains else 0
        return mla + mask + trained

    @staticmethod
    def plan_collectives(cfg, layer, at, tokens: int) -> list:
        out = MLACost.plan_collectives(cfg, layer, at, tokens)
        s, ix, e = _Shape(cfg, at.tp), _Indexer(cfg, layer), at.act_bytes
        if at.tp > 1 and at.sequence_parallel:
            keys = tokens * at.cp  # every key of the sequence (a micro-batch's tokens of this cp rank, times cp)
            if ix.on:
                out.append(Collective("all_gather", "tp", tokens * ix.dim * e // at.tp))
                out.append(Collective("all_gather", "tp", tokens * keys // at.tp))  # the selection
                if ix.trains:
                    out.append(Collective("reduce_scatter", "tp", 4 * tokens * keys))
                    out.append(Collective("reduce_scatter", "tp", tokens * ix.dim * e, phase="backward"))
        elif at.tp > 1 and ix.on and ix.trains:
            out.append(Collective("all_reduce", "tp", 4 * tokens * tokens * at.cp))
        if at.cp > 1:  # (tokens: this cp rank's; the latent is gathered from the SP shard, the two keys after SP's
            # gather over tp)
            gathered = [(tokens // at.sp_div * s.kvr, True), (tokens * s.rope, True)]
            if ix.on:
                gathered.append((tokens * ix.dim, ix.trains))
            for elements, backward in gathered:
                out.append(Collective("all_gather", "cp", elements * e))
                if backward:
                    out.append(Collective("reduce_scatter", "cp", at.cp * elements * e, phase="backward"))
        return out

    @staticmethod
    def plan_context_features(cfg, layer, at) -> int:
        return 0  # no ring: the keys are all-gathered (plan_collectives)

    @staticmethod
    def plan_cache_bytes(cfg, layer, at, batch: int, length: int) -> int:
        ix = _Indexer(cfg, layer)
        return MLACost.plan_cache_bytes(cfg, layer, at, batch, length) + (
            batch * length * ix.dim * at.act_bytes if ix.on else 0)
