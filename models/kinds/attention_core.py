"""The core of softmax attention, softmax(q k^T * scale) v under the causal (and window, and document) mask: what
runs after the projections and the rotary, heads first ([b, heads, s, d]). Parameterless modules, so activation
recomputation can wrap them (models/recompute.py "selective").

  LocalCore            attention over the tokens this rank holds. Backends: SDPA (the fused flash / efficient
                       kernels where they apply: no cache offset, no window cutting the sequence, no soft-cap), an
                       explicit boolean mask into SDPA (decoding past a cache, a binding window), Gemma 2's
                       soft-capped scores (exact torch math), and packed documents (models/kinds/document_attention.py:
                       FlexAttention with a block mask on CUDA, the exact masked SDPA elsewhere).
  ContextParallelCore  a LocalCore over a sequence split across the cp ranks (each holds 2 of the 2*cp
                       load-balanced chunks): "ring" passes K/V around the ring (tpzoo.parallel.ring_attention),
                       "a2a" exchanges heads for whole sequences and runs the LocalCore on them
                       (tpzoo.parallel.ulysses). It wraps the local core; the local core knows nothing of cp.

Attention sinks (gpt-oss: one learned logit per head joining every row's softmax, models/sinks.py) come in as an
argument, this rank's heads' [heads]: the exact sink core (the block kernels with the sink merged into the
log-sum-exp) locally, FlexAttention's log-sum-exp or the exact masked path for documents, ring attention's merge
under cp ring, and the heads Ulysses hands this rank (ulysses.local_heads) under cp a2a.
"""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from tpzoo.errors import ConfigError
from tpzoo.parallel.ring_attention import ring_attention
from tpzoo.parallel.ulysses import local_heads, ulysses_attention

from ..documents import Documents
from ..sinks import sink_attention
from .attention_extras import softcapped_attention
from .document_attention import document_attention


class LocalCore(nn.Module):
    """scale: of the scores (None: SDPA's head_dim ** -0.5); window: sliding window (None: full causal); softcap:
    Gemma 2's cap on the scores (None: off); gqa: fewer kv heads than query heads (SDPA's enable_gqa)."""

    def __init__(self, scale: float | None, window: int | None, softcap: float | None, gqa: bool):
        super().__init__()
        self.scale, self.window, self.softcap, self.gqa = scale, window, softcap, gqa

    def forward(self, q, k, v, past: int = 0, docs: Documents | None = None, sinks=None):
        """q [b, heads, s_q, d]; k, v [b, kv_heads, s_k, d] (s_k = past + s_q with a cache); query i sits at
        position past + i; sinks [heads]: attention sinks (None: none)."""
        if docs is not None:  # a packed batch: attention within each document
            return document_attention(q, k, v, docs, scale=self.scale, window=self.window, softcap=self.softcap,
                                      sinks=sinks)
        if sinks is not None:
            return sink_attention(q, k, v, sinks, scale=self.scale, window=self.window, past=past)
        s_q, s_k, window = q.shape[2], k.shape[2], self.window
        if past == 0 and (window is None or s_k <= window) and self.softcap is None:
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=self.gqa, scale=self.scale)
        # Decoding with a cache, or a sliding window in play: an explicit mask (query i sits at past + i).
        qpos = torch.arange(past, past + s_q, device=q.device).unsqueeze(-1)
        kpos = torch.arange(s_k, device=q.device).unsqueeze(0)
        mask = kpos <= qpos
        if window is not None:
            mask &= qpos - kpos < window
        if self.softcap is not None:  # Gemma 2: scores capped before the mask (SDPA cannot)
            return softcapped_attention(q, k, v, mask, self.scale, self.softcap)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=self.gqa, scale=self.scale)

    def extra_repr(self) -> str:
        return f"scale={self.scale}, window={self.window}, softcap={self.softcap}"


class ContextParallelCore(nn.Module):
    """`local` over the cp ranks of `dims` in `mode` ("ring" or "a2a")."""

    def __init__(self, local: LocalCore, dims, mode: str):
        super().__init__()
        if mode == "ring" and local.softcap is not None:
            raise ConfigError("attention softcapping (Gemma 2) runs with --cp-mode a2a, not ring")
        self.local, self.dims, self.mode = local, dims, mode

    def forward(self, q, k, v, past: int = 0, docs: Documents | None = None, sinks=None):
        if past:
            raise ConfigError("context parallelism (cp > 1) does not decode with a KV cache: generate at cp=1")
        dims, local = self.dims, self.local
        if self.mode == "a2a":  # the local attention sees whole sequences: the whole documents too
            mine = None if sinks is None else sinks[local_heads(q.shape[1], dims.cp, dims.cp_rank)]
            return ulysses_attention(q, k, v, dims.cp_group, dims.cp, lambda *qkv: local(*qkv, 0, docs, mine))
        return ring_attention(q, k, v, dims.cp_group, dims.ranks("cp"), dims.cp_rank, scale=local.scale,
                              window=local.window, doc_ids=None if docs is None else docs.ids, sinks=sinks)

    def extra_repr(self) -> str:
        return f"cp={self.dims.cp}, mode={self.mode}"


def attention_core(layout, scale: float | None, window: int | None, softcap: float | None, gqa: bool) -> nn.Module:
    """The core for this layout: the local one, wrapped for context parallelism when cp > 1."""
    local = LocalCore(scale, window, softcap, gqa)
    return ContextParallelCore(local, layout.dims, layout.cp_mode) if layout.dims.cp > 1 else local
