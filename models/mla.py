"""Multi-head latent attention (DeepSeek-V2/V3, Kimi K2, Moonlight): queries and keys/values through low-rank
latents, one rotary key head shared by all heads, values narrower than queries and keys.

    q   = q_b_proj(q_a_layernorm(q_a_proj(x)))        (or one q_proj when q_lora_rank is None)   [heads, nope | rope]
    c   = kv_a_proj_with_mqa(x) = latent | k_rope     latent -> kv_a_layernorm -> kv_b_proj -> [heads, k_nope | v]
    k   = k_nope | rotary(k_rope) broadcast to every head;   q's rope part rotated alike (DeepSeek's interleaved
          rotary when rope_interleave, models/rope.py), softmax scale qk_head_dim^-0.5 times YaRN's mscale^2
    out = o_proj(attention(q, k, v))                   qk_head_dim = nope + rope, v_head_dim may differ

TP split (Megatron-Core's): the down projections (q_a_proj, kv_a_proj_with_mqa) and their norms are replicated:
every tp rank computes the latents of the tokens it holds. Without SP those are the whole sequence and the
up projections' entry (copy_to_tp: all-reduce of the latents' gradient in backward) makes the replicated weights'
gradients whole on every rank. Under SP each rank holds its sequence shard, so those weights' gradients are
partial (marked `sequence_parallel`, summed over tp like a norm's), and the latents, not x, are what the up
projections all-gather (ColumnParallelLinear's SP entry: q_lora_rank + kv_lora_rank wide instead of hidden).
q_b_proj / q_proj and kv_b_proj are column-parallel by heads, o_proj row-parallel; the rotary key (qk_rope_head_dim
per token) enters the TP region on its own (all-gather under SP, else copy_to_tp). What crosses ranks per layer:
the column entries (three, one of them rope-wide), o_proj's reduction; under cp, ring attention's K|V blocks
(K and V of different widths, one transfer) or Ulysses' all-to-alls.

Cache (decoding, `LatentCache`): the normalized latent [b, s, kv_lora_rank] and the rotated shared key
[b, s, qk_rope_head_dim], what transformers caches for this model: 576 numbers per token and layer for DeepSeek-V3,
replicated on each tp rank, where expanded keys and values would hold heads/tp * (192 + 128) = 5,120 at tp 8.
Each step re-expands the cached latents with kv_b_proj (docs/design.md says why). Decoding runs without SP and
at cp = 1, as for the other attention kinds.

Parameter names are transformers' (DeepseekV3Attention's state dict maps one to one; column/row shards by
`param_spec`). LoRA: HF PEFT can target every projection here (all nn.Linear in transformers: q_proj or q_a_proj /
q_b_proj, kv_a_proj_with_mqa, kv_b_proj, o_proj; "all-linear" takes them all). tpzoo's adapters
(tpzoo.parallel.lora) attach to the column / row ones (q_proj, q_b_proj, kv_b_proj, o_proj); the replicated down
projections need a replicated adapter (A and B whole on every rank, both partial under SP like the weight).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F
from einops import rearrange

from tpzoo import kernels
from tpzoo.errors import ConfigError
from tpzoo.parallel import (ColumnParallelLinear, ParallelDims, ParallelLayoutError, RowParallelLinear, copy_to_tp,
                            gather_from_sequence, mark_parallel)
from tpzoo.parallel.ring_attention import ring_attention
from tpzoo.parallel.ulysses import ulysses_attention

from .documents import Documents, document_attention
from .rope import apply_rotary_interleaved, mla_softmax_scale


@dataclass(frozen=True)
class MLAConfig:
    """The settings of one latent-attention layer (HF DeepseekV3Config's names)."""
    hidden_size: int
    num_heads: int
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    q_lora_rank: int | None = None
    attention_bias: bool = False
    rope_interleave: bool = True
    softmax_scale: float | None = None  # None: qk_head_dim ** -0.5 (mla_softmax_scale adds YaRN's mscale)
    latent_norm_eps: float = 1e-6       # HF builds q_a_layernorm / kv_a_layernorm with the default eps
    initializer_range: float = 0.02
    num_layers: int = 1                 # for the residual projection's scaled init

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @classmethod
    def from_hf(cls, hf: dict) -> "MLAConfig":
        """From a DeepseekV3 config.json (rope_parameters or the older rope_scaling give the mscale)."""
        rope = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
        if "type" in rope and "rope_type" not in rope:
            rope = {**rope, "rope_type": rope["type"]}
        qk = hf["qk_nope_head_dim"] + hf["qk_rope_head_dim"]
        return cls(hidden_size=hf["hidden_size"], num_heads=hf["num_attention_heads"],
                   kv_lora_rank=hf["kv_lora_rank"], qk_nope_head_dim=hf["qk_nope_head_dim"],
                   qk_rope_head_dim=hf["qk_rope_head_dim"], v_head_dim=hf["v_head_dim"],
                   q_lora_rank=hf.get("q_lora_rank"), attention_bias=hf.get("attention_bias", False),
                   rope_interleave=hf.get("rope_interleave", True), softmax_scale=mla_softmax_scale(qk, rope),
                   initializer_range=hf.get("initializer_range", 0.02),
                   num_layers=hf.get("num_hidden_layers", 1))


class ReplicatedLinear(nn.Module):
    """A linear layer every tp rank holds whole (a down projection); its gradient is partial under SP."""

    def __init__(self, in_features: int, out_features: int, bias: bool, sequence_parallel: bool, std: float,
                 dtype=None, device=None):
        super().__init__()
        self.std = std
        self.weight = mark_parallel(nn.Parameter(torch.empty(out_features, in_features, dtype=dtype, device=device)),
                                    None, sequence_parallel)
        self.bias = (mark_parallel(nn.Parameter(torch.empty(out_features, dtype=dtype, device=device)), None,
                                   sequence_parallel) if bias else None)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        if self.weight.device.type != "meta":
            nn.init.normal_(self.weight, std=self.std)
            if self.bias is not None:
                nn.init.zeros_(self.bias)

    def forward(self, x):
        return F.linear(x, self.weight, self.bias)


class LatentNorm(nn.Module):
    """RMSNorm over a latent, replicated over tp (partial gradient under SP)."""

    def __init__(self, size: int, eps: float, sequence_parallel: bool, dtype=None, device=None):
        super().__init__()
        self.eps = eps
        self.weight = mark_parallel(nn.Parameter(torch.empty(size, dtype=dtype, device=device)), None,
                                    sequence_parallel)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        if self.weight.device.type != "meta":
            nn.init.ones_(self.weight)

    def forward(self, x):
        return kernels.rms_norm(x, self.weight, self.eps)


class LatentCache:
    """One layer's decoding cache: the normalized kv latent [b, s, kv_lora_rank] and the rotated shared key
    [b, s, qk_rope_head_dim] of every token seen so far."""

    def __init__(self):
        self.latent = self.k_rope = None

    @property
    def length(self) -> int:
        return 0 if self.latent is None else self.latent.shape[1]

    def update(self, latent: torch.Tensor, k_rope: torch.Tensor):
        past = self.length
        self.latent = latent if self.latent is None else torch.cat([self.latent, latent], dim=1)
        self.k_rope = k_rope if self.k_rope is None else torch.cat([self.k_rope, k_rope], dim=1)
        return self.latent, self.k_rope, past


class LatentAttention(nn.Module):
    """Multi-head latent attention with heads split over tp: [b, s(/tp under SP), hidden] in and out."""

    def __init__(self, cfg: MLAConfig, dims: ParallelDims, sequence_parallel: bool = False, dtype=None,
                 device=None):
        super().__init__()
        tp = dims.tp
        if cfg.num_heads % tp:
            raise ParallelLayoutError(f"tp={tp} does not divide num_heads={cfg.num_heads}")
        if cfg.qk_rope_head_dim % 2:
            raise ConfigError(f"qk_rope_head_dim={cfg.qk_rope_head_dim} must be even")
        self.cfg, self.dims, self.sequence_parallel = cfg, dims, sequence_parallel
        self.heads = cfg.num_heads // tp
        self.scale = cfg.softmax_scale or cfg.qk_head_dim ** -0.5
        self.cp_mode = "ring"  # under context parallelism: "ring" or "a2a"
        std, h, sp = cfg.initializer_range, cfg.hidden_size, sequence_parallel
        init = lambda t: nn.init.normal_(t, std=std)  # noqa: E731
        kw = dict(dtype=dtype, device=device)
        col = dict(bias=False, sequence_parallel=sp, init_method=init, dims=dims, **kw)
        q_out = cfg.num_heads * cfg.qk_head_dim
        if cfg.q_lora_rank is None:
            self.q_proj = ColumnParallelLinear(h, q_out, **col)
        else:
            self.q_a_proj = ReplicatedLinear(h, cfg.q_lora_rank, cfg.attention_bias, sp, std, **kw)
            self.q_a_layernorm = LatentNorm(cfg.q_lora_rank, cfg.latent_norm_eps, sp, **kw)
            self.q_b_proj = ColumnParallelLinear(cfg.q_lora_rank, q_out, **col)
        self.kv_a_proj_with_mqa = ReplicatedLinear(h, cfg.kv_lora_rank + cfg.qk_rope_head_dim, cfg.attention_bias,
                                                   sp, std, **kw)
        self.kv_a_layernorm = LatentNorm(cfg.kv_lora_rank, cfg.latent_norm_eps, sp, **kw)
        self.kv_b_proj = ColumnParallelLinear(cfg.kv_lora_rank, cfg.num_heads * (cfg.qk_nope_head_dim + cfg.v_head_dim),
                                              **col)
        out_std = std / math.sqrt(2 * cfg.num_layers)
        self.o_proj = RowParallelLinear(cfg.num_heads * cfg.v_head_dim, h, bias=cfg.attention_bias,
                                        sequence_parallel=sp, init_method=lambda t: nn.init.normal_(t, std=out_std),
                                        dims=dims, **kw)

    def new_cache(self) -> LatentCache:
        return LatentCache()

    def forward(self, x, cos, sin, cache: LatentCache | None = None, docs: Documents | None = None):
        """x [b, s(/tp), hidden]; cos/sin [(b,) s, qk_rope_head_dim / 2] for the positions of the whole sequence
        (of this cp rank's tokens under cp; of the new tokens when decoding), YaRN's attention factor included."""
        cfg, group = self.cfg, self.dims.tp_group
        if cache is not None and self.sequence_parallel and self.dims.tp > 1:
            raise ConfigError("latent attention decodes with a cache without sequence parallelism")
        if cfg.q_lora_rank is None:
            q = self.q_proj(x)
        else:
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        q = rearrange(q, "b s (heads d) -> b s heads d", d=cfg.qk_head_dim)
        q_nope, q_rope = q.split([cfg.qk_nope_head_dim, cfg.qk_rope_head_dim], dim=-1)
        latent, k_rope = self.kv_a_proj_with_mqa(x).split([cfg.kv_lora_rank, cfg.qk_rope_head_dim], dim=-1)
        latent = self.kv_a_layernorm(latent)
        # the shared rotary key enters the TP region on its own (the latent enters through kv_b_proj)
        k_rope = gather_from_sequence(k_rope, -2, group) if self.sequence_parallel else copy_to_tp(k_rope, group)
        rotate = apply_rotary_interleaved if cfg.rope_interleave else kernels.apply_rotary
        q_rope, k_rope = rotate(q_rope, cos, sin), rotate(k_rope.unsqueeze(2), cos, sin).squeeze(2)
        past = 0
        if cache is not None:
            latent, k_rope, past = cache.update(latent, k_rope)
        kv = rearrange(self.kv_b_proj(latent), "b s (heads d) -> b s heads d", heads=self.heads)
        k_nope, v = kv.split([cfg.qk_nope_head_dim, cfg.v_head_dim], dim=-1)
        k = torch.cat([k_nope, k_rope.unsqueeze(2).expand(-1, -1, self.heads, -1)], dim=-1)
        q = torch.cat([q_nope, q_rope], dim=-1)
        q, k, v = (rearrange(t, "b s heads d -> b heads s d") for t in (q, k, v))
        ctx = self._core(q, k, v, past, docs)
        return self.o_proj(rearrange(ctx, "b heads s d -> b s (heads d)"))

    def _core(self, q, k, v, past: int, docs: Documents | None):
        dims = self.dims
        if dims.cp > 1:
            if past:
                raise ConfigError("context parallelism (cp > 1) does not decode with a cache: generate at cp=1")
            if self.cp_mode == "a2a":
                return ulysses_attention(q, k, v, dims.cp_group, dims.cp, lambda *qkv: self._local(*qkv, 0, docs))
            return ring_attention(q, k, v, dims.cp_group, dims.ranks("cp"), dims.cp_rank, scale=self.scale,
                                  doc_ids=None if docs is None else docs.ids)
        return self._local(q, k, v, past, docs)

    def _local(self, q, k, v, past: int, docs: Documents | None):
        if docs is not None:
            return document_attention(q, k, v, docs, scale=self.scale)
        if past == 0:
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=self.scale)
        qpos = torch.arange(past, past + q.shape[2], device=q.device).unsqueeze(-1)
        mask = torch.arange(k.shape[2], device=q.device).unsqueeze(0) <= qpos
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=self.scale)
