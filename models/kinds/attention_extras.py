"""Extras of softmax attention (models/kinds/attention.py) in the 2024-25 families: q/k norms (Qwen3 and Gemma 3
per head, OLMo 2 over the whole projection width) and soft-capped attention scores (Gemma 2).

OLMo 2's q and k norms normalize over all heads at once, but under tensor parallelism each rank holds only its
heads: the sum of squares is a partial sum that needs one all-reduce over the TP group per layer (q's and k's
sums travel together: 2 fp32 per token) in the forward, and the conjugate all-reduce of their gradients in the
backward. kv heads replicated over several ranks (kv_heads < tp) are counted once: each copy's share is divided
by the number of copies.
"""
from __future__ import annotations

import torch
from torch import nn

from tpzoo.parallel import ShardSpec, mark_parallel
from tpzoo.parallel.mappings import copy_to_tp, reduce_from_tp

from ..config import ModelConfig
from ..layout import ModelLayout
from ..norm import Norm


def make_qk_norms(cfg: ModelConfig, kv_replicas: int, layout: ModelLayout):
    """(q_norm, k_norm) modules for attention.qk_norm "head" (weight [head_dim], replicated) or "full" (weights
    over the q and k widths, split over TP like the q and k heads)."""
    a = cfg.attention
    hd = a.head_dim
    if a.qk_norm == "head":
        # Replicated, but each rank's gradient only covers its own heads: a partial gradient summed over TP
        # (the same reduction as sequence-parallel norms: finish_tp_grads), with or without SP.
        return (Norm(cfg, layout, size=hd, partial_grad=True), Norm(cfg, layout, size=hd, partial_grad=True))
    tp = layout.tp
    q_spec = ShardSpec(0)
    k_spec = ShardSpec(0, parts=(a.num_kv_heads * hd,), replicas=(kv_replicas,), block=hd)
    q_norm = Norm(cfg, layout, size=q_spec.local_size(a.num_heads * hd, tp), partial_grad=False)
    k_norm = Norm(cfg, layout, size=k_spec.local_size(a.num_kv_heads * hd, tp), partial_grad=False)
    mark_parallel(q_norm.weight, q_spec)
    mark_parallel(k_norm.weight, k_spec)
    q_norm.full_width, k_norm.full_width = a.num_heads * hd, a.num_kv_heads * hd
    return q_norm, k_norm


def full_width_qk_norm(q: torch.Tensor, k: torch.Tensor, q_norm: nn.Module, k_norm: nn.Module, kv_replicas: int,
                       group) -> tuple[torch.Tensor, torch.Tensor]:
    """RMSNorm of q [..., local q width] and k [..., local k width] over their full (all-rank) widths."""
    qf, kf = q.float(), k.float()
    sums = torch.stack([qf.pow(2).sum(-1), kf.pow(2).sum(-1) / kv_replicas], dim=-1)
    # forward all-reduce (the full sum), backward all-reduce (every rank's output depends on every rank's input)
    sums = reduce_from_tp(copy_to_tp(sums, group), group)
    q_rstd = torch.rsqrt(sums[..., :1] / q_norm.full_width + q_norm.eps)
    k_rstd = torch.rsqrt(sums[..., 1:] / k_norm.full_width + k_norm.eps)
    # as HF OLMo 2: (weight * x_hat) in fp32, then back to the input dtype
    return (q_norm.weight * (qf * q_rstd)).to(q.dtype), (k_norm.weight * (kf * k_rstd)).to(k.dtype)


def softcapped_attention(q, k, v, mask: torch.Tensor, scale: float | None, cap: float) -> torch.Tensor:
    """softmax(cap * tanh(q k^T * scale / cap) masked) v, heads first ([b, heads, s, d]); kv heads repeated for
    grouped queries (query head i reads kv head i // (heads / kv_heads), as SDPA's enable_gqa)."""
    rep = q.shape[1] // k.shape[1]
    if rep > 1:
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    scores = torch.matmul(q, k.transpose(-1, -2)) * (scale if scale is not None else q.shape[-1] ** -0.5)
    scores = torch.tanh(scores / cap) * cap
    scores = scores.masked_fill(~mask, float("-inf"))
    return torch.matmul(torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype), v)
