"""Token mixer "attention": causal softmax attention (MHA / GQA), with per-layer sliding windows, Gemma 2's
soft-capped scores, q/k norms, rotary positions (full, partial, per-layer tables, NoPE layers) and Qwen3.5 /
Qwen3-Next's output gate (q's projection twice as wide: each head's query, then its gate; the attention output
times sigmoid(gate) enters the output projection).

TP split: heads. q|k|v is one column-parallel matmul (each rank its query heads and the kv heads they read: kv
heads split when tp divides them, replicated, each rank keeping the one its query heads use, when kv_heads < tp;
a gated q part is split per head, its gate rows with it); the output projection is row-parallel.
What crosses ranks: entering the TP region (all-gather of the sequence under SP, else identity / all-reduce of
the input gradient), leaving it (all-reduce, or reduce-scatter under SP); OLMo 2's whole-width q/k norm adds one
all-reduce of 2 fp32 per token (attention_extras.py); under context parallelism the core exchanges K/V (ring) or
heads (a2a) over the cp group (attention_core.py).
Attention sinks (gpt-oss, attention.sinks): `attn.sinks` [heads], split by head with the query heads (each rank
its heads' sinks; their gradients are whole), handed to the core (attention_core.py), which merges them into the
softmax; under cp they are replicated and their gradient, partial per cp rank, joins the data-parallel reduction.
Cache: KVCache, this rank's keys and values of every token seen [b, kv_heads/tp, length, head_dim], in a buffer
of the generation's max length (no copy of the past per step).

Three parts: the projections (qkv, out, q/k norms: parameters, in the registration order checkpoints and the
optimizer's flat layout depend on), the positions (a RotarySpec whose table the Transformer computes once per
forward: rotary.py), and the core (attention_core.py: the local backends, wrapped for context parallelism).
"""
from __future__ import annotations

import math

import torch
import torch.nn as nn
from einops import rearrange

from tpzoo.errors import ConfigError
from tpzoo.parallel import ColumnParallelLinear, ParallelLayoutError, RowParallelLinear, ShardSpec, mark_parallel

from ..config import ModelConfig
from ..inputs import Context
from ..layout import ModelLayout
from ..registry import register_token_mixer
from . import attention_hf
from .attention_core import attention_core
from .attention_extras import full_width_qk_norm, make_qk_norms
from .rotary import RotarySpec, rotate


class KVCache:
    """Keys and values of the tokens seen so far, for one layer on this rank ([b, kv_heads/tp, length, hd]), in
    buffers of `max_length` tokens allocated at the first update (dtype and device of the keys)."""

    def __init__(self, max_length: int):
        self.max_length, self.length = max_length, 0
        self.k = self.v = None

    def update(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Append k, v [b, kv_heads, s, hd]; return the keys and values of every token so far."""
        end = self.length + k.shape[2]
        if end > self.max_length:
            raise ConfigError(f"KV cache of {self.max_length} tokens cannot take {end} (new_cache(max_length=...))")
        if self.k is None:
            shape = (*k.shape[:2], self.max_length, k.shape[3])
            self.k, self.v = k.new_empty(shape), v.new_empty(shape)
        self.k[:, :, self.length:end] = k
        self.v[:, :, self.length:end] = v
        self.length = end
        return self.k[:, :, :end], self.v[:, :, :end]


def output_gate(out: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
    """Qwen3.5 / Qwen3-Next: the attention output [b, s, heads * d] times sigmoid of its gate (same shape)."""
    return out * torch.sigmoid(gate)


@register_token_mixer("attention")
class Attention(nn.Module):
    """Causal self-attention of layer `layer`, heads split over TP (see the module docstring)."""
    hf_tensor_maps = staticmethod(attention_hf.hf_tensor_maps)  # its Hugging Face names

    def __init__(self, cfg: ModelConfig, layer: int, layout: ModelLayout):
        super().__init__()
        a, tp = cfg.attention, layout.tp
        nh, nkv, hd = a.num_heads, a.num_kv_heads, a.head_dim
        self.check_parallel(cfg, layer, tp, layout.dims.cp, layout.dims.ep)
        self.layout = layout
        self.kv_replicas = max(1, tp // nkv)
        self.heads, self.kv_heads, self.head_dim = nh // tp, max(1, nkv // tp), hd
        self.qk_norm, self.gated = a.qk_norm, a.output_gate
        init = lambda t: nn.init.normal_(t, std=cfg.initializer_range)  # noqa: E731
        # q|k|v fused in one column-parallel matmul; the k and v parts may be replicated head-wise. With the output
        # gate the q part holds per head [query | gate] (HF's q_proj layout), split by whole heads.
        q_rows = nh * hd * (2 if self.gated else 1)
        spec = ShardSpec(0, parts=(q_rows, nkv * hd, nkv * hd), replicas=(1, self.kv_replicas, self.kv_replicas),
                         block=hd)
        self.qkv = ColumnParallelLinear(cfg.hidden_size, q_rows + 2 * nkv * hd, bias=a.qkv_bias, shard_spec=spec,
                                        init_method=init, **layout.linear)
        out_std = cfg.initializer_range / math.sqrt(2 * cfg.num_layers)  # GPT-2's scaled residual init
        self.out = RowParallelLinear(nh * hd, cfg.hidden_size, bias=a.out_bias,
                                     init_method=lambda t: nn.init.normal_(t, std=out_std), **layout.linear)
        if a.qk_norm != "none":  # q_norm, k_norm (registered after out: the parameter order of other families stays)
            self.q_norm, self.k_norm = make_qk_norms(cfg, self.kv_replicas, layout)
        if a.sinks:
            self.sinks = mark_parallel(nn.Parameter(torch.empty(self.heads, dtype=layout.dtype, device="meta")),
                                       ShardSpec(0))
            self.std, self.tp_rank = cfg.initializer_range, layout.dims.tp_rank
        self.rotary = self.rotary_of(cfg, layer)
        self.core = attention_core(layout, a.scale ** -0.5 if a.scale else None, a.window(layer), a.softcap,
                                   self.heads != self.kv_heads)

    def reset_parameters(self) -> None:
        """The sinks (the projections draw their own): every head's drawn, this rank's kept (any layout, one model)."""
        sinks = getattr(self, "sinks", None)
        if sinks is None or sinks.device.type == "meta":
            return
        with torch.no_grad():
            full = torch.empty(sinks.numel() * self.layout.tp, dtype=torch.float32, device=sinks.device)
            sinks.copy_(full.normal_(std=self.std).chunk(self.layout.tp)[self.tp_rank])

    @staticmethod
    def rotary_of(cfg: ModelConfig, layer: int) -> RotarySpec | None:
        """The rotary table of `layer`: none with learned positions or on a NoPE layer (SmolLM3), Gemma 3's local
        base on its sliding layers, else the global one."""
        a = cfg.attention
        if cfg.position != "rope" or (a.rope_layers is not None and not a.rope_layers[layer]):
            return None
        if a.rope_local_theta is not None and a.window(layer) is not None:
            return RotarySpec.of(a.rotary_dim, a.rope_local_theta)
        return RotarySpec.of(a.rotary_dim, a.rope_theta, a.rope_scaling)

    def new_cache(self, batch: int, max_length: int) -> KVCache:
        return KVCache(max_length)

    @staticmethod
    def check_parallel(cfg: ModelConfig, layer: int, tp: int, cp: int = 1, ep: int = 1) -> None:
        """ParallelLayoutError where the heads cannot split over tp (kv heads may be copied: tp a multiple of
        them). The one copy of this check: the layer's build, the preflight and the plan ask it."""
        nh, nkv = cfg.attention.num_heads, cfg.attention.num_kv_heads
        if nh % tp:
            raise ParallelLayoutError(f"tp={tp} does not divide num_heads={nh}")
        if nkv % tp and tp % nkv:
            raise ParallelLayoutError(f"tp={tp} neither divides nor is a multiple of num_kv_heads={nkv}")

    def forward(self, x, ctx: Context, cache: KVCache | None = None):
        # One matmul enters the TP region for q, k and v (under SP: gathers the sequence, keeps only the shard).
        q_width = self.heads * self.head_dim * (2 if self.gated else 1)
        q, k, v = self.qkv(x).split([q_width, self.kv_heads * self.head_dim, self.kv_heads * self.head_dim], dim=-1)
        if self.gated:  # per head: its query, then its gate
            q, gate = q.unflatten(-1, (self.heads, 2 * self.head_dim)).chunk(2, dim=-1)
            q, gate = q.flatten(-2), gate.flatten(-2)
        if self.qk_norm == "full":  # OLMo 2: over all heads' width, spanning the TP ranks
            q, k = full_width_qk_norm(q, k, self.q_norm, self.k_norm, self.kv_replicas, self.layout.dims.tp_group)
        q, k, v = (rearrange(t, "b s (heads d) -> b s heads d", d=self.head_dim) for t in (q, k, v))
        if self.qk_norm == "head":  # Qwen3, Gemma 3: per head, before the rotary
            q, k = self.q_norm(q), self.k_norm(k)
        if self.rotary is not None:  # the rotary kernel takes [b, s, heads, d]; attention wants the heads first
            cos, sin = ctx.rotary[self.rotary]
            q, k = rotate(q, cos, sin), rotate(k, cos, sin)
        q, k, v = (rearrange(t, "b s heads d -> b heads s d") for t in (q, k, v))
        if cache is not None:
            k, v = cache.update(k, v)
        out = rearrange(self.core(q, k, v, ctx.past, ctx.docs, getattr(self, "sinks", None)),
                        "b heads s d -> b s (heads d)")
        if self.gated:
            out = output_gate(out, gate)
        return self.out(out)

    def qk_clip_scales(self, eta: torch.Tensor) -> list:
        """MuonClip (tpzoo.train.qk_clip): factors of this rank's q|k|v rows (weight and bias) for eta [all heads]
        = min(1, tau / largest logit): a kv group's smallest eta, square-rooted, on its query heads' rows (not the
        output gate's) and its key head's (Megatron-Core's grouped rule: every head of the group scales alike)."""
        tp, rank, hd, heads = self.layout.tp, self.layout.dims.tp_rank, self.head_dim, self.heads
        groups = self.kv_heads * tp // self.kv_replicas  # kv heads in all
        root = eta.view(groups, -1).amin(dim=1).sqrt()
        q = root[torch.arange(rank * heads, (rank + 1) * heads, device=eta.device) // (heads * tp // groups)]
        q = q.unsqueeze(1).expand(heads, hd)
        if self.gated:  # per head [query | gate]
            q = torch.cat([q, torch.ones_like(q)], dim=1)
        kv = (torch.tensor([rank // self.kv_replicas], device=eta.device) if self.kv_replicas > 1
              else torch.arange(rank * self.kv_heads, (rank + 1) * self.kv_heads, device=eta.device))
        rows = torch.cat([q.flatten(), root[kv].repeat_interleave(hd), torch.ones(self.kv_heads * hd,
                                                                                 device=eta.device)])
        return [(p, rows) for p in (self.qkv.weight, self.qkv.bias) if p is not None]

    # -- sizes, without building (ModelConfig.num_parameters, flops_per_token) ----------------------------------
    @staticmethod
    def num_parameters(cfg: ModelConfig, layer: int, active: bool = False) -> int:
        a, h = cfg.attention, cfg.hidden_size
        q, kv = a.num_heads * a.head_dim, a.num_kv_heads * a.head_dim
        q_in = q * (2 if a.output_gate else 1)  # the gate's rows
        n = h * (q_in + 2 * kv) + q * h + (q_in + 2 * kv if a.qkv_bias else 0) + (h if a.out_bias else 0)
        return n + {"none": 0, "head": 2 * a.head_dim, "full": q + kv}[a.qk_norm] + (a.num_heads if a.sinks else 0)

    @staticmethod
    def sequence_flops(cfg: ModelConfig, layer: int, seq_len: int) -> int:
        """QK^T and AV per token (2 FLOPs per multiply-add each), causal not discounted."""
        return 2 * 2 * seq_len * cfg.attention.num_heads * cfg.attention.head_dim
