"""Token mixer "sparse_mla": DeepSeek Sparse Attention (DeepSeek-V3.2, GLM-5): multi-head latent attention
(mla.py, unchanged: its projections, rotary, latent cache and TP split) whose queries each attend only to the
index_topk keys a lightning indexer chooses (sparse_mla_indexer.py: its scoring, the exact top-k, the KL loss).

    q, latent, k_rope         as MLA
    selected[t, s]            top-k of I(t, s) over the keys query t sees (causal, its document)
    out = o_proj(softmax(q k^T * scale, masked to selected) v)

GLM-5's layers whose HF indexer_types say "shared" hold no indexer: they attend to the keys the nearest earlier
"full" layer selected in the same forward (the Context carries it, per source layer, so a recomputed block finds
its own source's). The attention runs on the selection as a boolean mask over every key (exact on any device,
memory s x keys booleans per sequence; FlashMLA's sparse kernels would gather the k keys instead: not here).

Settings: cfg.mla (the attention) and cfg.sparse_mla (SparseMLAConfig: index_topk, index_n_heads, index_head_dim,
the indexer's rotary layout, indexer_types, the KL loss's scale).

TP split: MLA's (down projections replicated, q_b_proj / kv_b_proj column-parallel by heads, o_proj row-parallel);
the indexer replicated, scoring the queries of the tokens this rank holds (its sequence shard under SP).
What crosses ranks, beyond MLA's own collectives: under SP the indexer's keys (index_head_dim per token) are
all-gathered over tp (their gradient reduce-scattered when the indexer trains) and so is the selection (s x keys
booleans), which every rank's heads need for all the queries; with the KL loss the heads' probabilities [s, keys]
are reduce-scattered (SP) or all-reduced over tp. Context parallelism (cp > 1) all-gathers the keys, not a ring:
each rank gathers every rank's normalized latent, rotated shared key and indexer key (kv_lora_rank +
qk_rope_head_dim + index_head_dim numbers per token; backward: the latent's and key's gradients reduce-scattered),
so its queries (its two load-balanced chunks) select among and attend to all the keys of the sequence, and
kv_b_proj expands the whole sequence's latents on every cp rank (the price of sending 576 + 128 numbers per token
for DeepSeek-V3.2 instead of the expanded keys' heads/tp x 320). Megatron-Core's DSA splits cp the same way
(all-gather); ring and a2a modes are not used by this kind.
Cache (`SparseLatentCache`): MLA's latent cache (normalized latent, rotated shared key) plus the indexer's rotated
keys, index_head_dim per token (a shared layer keeps no indexer keys): 576 + 128 numbers per token and layer for
DeepSeek-V3.2, replicated on each tp rank. Decoding runs without SP and at cp = 1, as MLA.

Parameter names are transformers' (DeepseekV32Attention / GlmMoeDsaAttention: MLA's and indexer.{wq_b, wk, k_norm,
weights_proj}).
"""
from __future__ import annotations

import dataclasses

import torch
import torch.nn as nn
import torch.nn.functional as F

from tpzoo.errors import ConfigError
from tpzoo.parallel import ParallelLayoutError, gather_from_sequence
from tpzoo.parallel.ring_attention import local_positions
from tpzoo.parallel.ulysses import gathered_order

from ..config import ModelConfig
from ..inputs import Context
from ..layout import ModelLayout
from ..registry import register_token_mixer
from . import sparse_mla_hf
from .mla import LatentAttention, LatentCache
from .sparse_mla_indexer import IndexerLoss, LightningIndexer, attention_target, reduce_target, topk_mask, trained_kl

SHARED = "sparse_mla"  # the Context's key of a layer's selection, which later "shared" layers reuse


class SparseLatentCache(LatentCache):
    """MLA's latent cache plus the indexer's keys [b, max_length, index_head_dim] (None: a shared layer)."""

    def __init__(self, max_length: int, index_keys: bool):
        super().__init__(max_length)
        self.has_keys, self.index_keys = index_keys, None

    def update_index(self, keys: torch.Tensor) -> torch.Tensor:
        """Store the indexer keys of the tokens update() just added; return those of every token so far."""
        past = self.length - keys.shape[1]
        if self.index_keys is None:
            self.index_keys = keys.new_empty(keys.shape[0], self.max_length, keys.shape[2])
        self.index_keys[:, past:self.length] = keys
        return self.index_keys[:, :self.length]


class SparseCore(nn.Module):
    """softmax(q k^T * scale) v over the selected keys (mask [b, 1, s, T], True: attended): parameterless, what
    selective recomputation wraps."""

    def __init__(self, scale: float):
        super().__init__()
        self.scale = scale

    def forward(self, q, k, v, mask):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=self.scale)

    def logit_pairs(self, q, k, v, mask):
        """(q, k, the pairs that meet [b, s, T], scale): MuonClip's logits (tpzoo/train/qk_clip.py) are those of
        the selected keys; every key of the sequence is on this rank (cp gathers them)."""
        return q, k, mask[:, 0], self.scale

    def extra_repr(self) -> str:
        return f"scale={self.scale}"


@register_token_mixer("sparse_mla")
class SparseLatentAttention(LatentAttention):
    """MLA of layer `layer` with DeepSeek Sparse Attention's indexer (or a shared layer's reuse of an earlier
    one's selection): [b, s(/tp under SP), hidden] in and out."""
    hf_tensor_maps = staticmethod(sparse_mla_hf.hf_tensor_maps)
    aux_rules = (IndexerLoss(),)

    def __init__(self, cfg: ModelConfig, layer: int, layout: ModelLayout):
        d = cfg.sparse_mla
        if d is None:
            raise ConfigError("token mixer 'sparse_mla' needs the model config's sparse_mla settings")
        if d.indexer_types is not None and len(d.indexer_types) != cfg.num_layers:
            raise ConfigError(f"sparse_mla.indexer_types has {len(d.indexer_types)} entries for {cfg.num_layers} "
                              f"layers")
        super().__init__(cfg, layer, layout)
        self.cfg, self.d, self.layer = cfg, d, layer
        self.source = d.source_layer(layer)
        if self.source != layer and cfg.token_mixer(self.source) != "sparse_mla":
            raise ConfigError(f"sparse_mla layer {layer} shares the top-k of layer {self.source}, which is a "
                              f"{cfg.token_mixer(self.source)!r} layer")
        if self.source == layer:
            self.indexer = LightningIndexer(cfg, layout)
        # keep the selection for the later layers that reuse it
        self.lends = any(d.source_layer(j) == layer for j in range(layer + 1, cfg.num_layers)
                         if cfg.token_mixer(j) == "sparse_mla")
        self.core = SparseCore(self.core.local.scale if hasattr(self.core, "local") else self.core.scale)

    def new_cache(self, batch: int, max_length: int) -> SparseLatentCache:
        return SparseLatentCache(max_length, self.source == self.layer)

    @staticmethod
    def run_settings(cfg: ModelConfig, run, lora: bool = False) -> ModelConfig:
        """cfg with a training run's indexer loss (--dsa-indexer-loss-scale, --dsa-indexer-sparse-loss: 0 keeps the
        indexers frozen); refused for a model without sparse attention, and under LoRA (the indexers are base
        weights, frozen with the rest)."""
        scale, sparse = run.dsa_indexer_loss_scale, run.dsa_indexer_sparse_loss
        if cfg.sparse_mla is None:
            if scale or sparse:
                raise ConfigError(f"--dsa-indexer-loss-scale {scale:g} / --dsa-indexer-sparse-loss: this model has "
                                  f"no DeepSeek Sparse Attention layer (DeepSeek-V3.2, GLM-5)")
            return cfg
        if lora and scale:
            raise ConfigError(f"--dsa-indexer-loss-scale {scale:g} with LoRA: the indexers are base weights, which a "
                              f"LoRA run keeps frozen; train every weight to train them")
        return cfg.replace(sparse_mla=dataclasses.replace(cfg.sparse_mla, indexer_loss_scale=scale,
                                                          sparse_loss=sparse))

    @staticmethod
    def reads_layer(cfg: ModelConfig, layer: int) -> int:
        """The layer whose selection this one attends with (itself, or a GLM-5 shared layer's source): a pipeline
        stage must hold both (ModelConfig.reads_layer)."""
        return cfg.sparse_mla.source_layer(layer)

    @staticmethod
    def check_parallel(cfg: ModelConfig, layer: int, tp: int, cp: int = 1, ep: int = 1) -> None:
        """ParallelLayoutError where the heads cannot split over tp (MLA's check; the indexer is replicated)."""
        if cfg.attention.num_heads % tp:
            raise ParallelLayoutError(f"tp={tp} does not divide num_heads={cfg.attention.num_heads}")

    # -- forward ----------------------------------------------------------------------------------------------
    def forward(self, x, ctx: Context, cache: SparseLatentCache | None = None):
        layout, dims = self.layout, self.layout.dims
        if cache is not None and (layout.split_sequence or dims.cp > 1):
            raise ConfigError("sparse latent attention decodes with a cache without sequence parallelism, at cp=1")
        q, q_latent = self.queries(x, ctx)
        latent, k_rope = self.latents(x)
        k_rope = self.shared_key(k_rope, ctx)  # [b, s, rope]: the whole sequence of this cp rank
        if dims.cp > 1:  # every rank's keys (kv_b_proj's SP entry then gathers the latents over tp)
            latent = gather_from_sequence(latent, -2, dims.cp_group)
            k_rope = gather_from_sequence(k_rope, -2, dims.cp_group)
        past = 0
        if cache is not None:
            latent, k_rope, past = cache.update(latent, k_rope)
        orders = self._key_orders(q.shape[2])
        k, v = self.keys_values(latent, k_rope, *orders)
        positions = self._query_positions(ctx, q.shape[2], past, k.device)  # [s] of q's rows
        visible = self._visible(ctx, positions, k.shape[2])                 # [b or 1, s, T]
        if self.source == self.layer:
            selected, kl = self._select(x, q_latent, ctx, cache, orders[1], visible, q, k)
            if self.lends:
                ctx.shared[(SHARED, self.layer)] = selected
        else:
            if (SHARED, self.source) not in ctx.shared:
                raise ConfigError(f"sparse_mla layer {self.layer} reuses layer {self.source}'s top-k, which this "
                                  f"pipeline stage does not hold: start the stage at layer {self.source} or earlier "
                                  f"(--pp-boundaries)")
            selected, kl = ctx.shared[(SHARED, self.source)], None
        out = self.output(self.core(q, k, v, selected.unsqueeze(1)))
        if kl is not None:
            ctx.record(self.layer, IndexerLoss.key, torch.stack(kl))
        return out

    def keys_values(self, latent, k_rope, kv_order=None, rope_order=None):
        """MLA's keys and values, each part put in the sequence's natural order first under cp (the gathered
        latents and rotary keys arrive in rank order)."""
        if kv_order is None:
            return super().keys_values(latent, k_rope)
        kv = self.kv_b_proj(latent).index_select(1, kv_order)
        return self.split_kv(kv, k_rope.index_select(1, rope_order))

    def _key_orders(self, s: int):
        """(natural order of kv_b_proj's output, of the rotary key) under cp: the latents are gathered over cp
        then (kv_b_proj's SP entry) over tp, the rotary key over tp (inside the TP region) then cp."""
        dims = self.layout.dims
        if dims.cp == 1:
            return None, None
        chunk, device = s // 2, self.kv_b_proj.weight.device
        _, rope_natural = gathered_order(chunk, dims.cp, device)
        if not self.layout.split_sequence:
            return rope_natural, rope_natural
        # tp rank t's shard of cp rank c's tokens, gathered over cp first: order (t, c) -> t-major
        shards = [local_positions(chunk, dims.cp, c, "cpu").chunk(dims.tp) for c in range(dims.cp)]
        order = torch.cat([shards[c][t] for t in range(dims.tp) for c in range(dims.cp)])
        return torch.argsort(order).to(device), rope_natural

    def _query_positions(self, ctx: Context, s: int, past: int, device) -> torch.Tensor:
        """Each query row's index in the sequence's key order (natural): its load-balanced place under cp."""
        dims = self.layout.dims
        if dims.cp > 1:
            return local_positions(s // 2, dims.cp, dims.cp_rank, device)
        return torch.arange(past, past + s, device=device)

    def _visible(self, ctx: Context, positions, keys: int) -> torch.Tensor:
        """Boolean [b or 1, s, keys]: causal, within the query's document (packed batches)."""
        visible = (torch.arange(keys, device=positions.device) <= positions.unsqueeze(1)).unsqueeze(0)
        if ctx.docs is not None:
            ids = ctx.docs.ids.to(positions.device)
            visible = visible & (ids[:, positions].unsqueeze(2) == ids[:, :keys].unsqueeze(1))
        return visible

    def _own(self, t: torch.Tensor, dim: int) -> torch.Tensor:
        """This rank's sequence shard of t (SP), or t."""
        return t.chunk(self.layout.tp, dim=dim)[self.layout.dims.tp_rank] if self.layout.split_sequence else t

    def _select(self, x, q_latent, ctx: Context, cache, key_order, visible, q, k):
        """(selected [b, s, T] for every query row of q, (KL sum, rows) when the indexer trains, else None)."""
        layout, dims, d = self.layout, self.layout.dims, self.d
        trains = d.indexer_loss_scale > 0 and self.training and torch.is_grad_enabled()
        cos, sin = (self._own(t, -2) for t in ctx.rotary[self.rotary])  # the tables of this rank's tokens
        with torch.set_grad_enabled(trains):
            x, q_latent = x.detach(), q_latent.detach()  # the indexer learns from its own loss only
            keys = self.indexer.keys(x, cos, sin)
            if layout.split_sequence:
                keys = gather_from_sequence(keys, -2, dims.tp_group)
            if dims.cp > 1:
                keys = gather_from_sequence(keys, -2, dims.cp_group).index_select(1, key_order)
            if cache is not None:
                keys = cache.update_index(keys)
            iq, w = self.indexer.queries(q_latent, x, cos, sin)
        with torch.no_grad():  # (the KL recomputes them with gradient, block by block: trained_kl)
            scores = self.indexer.scores(iq, w, keys)  # [b, own rows, T]
        own_visible = self._own(visible, 1)
        selected = topk_mask(scores, own_visible, d.index_topk)
        if layout.split_sequence:  # every rank's heads attend from all the queries
            selected = gather_from_sequence(selected.to(torch.uint8), 1, dims.tp_group).bool()
        if not trains:
            return selected, None
        with torch.no_grad():  # the target: the main attention's distribution over every head
            allowed = selected if d.sparse_loss else visible.expand_as(selected)
            target = reduce_target(attention_target(q, k, self.core.scale, allowed), layout)
        allowed = self._own(allowed, 1)
        rows = ctx.token_mask.reshape(-1) if ctx.token_mask is not None else None
        return selected, trained_kl(self.indexer, iq, w, keys, target, allowed, rows)

    # -- sizes, without building --------------------------------------------------------------------------------
    @staticmethod
    def num_parameters(cfg: ModelConfig, layer: int, active: bool = False) -> int:
        mla = LatentAttention.num_parameters(cfg, layer, active)
        d = cfg.sparse_mla
        if not d.has_indexer(layer):
            return mla
        h, q_in = cfg.hidden_size, cfg.mla.q_lora_rank or cfg.hidden_size
        return mla + q_in * d.index_n_heads * d.index_head_dim + h * d.index_head_dim + 2 * d.index_head_dim \
            + h * d.index_n_heads

    @staticmethod
    def sequence_flops(cfg: ModelConfig, layer: int, seq_len: int) -> int:
        """The attention over min(index_topk, seq_len) keys (the model's work: this kind's masked path computes
        every causal score), and the indexer's scores over every key (2 H D + 2 H per query and key), causal not
        discounted."""
        m, d = cfg.mla, cfg.sparse_mla
        attention = 2 * min(d.index_topk, seq_len) * cfg.attention.num_heads * (m.qk_head_dim + m.v_head_dim)
        indexer = 2 * seq_len * d.index_n_heads * (d.index_head_dim + 1) if d.has_indexer(layer) else 0
        return attention + indexer
