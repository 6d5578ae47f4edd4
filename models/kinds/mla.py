"""Token mixer "mla": multi-head latent attention (DeepSeek-V2/V3, Kimi K2, Moonlight): queries and keys/values
through low-rank latents, one rotary key head shared by all heads, values narrower than queries and keys.

    q   = q_b_proj(q_a_layernorm(q_a_proj(x)))        (or one q_proj when q_lora_rank is None)   [heads, nope | rope]
    c   = kv_a_proj_with_mqa(x) = latent | k_rope     latent -> kv_a_layernorm -> kv_b_proj -> [heads, k_nope | v]
    k   = k_nope | rotary(k_rope) broadcast to every head;   q's rope part rotated alike (DeepSeek's interleaved
          rotary when rope_interleave, models/rope.py), softmax scale qk_head_dim^-0.5 times YaRN's mscale^2
    out = o_proj(attention(q, k, v))                   qk_head_dim = nope + rope, v_head_dim may differ

Settings: cfg.mla (MLAConfig: the latent ranks and head dims, HF's names) and cfg.attention (heads; qkv_bias: the
biases of q_a_proj and kv_a_proj_with_mqa, out_bias: o_proj's, HF's `attention_bias` for both; the rotary's theta
and rope_scaling: YaRN's attention factor multiplies the rotary tables, rotary.py, and its mscale the softmax scale;
no rotary where the model's `position` is "none" (Kimi Linear's NoPE MLA) or `rope_layers` says 0).

TP split (Megatron-Core's): the down projections (q_a_proj, kv_a_proj_with_mqa) and their norms are replicated
(replicated.py): every tp rank computes the latents of the tokens it holds. Without SP those are the whole sequence
and the up projections' entry (copy_to_tp: all-reduce of the latents' gradient in backward) makes the replicated
weights' gradients whole on every rank; under SP each rank holds its sequence shard, so those gradients are partial
(marked `sequence_parallel`, summed over tp like a norm's), and the latents, not x, are what the up projections
all-gather (ColumnParallelLinear's SP entry: q_lora_rank + kv_lora_rank wide instead of hidden). q_b_proj / q_proj
and kv_b_proj are column-parallel by heads, o_proj row-parallel; the rotary key (qk_rope_head_dim per token) enters
the TP region on its own (all-gather under SP, else copy_to_tp).
What crosses ranks per layer: the column entries (three, one of them rope-wide), o_proj's reduction; under cp the
core (attention_core.py, the same as softmax attention's, here without groups) passes K|V blocks around the ring
(K and V of different widths in one transfer) or exchanges heads (a2a).
Cache (`LatentCache`): the normalized latent [b, length, kv_lora_rank] and the rotated shared key [b, length,
qk_rope_head_dim], what transformers caches for this model: 576 numbers per token and layer for DeepSeek-V3,
replicated on each tp rank, where expanded keys and values would hold heads/tp * (192 + 128) = 5,120 at tp 8.
Each step re-expands the cached latents with kv_b_proj (docs/design.md says why). Decoding runs without SP and at
cp = 1, as for the other attention kinds.

Parameter names are transformers' (DeepseekV3Attention's, one to one). LoRA reaches every projection HF PEFT can
target here (q_proj or q_a_proj / q_b_proj, kv_a_proj_with_mqa, kv_b_proj, o_proj): the replicated down
projections take a replicated adapter (tpzoo.parallel.lora). FP8: every projection whose dims allow.
"""
from __future__ import annotations

import math

import torch
import torch.nn as nn
from einops import rearrange

from tpzoo import kernels
from tpzoo.errors import ConfigError
from tpzoo.parallel import (ColumnParallelLinear, ParallelLayoutError, RowParallelLinear, copy_to_tp,
                            gather_from_sequence)

from ..config import ModelConfig
from ..inputs import Context
from ..layout import ModelLayout
from ..norm import Norm
from ..rope import apply_rotary_interleaved, mla_softmax_scale
from ..registry import register_token_mixer
from . import mla_hf
from .attention_core import attention_core
from .replicated import ReplicatedLinear
from .rotary import RotarySpec


class LatentCache:
    """One layer's decoding cache on this rank: the normalized kv latent [b, max_length, kv_lora_rank] and the
    rotated shared key [b, max_length, qk_rope_head_dim], allocated at the first update."""

    def __init__(self, max_length: int):
        self.max_length, self.length = max_length, 0
        self.latent = self.k_rope = None

    def update(self, latent: torch.Tensor, k_rope: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, int]:
        """Append latent [b, s, r] and k_rope [b, s, d]; return those of every token so far and the past length."""
        past, end = self.length, self.length + latent.shape[1]
        if end > self.max_length:
            raise ConfigError(f"latent cache of {self.max_length} tokens cannot take {end} "
                              f"(new_cache(max_length=...))")
        if self.latent is None:
            self.latent = latent.new_empty(latent.shape[0], self.max_length, latent.shape[2])
            self.k_rope = k_rope.new_empty(k_rope.shape[0], self.max_length, k_rope.shape[2])
        self.latent[:, past:end] = latent
        self.k_rope[:, past:end] = k_rope
        self.length = end
        return self.latent[:, :end], self.k_rope[:, :end], past


@register_token_mixer("mla")
class LatentAttention(nn.Module):
    """Multi-head latent attention of layer `layer`, heads split over tp: [b, s(/tp under SP), hidden] in and out."""
    hf_tensor_maps = staticmethod(mla_hf.hf_tensor_maps)  # its Hugging Face names

    def __init__(self, cfg: ModelConfig, layer: int, layout: ModelLayout):
        super().__init__()
        m, a = cfg.mla, cfg.attention
        if m is None:
            raise ConfigError("token mixer 'mla' needs the model config's mla settings (ModelConfig.mla)")
        tp, heads, h = layout.tp, a.num_heads, cfg.hidden_size
        self.check_parallel(cfg, layer, tp, layout.dims.cp, layout.dims.ep)
        self.rotary = self.rotary_of(cfg, layer)
        if self.rotary is not None and m.qk_rope_head_dim % 2:
            raise ConfigError(f"qk_rope_head_dim={m.qk_rope_head_dim} must be even")
        self.m, self.layout, self.heads = m, layout, heads // tp
        std = cfg.initializer_range
        init = lambda t: nn.init.normal_(t, std=std)  # noqa: E731
        col = dict(bias=False, init_method=init, **layout.linear)
        q_out = heads * m.qk_head_dim
        if m.q_lora_rank is None:
            self.q_proj = ColumnParallelLinear(h, q_out, **col)
        else:
            self.q_a_proj = ReplicatedLinear(h, m.q_lora_rank, layout, bias=a.qkv_bias, std=std)
            self.q_a_layernorm = self._latent_norm(cfg, layout, m.q_lora_rank)
            self.q_b_proj = ColumnParallelLinear(m.q_lora_rank, q_out, **col)
        self.kv_a_proj_with_mqa = ReplicatedLinear(h, m.kv_lora_rank + m.qk_rope_head_dim, layout, bias=a.qkv_bias,
                                                   std=std)
        self.kv_a_layernorm = self._latent_norm(cfg, layout, m.kv_lora_rank)
        self.kv_b_proj = ColumnParallelLinear(m.kv_lora_rank, heads * (m.qk_nope_head_dim + m.v_head_dim), **col)
        out_std = std / math.sqrt(2 * cfg.num_layers)
        self.o_proj = RowParallelLinear(heads * m.v_head_dim, h, bias=a.out_bias,
                                        init_method=lambda t: nn.init.normal_(t, std=out_std), **layout.linear)
        self.reads_positions = m.query_scale_beta is not None  # Mistral 4's query temperature (Context.positions)
        self.core = attention_core(layout, self.softmax_scale(cfg), None, None, False)

    @staticmethod
    def rotary_of(cfg: ModelConfig, layer: int) -> RotarySpec | None:
        """The shared rotary key's table, or none on a NoPE layer (`attention.rope_layers` 0, or `position` other than
        "rope": Kimi Linear's MLA, whose q rope part and shared key pass through unrotated)."""
        a = cfg.attention
        if cfg.position != "rope" or (a.rope_layers is not None and not a.rope_layers[layer]):
            return None
        return RotarySpec.of(cfg.mla.qk_rope_head_dim, a.rope_theta, a.rope_scaling)

    @staticmethod
    def _latent_norm(cfg: ModelConfig, layout: ModelLayout, size: int) -> Norm:
        norm = Norm(cfg, layout, size=size)  # replicated; partial gradient under SP (the tokens of this rank)
        norm.eps = cfg.mla.latent_norm_eps   # HF builds the latent norms with the default eps, not rms_norm_eps
        return norm

    @staticmethod
    def softmax_scale(cfg: ModelConfig) -> float:
        """qk_head_dim^-0.5, times YaRN's mscale(factor, mscale_all_dim)^2 when the rope is scaled so."""
        a = cfg.attention
        rope = {**(a.rope_scaling or {}), "rope_theta": a.rope_theta}
        return mla_softmax_scale(cfg.mla.qk_head_dim, rope)

    def new_cache(self, batch: int, max_length: int) -> LatentCache:
        return LatentCache(max_length)

    @staticmethod
    def check_parallel(cfg: ModelConfig, layer: int, tp: int, cp: int = 1, ep: int = 1) -> None:
        """ParallelLayoutError where the heads cannot split over tp (the one copy of this check)."""
        if cfg.attention.num_heads % tp:
            raise ParallelLayoutError(f"tp={tp} does not divide num_heads={cfg.attention.num_heads}")

    def forward(self, x, ctx: Context, cache: LatentCache | None = None):
        if cache is not None and self.layout.split_sequence:
            raise ConfigError("latent attention decodes with a cache without sequence parallelism")
        q, _ = self.queries(x, ctx)
        latent, k_rope = self.latents(x)
        k_rope = self.shared_key(k_rope, ctx)
        past = 0
        if cache is not None:
            latent, k_rope, past = cache.update(latent, k_rope)
        k, v = self.keys_values(latent, k_rope)
        return self.output(self.core(q, k, v, past, ctx.docs))

    # -- the steps, which the sparse kind (sparse_mla.py) composes with its indexer ---------------------------------
    def queries(self, x, ctx: Context) -> tuple[torch.Tensor, torch.Tensor]:
        """(q [b, heads/tp, s, qk_head_dim] rotated, and scaled per position where the config says so; the query
        latent q_a_layernorm(q_a_proj(x)) of this rank's tokens, or x without q_lora_rank)."""
        m = self.m
        if m.q_lora_rank is None:
            q_latent, q = x, self.q_proj(x)
        else:
            q_latent = self.q_a_layernorm(self.q_a_proj(x))
            q = self.q_b_proj(q_latent)
        q = rearrange(q, "b s (heads d) -> b s heads d", d=m.qk_head_dim)
        q_nope, q_rope = q.split([m.qk_nope_head_dim, m.qk_rope_head_dim], dim=-1)
        if self.rotary is not None:  # none on a NoPE layer: the rope part passes through
            q_rope = self._rotate(q_rope, *ctx.rotary[self.rotary])
        q = torch.cat([q_nope, q_rope], dim=-1)
        if m.query_scale_beta is not None:  # Mistral 4: 1 + beta log(1 + floor(position / length)) per token
            pos = ctx.positions.to(torch.float32)
            scale = 1 + m.query_scale_beta * torch.log(1 + torch.floor(pos / m.query_scale_length))
            q = q * scale.to(q.dtype)[..., None, None]
        return rearrange(q, "b s heads d -> b heads s d"), q_latent

    def latents(self, x) -> tuple[torch.Tensor, torch.Tensor]:
        """(the normalized kv latent [b, s, kv_lora_rank], the shared rotary key before its rotary [b, s, rope]) of
        this rank's tokens (its shard under SP)."""
        latent, k_rope = self.kv_a_proj_with_mqa(x).split([self.m.kv_lora_rank, self.m.qk_rope_head_dim], dim=-1)
        return self.kv_a_layernorm(latent), k_rope

    def shared_key(self, k_rope, ctx: Context) -> torch.Tensor:
        """The shared rotary key in the TP region (all-gathered under SP, its gradient summed over tp), rotated."""
        dims = self.layout.dims
        # it enters on its own (the latent enters through kv_b_proj)
        k_rope = gather_from_sequence(k_rope, -2, dims.tp_group) if self.layout.split_sequence \
            else copy_to_tp(k_rope, dims.tp_group)
        if self.rotary is None:
            return k_rope
        return self._rotate(k_rope.unsqueeze(2), *ctx.rotary[self.rotary]).squeeze(2)

    def _rotate(self, x, cos, sin):
        return (apply_rotary_interleaved if self.m.rope_interleave else kernels.apply_rotary)(x, cos, sin)

    def keys_values(self, latent, k_rope) -> tuple[torch.Tensor, torch.Tensor]:
        """k [b, heads/tp, S, qk_head_dim] and v [b, heads/tp, S, v_head_dim] of the latents (kv_b_proj, column
        parallel: its SP entry gathers the latents) and the rotated shared key [b, S, rope]."""
        return self.split_kv(self.kv_b_proj(latent), k_rope)

    def split_kv(self, kv, k_rope) -> tuple[torch.Tensor, torch.Tensor]:
        """k and v (heads first) of kv_b_proj's output [b, S, heads/tp * (nope + v)] and the rotated shared key."""
        m = self.m
        kv = rearrange(kv, "b s (heads d) -> b s heads d", heads=self.heads)
        k_nope, v = kv.split([m.qk_nope_head_dim, m.v_head_dim], dim=-1)
        k = torch.cat([k_nope, k_rope.unsqueeze(2).expand(-1, -1, self.heads, -1)], dim=-1)
        return rearrange(k, "b s heads d -> b heads s d"), rearrange(v, "b s heads d -> b heads s d")

    def output(self, out) -> torch.Tensor:
        return self.o_proj(rearrange(out, "b heads s d -> b s (heads d)"))

    def qk_clip_scales(self, eta: torch.Tensor) -> list:
        """MuonClip (tpzoo.train.qk_clip): factors of this rank's rows for eta [all heads] = min(1, tau / largest
        logit), per head as Kimi K2 clips MLA: q_nope and k_nope (kv_b_proj's key rows) by sqrt(eta), q_rope by
        eta (its logit term meets the shared rotary key, which stays untouched), v unchanged."""
        m, heads, rank = self.m, self.heads, self.layout.dims.tp_rank
        e = eta[rank * heads:(rank + 1) * heads].unsqueeze(1)
        root = e.sqrt()
        q_rows = torch.cat([root.expand(heads, m.qk_nope_head_dim), e.expand(heads, m.qk_rope_head_dim)], dim=1)
        kv_rows = torch.cat([root.expand(heads, m.qk_nope_head_dim), torch.ones(heads, m.v_head_dim,
                                                                                 device=eta.device)], dim=1)
        q = self.q_proj if m.q_lora_rank is None else self.q_b_proj
        return [(q.weight, q_rows.flatten()), (self.kv_b_proj.weight, kv_rows.flatten())]

    # -- sizes, without building (ModelConfig.num_parameters, flops_per_token) ----------------------------------
    @staticmethod
    def num_parameters(cfg: ModelConfig, layer: int, active: bool = False) -> int:
        m, a, h = cfg.mla, cfg.attention, cfg.hidden_size
        heads, bias = a.num_heads, int(a.qkv_bias)
        if m.q_lora_rank is None:
            q = h * heads * m.qk_head_dim
        else:  # q_a_proj (+ bias), its norm, q_b_proj
            q = (h + bias) * m.q_lora_rank + m.q_lora_rank + m.q_lora_rank * heads * m.qk_head_dim
        kv_a = (h + bias) * (m.kv_lora_rank + m.qk_rope_head_dim) + m.kv_lora_rank
        kv_b = m.kv_lora_rank * heads * (m.qk_nope_head_dim + m.v_head_dim)
        o = heads * m.v_head_dim * h + (h if a.out_bias else 0)
        return q + kv_a + kv_b + o

    @staticmethod
    def sequence_flops(cfg: ModelConfig, layer: int, seq_len: int) -> int:
        """QK^T (qk_head_dim wide) and AV (v_head_dim wide) per token, 2 FLOPs per multiply-add, causal not
        discounted."""
        m = cfg.mla
        return 2 * seq_len * cfg.attention.num_heads * (m.qk_head_dim + m.v_head_dim)

