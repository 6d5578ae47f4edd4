"""The lightning indexer of DeepSeek Sparse Attention (the "sparse_mla" token mixer, sparse_mla.py), its top-k
selection, and the KL loss that trains it (DeepSeek-V3.2's L_I), as models/aux.py's rule "dsa_indexer".

    q_i      = wq_b(q_latent)               [H, D] per query (q_latent: MLA's q_a_layernorm output, or x)
    k        = k_norm(wk(x))                [D] per key, one head (a LayerNorm with bias)
    w        = weights_proj(x) * H^-0.5     [H] per query
    I(t, s)  = sum_h w[t, h] * relu(q_i[t, h] . k[s]) * D^-0.5      (fp32)
the first qk_rope_head_dim dims of q_i and k rotate with the attention's rotary table (half-split for
DeepSeek-V3.2, interleaved pairs for GLM-5). Each query keeps the index_topk keys of largest I among the keys it
may see (causal, its document), exactly: ties at the k-th score go to the earliest keys (torch.topk's order among
equal scores is unspecified; this one is the same at every layout).

Training: HF runs the indexer without gradient; so does tpzoo by default (its weights frozen). With
SparseMLAConfig.indexer_loss_scale > 0 (--dsa-indexer-loss-scale) its weights train on KL(p || softmax(I)) per
query, p the main attention's probabilities summed over every head (over all tp ranks) and normalized, both over
the keys the query sees (or only its selected ones: sparse_loss), mean over the queries, summed over the layers,
times the scale (Megatron-Core's dsa_indexer_loss_coeff). Its inputs are detached (the indexer learns from this
loss only, the model from the language-model loss only: DeepSeek-V3.2's report), p carries no gradient.

TP: the indexer is replicated (its top-k must be the same on every rank, which a split of its heads would give only
up to the rounding of a sum over ranks); it scores the queries of the tokens this rank holds (all of them
without SP, its sequence shard under SP: then its gradients are partial, summed over tp like a norm's).
"""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from tpzoo import kernels
from tpzoo.parallel import comm

from ..aux import AuxRule
from ..config import ModelConfig
from ..layout import ModelLayout
from ..norm import Norm
from ..rope import apply_rotary_interleaved
from .moe_aux import sequence_total
from .replicated import ReplicatedLinear

KEY = "dsa_indexer"
EPS = 1e-10          # Megatron-Core's clamp of the target probabilities in the KL
BLOCK = 1 << 24      # score elements (queries x heads x keys) computed at once: without gradient, and per block
                     # of the KL, whose backward recomputes them (trained_kl)


class LightningIndexer(nn.Module):
    """The indexer of one layer: wq_b, wk, k_norm, weights_proj (HF's names), replicated over tp."""

    def __init__(self, cfg: ModelConfig, layout: ModelLayout):
        super().__init__()
        d, m = cfg.sparse_mla, cfg.mla
        self.heads, self.dim, self.rope = d.index_n_heads, d.index_head_dim, m.qk_rope_head_dim
        self.interleave = d.rope_interleave
        std = cfg.initializer_range
        self.wq_b = ReplicatedLinear(m.q_lora_rank or cfg.hidden_size, self.heads * self.dim, layout, std=std)
        self.wk = ReplicatedLinear(cfg.hidden_size, self.dim, layout, std=std)
        self.k_norm = Norm(cfg.replace(norm="layernorm", norm_eps=d.k_norm_eps, norm_offset=False), layout,
                           size=self.dim)
        self.weights_proj = ReplicatedLinear(cfg.hidden_size, self.heads, layout, std=std)
        for linear in (self.wq_b, self.wk, self.weights_proj):
            # no LoRA adapter (models/lora.py): the indexer learns from its KL alone, which LoRA runs do not train
            linear.takes_lora = False
        if not d.indexer_loss_scale:  # frozen: HF's indexer runs without gradient
            for p in self.parameters():
                p.requires_grad_(False)

    def _rotate(self, x, cos, sin):
        """Rotary on the first qk_rope_head_dim dims of each head of x [b, s, heads, D]."""
        rot, rest = x.split([self.rope, self.dim - self.rope], dim=-1)
        rot = (apply_rotary_interleaved if self.interleave else kernels.apply_rotary)(rot, cos, sin)
        return torch.cat([rot, rest], dim=-1)

    def keys(self, x, cos, sin) -> torch.Tensor:
        """The indexer's keys [b, s, D] of x [b, s, h] (rotated by the tables of these tokens)."""
        return self._rotate(self.k_norm(self.wk(x)).unsqueeze(2), cos, sin).squeeze(2)

    def queries(self, q_latent, x, cos, sin) -> tuple[torch.Tensor, torch.Tensor]:
        """(queries [b, s, H, D] rotated, head weights [b, s, H] fp32 times H^-0.5)."""
        q = self.wq_b(q_latent).unflatten(-1, (self.heads, self.dim))
        return self._rotate(q, cos, sin), self.weights_proj(x).float() * self.heads ** -0.5

    def scores(self, q, w, k) -> torch.Tensor:
        """I [b, s, T] (fp32) of queries q [b, s, H, D] with weights w [b, s, H] against keys k [b, T, D], in
        transformers' order of operations; without gradient in blocks of queries (the [b, s, H, T] scores of a
        long sequence would not fit at once)."""
        kt = k.float().transpose(-1, -2).unsqueeze(1)  # [b, 1, D, T]
        scale = self.dim ** -0.5

        def block(qb, wb):
            s = F.relu(torch.matmul(qb.float(), kt) * scale)  # [b, s, H, T]
            return torch.matmul(wb.unsqueeze(-2), s).squeeze(-2)

        if torch.is_grad_enabled():
            return block(q, w)
        rows = max(1, BLOCK // max(1, q.shape[0] * self.heads * k.shape[1]))
        return torch.cat([block(q[:, i:i + rows], w[:, i:i + rows]) for i in range(0, q.shape[1], rows)], dim=1)


def topk_mask(scores: torch.Tensor, visible: torch.Tensor, k: int) -> torch.Tensor:
    """Boolean [b, s, T]: the k keys of largest score among the visible ones of each query (all of them when it
    sees fewer), ties at the k-th score broken by position (the earliest keys)."""
    masked = scores.masked_fill(~visible, float("-inf"))
    k = min(k, masked.shape[-1])
    kth = masked.topk(k, dim=-1).values[..., -1:]
    above = masked > kth
    tied = masked == kth
    room = k - above.sum(dim=-1, keepdim=True)
    return (above | (tied & (tied.cumsum(dim=-1) <= room))) & visible


def attention_target(q, k, scale: float, allowed: torch.Tensor) -> torch.Tensor:
    """The main attention's probabilities [b, s, T] (fp32, no gradient) of this rank's heads, summed over them: q
    [b, heads, s, d], k [b, heads, T, d], allowed [b, s, T] (where the softmax runs)."""
    logits = torch.matmul(q.float(), k.float().transpose(-1, -2)) * scale
    return torch.softmax(logits.masked_fill(~allowed.unsqueeze(1), float("-inf")), dim=-1).sum(dim=1)


def indexer_kl(target: torch.Tensor, scores: torch.Tensor, allowed: torch.Tensor, rows: torch.Tensor | None):
    """(sum over the counted query rows of KL(target || softmax(scores)) over the allowed keys, the rows counted).
    target [b, s, T] non-negative (normalized here), scores [b, s, T] with gradient, rows [b * s] (1: counted) or
    None (all)."""
    target = target / target.sum(dim=-1, keepdim=True).clamp_min(EPS)
    logp = torch.log_softmax(scores.masked_fill(~allowed, float("-inf")), dim=-1)
    terms = torch.where(allowed, target * (torch.log(target.clamp_min(EPS)) - logp), 0.0)
    per_row = terms.sum(dim=-1).reshape(-1)
    if rows is None:
        return per_row.sum(), torch.tensor(float(per_row.numel()), device=per_row.device)
    rows = rows.to(per_row.dtype)
    return (per_row * rows).sum(), rows.sum()


def trained_kl(indexer: LightningIndexer, q, w, k, target, allowed, rows):
    """indexer_kl of the scores of queries q [b, s, H, D] (weights w [b, s, H]) against keys k [b, T, D], with
    gradient, in blocks of query rows whose scores each block's backward recomputes (torch.utils.checkpoint): the
    [b, s, H, T] scores, DeepSeek-V3.2's 64 heads times every key, are never kept whole for the backward."""
    b, s = q.shape[:2]
    step = max(1, BLOCK // max(1, b * indexer.heads * k.shape[1]))
    rows = rows.view(b, s) if rows is not None else None
    total = counted = None
    for i in range(0, s, step):
        part = slice(i, i + step)
        r = rows[:, part].reshape(-1) if rows is not None else None

        def block(qb, wb, kb, part=part, r=r):
            return indexer_kl(target[:, part], indexer.scores(qb, wb, kb), allowed[:, part], r)

        kl, n = checkpoint(block, q[:, part], w[:, part], k, use_reentrant=False)
        total, counted = (kl, n) if total is None else (total + kl, counted + n)
    return total, counted


def reduce_target(target: torch.Tensor, layout: ModelLayout) -> torch.Tensor:
    """The heads' sum over every tp rank, for this rank's indexer rows: under SP its sequence shard
    (reduce-scatter along the queries), else all of them (all-reduce)."""
    dims = layout.dims
    if dims.tp == 1:
        return target
    if layout.split_sequence:
        return comm.reduce_scatter(target.contiguous(), dims.tp_group, dim=1)
    return comm.all_reduce(target.contiguous(), dims.tp_group)


def indexer_layers(cfg: ModelConfig) -> int:
    """How many layers of the model run an indexer of their own (those the KL loss averages over)."""
    d = cfg.sparse_mla
    return sum(cfg.token_mixer(i) == "sparse_mla" and d.has_indexer(i) for i in range(cfg.num_layers))


class IndexerLoss(AuxRule):
    """The "dsa_indexer" auxiliary output: each indexer layer records [its KL summed over this rank's counted
    queries (with gradient), the queries counted]; the chunk sums them, the last stage sums the shares of the
    sequence's ranks (tp under SP, cp) and adds scale * layers * KL / queries: the sum over layers of each one's
    mean KL over the queries."""
    key = KEY
    reports = ("dsa_indexer_loss",)

    def size(self, cfg: ModelConfig) -> int:
        return 2

    def trains(self, cfg: ModelConfig) -> bool:
        d = cfg.sparse_mla
        return d is not None and d.indexer_loss_scale > 0 and indexer_layers(cfg) > 0

    def carried(self, cfg: ModelConfig, loss) -> bool:
        return self.trains(cfg) and loss.aux_losses  # (evaluation leaves it out: the layers record none then)

    def reduce(self, cfg: ModelConfig, layout: ModelLayout, total: torch.Tensor) -> tuple:
        kl, rows = sequence_total(total, layout).unbind(0)
        mean = kl / rows.detach().clamp_min(1.0)  # mean KL per (layer, query)
        return cfg.sparse_mla.indexer_loss_scale * indexer_layers(cfg) * mean, {"dsa_indexer_loss": mean.detach()}
