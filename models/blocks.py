"""Transformer blocks built only from tpzoo parallel layers. Reads like single-device code; the parallel
layout is in the layer choices (column in, row out), the sequence_parallel flag and the `dims` every block
passes down (its TP size, rank and group)."""
from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F
from einops import rearrange
from torch.utils.checkpoint import checkpoint

from tpzoo import kernels
from tpzoo.errors import ConfigError
from tpzoo.parallel import (ColumnParallelLinear, ParallelDims, ParallelLayoutError, RowParallelLinear, ShardSpec,
                            mark_parallel)
from tpzoo.parallel.ring_attention import ring_attention
from tpzoo.parallel.ulysses import ulysses_attention

from .config import ModelConfig
from .documents import Documents, document_attention
from .qk_norm import full_width_qk_norm, make_qk_norms, softcapped_attention


class Norm(nn.Module):
    """RMSNorm or LayerNorm over the last dim; replicated over TP (its gradient is partial under SP).
    `size` defaults to hidden_size (q/k norms pass head_dim); with cfg.norm_offset (Gemma) the scale is
    (1 + weight), weights starting at 0: the same kernel runs on the offset weight."""

    def __init__(self, cfg: ModelConfig, sequence_parallel: bool, dtype=None, device=None, size: int | None = None):
        super().__init__()
        self.kind, self.eps, self.offset = cfg.norm, cfg.norm_eps, cfg.norm_offset
        size = size or cfg.hidden_size
        self.weight = mark_parallel(nn.Parameter(torch.empty(size, dtype=dtype, device=device)), None,
                                    sequence_parallel)
        self.bias = (mark_parallel(nn.Parameter(torch.empty(size, dtype=dtype, device=device)), None,
                                   sequence_parallel) if cfg.norm == "layernorm" else None)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        if self.weight.device.type == "meta":
            return
        with torch.no_grad():
            self.weight.fill_(0.0 if self.offset else 1.0)
            if self.bias is not None:
                self.bias.zero_()

    def forward(self, x):
        if self.kind == "rmsnorm":
            return kernels.rms_norm(x, 1 + self.weight if self.offset else self.weight, self.eps)
        return kernels.layer_norm(x, self.weight, self.bias, self.eps)


def rope_inv_freq(cfg: ModelConfig) -> torch.Tensor:
    """Inverse frequencies of RoPE, with Llama 3.1 "llama3" scaling when the config asks for it."""
    dim = cfg.rotary_dim
    inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.float64, device="cpu") / dim))
    scaling = cfg.rope_scaling or {}
    kind = scaling.get("rope_type", scaling.get("type"))
    if kind in (None, "default"):
        return inv_freq.float()
    if kind == "linear":
        return (inv_freq / scaling["factor"]).float()
    if kind == "llama3":
        # Long wavelengths are slowed by `factor`, short ones kept, the band between interpolated smoothly.
        factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
        old_len = scaling["original_max_position_embeddings"]
        wavelen = 2 * math.pi / inv_freq
        smooth = (old_len / wavelen - low) / (high - low)
        scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
        between = (wavelen <= old_len / low) & (wavelen >= old_len / high)
        return torch.where(between, (1 - smooth) * inv_freq / factor + smooth * inv_freq, scaled).float()
    raise ConfigError(f"unsupported rope_scaling type {kind!r} (supported: default, linear, llama3)")


def rope_cos_sin(inv_freq: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin of shape [..., s, head_dim // 2] (fp32) for integer positions [..., s]."""
    angles = positions.to(torch.float32).unsqueeze(-1) * inv_freq.to(positions.device)
    return angles.cos(), angles.sin()


class ParallelAttention(nn.Module):
    """Causal self-attention with heads split over TP. Grouped-query attention: kv heads are split when tp
    divides them and replicated (each TP rank keeps the kv head its query heads use) when kv_heads < tp."""

    def __init__(self, cfg: ModelConfig, sequence_parallel: bool, dims: ParallelDims, dtype=None, device=None,
                 layer: int = 0):
        super().__init__()
        self.dims = dims
        tp = dims.tp
        nh, nkv, hd = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        if nh % tp:
            raise ParallelLayoutError(f"tp={tp} does not divide num_heads={nh}")
        if nkv % tp and tp % nkv:
            raise ParallelLayoutError(f"tp={tp} neither divides nor is a multiple of num_kv_heads={nkv}")
        self.kv_replicas = max(1, tp // nkv)
        self.heads, self.kv_heads, self.head_dim = nh // tp, max(1, nkv // tp), hd
        self.sequence_parallel, self.sliding_window = sequence_parallel, cfg.layer_window(layer)
        self.scale = cfg.attn_scale ** -0.5 if cfg.attn_scale else None  # None: SDPA's head_dim ** -0.5
        self.softcap, self.qk_norm = cfg.attn_softcap, cfg.qk_norm
        init = lambda t: nn.init.normal_(t, std=cfg.initializer_range)  # noqa: E731
        # q|k|v fused in one column-parallel matmul; the k and v parts may be replicated head-wise.
        spec = ShardSpec(0, parts=(nh * hd, nkv * hd, nkv * hd), replicas=(1, self.kv_replicas, self.kv_replicas),
                         block=hd)
        self.qkv = ColumnParallelLinear(cfg.hidden_size, (nh + 2 * nkv) * hd, bias=cfg.qkv_bias, shard_spec=spec,
                                        sequence_parallel=sequence_parallel, init_method=init, dtype=dtype,
                                        device=device, dims=dims)
        out_std = cfg.initializer_range / math.sqrt(2 * cfg.num_layers)  # GPT-2's scaled residual init
        self.out = RowParallelLinear(nh * hd, cfg.hidden_size, bias=cfg.out_bias, sequence_parallel=sequence_parallel,
                                     init_method=lambda t: nn.init.normal_(t, std=out_std), dtype=dtype,
                                     device=device, dims=dims)
        if cfg.qk_norm != "none":  # q_norm, k_norm (registered after out: the parameter order of other families stays)
            self.q_norm, self.k_norm = make_qk_norms(cfg, self.kv_replicas, dims, dtype, device)
        self.recompute_core = False
        self.cp_mode = "ring"  # under context parallelism (dims.cp > 1): "ring" or "a2a" (Transformer sets it)

    def forward(self, x, cos, sin, kv_cache=None, docs: Documents | None = None):
        # One matmul enters the TP region for q, k and v (under SP: gathers the sequence, keeps only the shard).
        q, k, v = self.qkv(x).split(
            [self.heads * self.head_dim, self.kv_heads * self.head_dim, self.kv_heads * self.head_dim], dim=-1)
        if self.qk_norm == "full":  # OLMo 2: over all heads' width, spanning the TP ranks
            q, k = full_width_qk_norm(q, k, self.q_norm, self.k_norm, self.kv_replicas, self.dims.tp_group)
        q, k, v = (rearrange(t, "b s (heads d) -> b s heads d", d=self.head_dim) for t in (q, k, v))
        if self.qk_norm == "head":  # Qwen3, Gemma 3: per head, before the rotary
            q, k = self.q_norm(q), self.k_norm(k)
        if cos is not None:  # the rotary kernel takes [b, s, heads, d]; attention wants the heads first
            q, k = _rotate(q, cos, sin), _rotate(k, cos, sin)
        q, k, v = (rearrange(t, "b s heads d -> b heads s d") for t in (q, k, v))
        past = 0
        if kv_cache is not None:
            k, v, past = kv_cache.update(k, v)
        if self.recompute_core and torch.is_grad_enabled():
            ctx = checkpoint(self._core, q, k, v, past, docs, use_reentrant=False)  # the same docs: the same mask
        else:
            ctx = self._core(q, k, v, past, docs)
        return self.out(rearrange(ctx, "b heads s d -> b s (heads d)"))

    def _core(self, q, k, v, past: int, docs: Documents | None = None):
        if self.dims.cp > 1:  # this rank holds 2 of the 2*cp load-balanced chunks of the sequence
            if past:
                raise ConfigError("context parallelism (cp > 1) does not decode with a KV cache: generate at cp=1")
            return self._context_core(q, k, v, docs)
        return self._local_core(q, k, v, past, docs)

    def _context_core(self, q, k, v, docs: Documents | None):
        dims = self.dims
        if self.cp_mode == "a2a":  # the local attention sees whole sequences: the whole documents too
            return ulysses_attention(q, k, v, dims.cp_group, dims.cp, lambda *qkv: self._local_core(*qkv, 0, docs))
        if self.softcap is not None:
            raise ConfigError("attention softcapping (Gemma 2) runs with --cp-mode a2a, not ring")
        return ring_attention(q, k, v, dims.cp_group, dims.ranks("cp"), dims.cp_rank, scale=self.scale,
                              window=self.sliding_window, doc_ids=None if docs is None else docs.ids)

    def _local_core(self, q, k, v, past: int, docs: Documents | None = None):
        if docs is not None:  # a packed batch: attention within each document (models/documents.py)
            return document_attention(q, k, v, docs, scale=self.scale, window=self.sliding_window,
                                      softcap=self.softcap)
        s_q, s_k = q.shape[2], k.shape[2]
        gqa = self.heads != self.kv_heads
        window = self.sliding_window
        if past == 0 and (window is None or s_k <= window) and self.softcap is None:
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa, scale=self.scale)
        # Decoding with a cache, or a sliding window in play: an explicit mask (query i sits at past + i).
        qpos = torch.arange(past, past + s_q, device=q.device).unsqueeze(-1)
        kpos = torch.arange(s_k, device=q.device).unsqueeze(0)
        mask = kpos <= qpos
        if window is not None:
            mask &= qpos - kpos < window
        if self.softcap is not None:  # Gemma 2: scores capped before the mask (SDPA cannot)
            return softcapped_attention(q, k, v, mask, self.scale, self.softcap)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=gqa, scale=self.scale)


def _rotate(x, cos, sin):
    """Rotary on the first 2 * cos.shape[-1] dims of each head; partial rotary (Phi-4-mini) passes the rest."""
    rot = 2 * cos.shape[-1]
    if rot == x.shape[-1]:
        return kernels.apply_rotary(x, cos, sin)
    return torch.cat([kernels.apply_rotary(x[..., :rot], cos, sin), x[..., rot:]], dim=-1)


class ParallelMLP(nn.Module):
    """Column (h -> ffn, gate|up fused for SwiGLU and GeGLU) then row (ffn -> h)."""

    def __init__(self, cfg: ModelConfig, sequence_parallel: bool, dims: ParallelDims, dtype=None, device=None):
        super().__init__()
        ffn, self.activation = cfg.ffn_hidden_size, cfg.activation
        init = lambda t: nn.init.normal_(t, std=cfg.initializer_range)  # noqa: E731
        gated = cfg.gated
        spec = ShardSpec(0, parts=(ffn, ffn)) if gated else None
        self.fc_in = ColumnParallelLinear(cfg.hidden_size, 2 * ffn if gated else ffn, bias=cfg.mlp_bias,
                                          sequence_parallel=sequence_parallel, shard_spec=spec, init_method=init,
                                          skip_bias_add=not gated, dtype=dtype, device=device, dims=dims)
        out_std = cfg.initializer_range / math.sqrt(2 * cfg.num_layers)
        self.fc_out = RowParallelLinear(ffn, cfg.hidden_size, bias=cfg.mlp_bias, sequence_parallel=sequence_parallel,
                                        init_method=lambda t: nn.init.normal_(t, std=out_std), dtype=dtype,
                                        device=device, dims=dims)

    def forward(self, x):
        h = self.fc_in(x)
        if self.activation == "swiglu":  # h = gate|up: packed, so the backward needs no cat of the two halves
            h = kernels.swiglu_packed(h)
        elif self.activation == "geglu_tanh":
            h = kernels.geglu_packed(h)
        else:
            h = kernels.bias_gelu(h, self.fc_in.bias)
        return self.fc_out(h)


class TransformerBlock(nn.Module):
    """Pre-norm (attn_norm, mlp_norm) and/or post-norm (post_attn_norm, post_mlp_norm: the sublayer's output
    normalized before the residual add; OLMo 2 has only these, Gemma 2/3 both) around attention and MLP."""

    def __init__(self, cfg: ModelConfig, sequence_parallel: bool, dims: ParallelDims, dtype=None, device=None,
                 layer: int = 0):
        super().__init__()
        if cfg.pre_norm:
            self.attn_norm = Norm(cfg, sequence_parallel, dtype, device)
        self.attn = ParallelAttention(cfg, sequence_parallel, dims, dtype, device, layer=layer)
        if cfg.pre_norm:
            self.mlp_norm = Norm(cfg, sequence_parallel, dtype, device)
        if cfg.is_moe_layer(layer):
            from .moe import MoELayer

            self.mlp = MoELayer(cfg, sequence_parallel, dims, dtype, device)
        else:
            self.mlp = ParallelMLP(cfg, sequence_parallel, dims, dtype, device)
        if cfg.post_norm:
            self.post_attn_norm = Norm(cfg, sequence_parallel, dtype, device)
            self.post_mlp_norm = Norm(cfg, sequence_parallel, dtype, device)
        self.pre_norm, self.post_norm = cfg.pre_norm, cfg.post_norm
        self.rope = cfg.layer_rope(layer)  # which rotary table this layer uses (Transformer.forward picks it)

    def forward(self, x, cos=None, sin=None, kv_cache=None, docs: Documents | None = None):
        h = self.attn(self.attn_norm(x) if self.pre_norm else x, cos, sin, kv_cache, docs)
        x = x + (self.post_attn_norm(h) if self.post_norm else h)
        h = self.mlp(self.mlp_norm(x) if self.pre_norm else x)
        return x + (self.post_mlp_norm(h) if self.post_norm else h)
