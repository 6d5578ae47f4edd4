"""Token mixer "kimi_delta": Kimi Delta Attention (KDA), the linear attention of Kimi Linear: Gated DeltaNet's delta
rule with a decay per key channel instead of one per head, its decay and output gate from low-rank projections,
and a sigmoid output gate.

    x -> in_proj -> q|k|v -> causal depthwise conv (kernel K) + SiLU -> q, k (L2-normalized), v;  b -> sigmoid = beta
    x -> f_a_proj -> f_b_proj -> g = -exp(A_log[h]) * softplus(. + dt_bias)   per head h and key channel (log space)
    x -> g_a_proj -> g_b_proj -> the output gate
    o = gated delta rule, per-channel decay (kernels/gated_delta.py)   ->   o_proj(RMSNorm(o) * w * sigmoid(gate))
q, k and v have the same heads (num_heads of head_dim each); f_a_proj and g_a_proj are head_dim wide.

TP split: by heads: each rank holds num_heads/tp whole heads, so no part of the recurrence crosses ranks. in_proj is
one column-parallel matmul whose parts q|k|v|b are split separately (HF's q_proj, k_proj, v_proj, b_proj); the
low-rank down projections f_a_proj and g_a_proj are replicated (replicated.py, as MLA's: under SP their gradients
are partial and summed over tp like a norm's), their up projections f_b_proj and g_b_proj column-parallel by heads;
the conv's channels, A_log [heads] and dt_bias [heads x head_dim] split with the heads; the gated norm's weight
[head_dim] is replicated with a partial gradient summed over tp; o_proj is row-parallel.
What crosses ranks: three column entries (x into in_proj; the two head_dim-wide latents into f_b_proj and
g_b_proj: under SP all-gathers, else all-reduces of their gradients in backward) and o_proj's exit (all-reduce, or
the SP reduce-scatter). With context parallelism, as Gated DeltaNet (gated_deltanet.py's to_head_group): two
all-to-alls over the cp group per forward, two in backward: q|k|v|b|f (f: the decay's pre-activation) of this
rank's load-balanced tokens and all its heads -> every token, in natural order, of heads/cp of them, before the
conv; the rule's output back. The conv and the recurrence then see the whole sequence in order: exact. The output
gate stays with the rank's own tokens. Needs the heads per TP rank divisible by cp.
Cache (generation): GatedDeltaNetCache, the conv's last K-1 inputs [b, K-1, 3 x this rank's heads x head_dim] and
the recurrent state [b, this rank's heads, head_dim, head_dim] (fp32): a fixed size, nothing that grows with the
length. A prefill runs the chunked form from the cached state, a one-token step the recurrent form.
Documents (packing): the conv reads no token of another document and the recurrence restarts at every document.
Selective recomputation wraps `core` (the rule). Parameter names: the hub's, under self_attn (kimi_delta_hf.py).
"""
from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from tpzoo.errors import ConfigError
from tpzoo.kernels.gated_delta import SUB, compute_dtype, document_starts
from tpzoo.parallel import (ColumnParallelLinear, ParallelLayoutError, RowParallelLinear, ShardSpec, mark_parallel,
                            normal_init)
from tpzoo.parallel.layers import _init_shard

from ..config import ModelConfig
from ..inputs import Context
from ..layout import ModelLayout
from ..registry import register_token_mixer
from . import kimi_delta_hf
from .gated_deltanet import (DeltaRule, GatedDeltaNetCache, GatedRMSNorm, ShortConv, causal_conv, cp_share,
                             to_head_group, to_own_tokens)
from .replicated import ReplicatedLinear


class SigmoidGatedRMSNorm(GatedRMSNorm):
    """KDA's o_norm: RMSNorm over each head's d, times sigmoid(gate) (transformers' KimiLinearRMSNormGated)."""
    gate = staticmethod(torch.sigmoid)


@register_token_mixer("kimi_delta")
class KimiDeltaAttention(nn.Module):
    """Kimi Delta Attention of layer `layer` (module docstring), settings in cfg.kimi_delta. forward(x, ctx, cache):
    x [b, s(/tp under SP), hidden]; ctx.docs the packed batch's documents; cache a GatedDeltaNetCache."""
    hf_tensor_maps = staticmethod(kimi_delta_hf.hf_tensor_maps)  # its Hugging Face names
    rotary = None

    def __init__(self, cfg: ModelConfig, layer: int, layout: ModelLayout):
        super().__init__()
        g, dims, h = cfg.kimi_delta, layout.dims, cfg.hidden_size
        if g is None:
            raise ConfigError("token mixer 'kimi_delta' needs the model config's kimi_delta settings")
        self.check_parallel(cfg, layer, dims.tp, dims.cp, dims.ep)
        self.g, self.dims, self.heads = g, dims, g.num_heads // dims.tp
        kw = {"dtype": layout.dtype, "device": "meta"}
        # A_log and dt_bias are drawn first, by this module's own reset_parameters, before its children's
        self.A_log = mark_parallel(nn.Parameter(torch.empty(self.heads, **kw)), 0)
        self.dt_bias = mark_parallel(nn.Parameter(torch.empty(self.heads * g.head_dim, **kw)), 0)
        std = cfg.initializer_range
        col = dict(bias=False, init_method=normal_init(std), **layout.linear)  # transformers' init: no residual scaling
        self.in_proj = ColumnParallelLinear(h, sum(g.in_proj_parts), shard_spec=ShardSpec(0, parts=g.in_proj_parts),
                                            **col)
        self.conv = ShortConv(g, layout, std)
        self.f_a_proj = ReplicatedLinear(h, g.head_dim, layout, std=std)
        self.f_b_proj = ColumnParallelLinear(g.head_dim, g.dim, **col)
        self.g_a_proj = ReplicatedLinear(h, g.head_dim, layout, std=std)
        self.g_b_proj = ColumnParallelLinear(g.head_dim, g.dim, **col)
        self.o_norm = SigmoidGatedRMSNorm(g.head_dim, cfg.norm_eps, layout.dtype)
        self.o_proj = RowParallelLinear(g.dim, h, bias=False, init_method=normal_init(std), **layout.linear)
        self.core = DeltaRule(g.chunk_size)

    def reset_parameters(self) -> None:
        """fla's (and transformers') init: A_log = log(uniform(1, 16)) per head; dt_bias = softplus^-1(dt), dt
        log-uniform in [1e-3, 0.1] per channel. The children reset themselves."""
        if self.A_log.device.type == "meta":
            return
        g, rank, tp = self.g, self.dims.tp_rank, self.dims.tp

        def dt_bias(t):
            dt = t.uniform_(math.log(1e-3), math.log(1e-1)).exp_().clamp_(min=1e-4)
            return t.copy_(dt + torch.log(-torch.expm1(-dt)))

        _init_shard(self.A_log, (g.num_heads,), ShardSpec(0), lambda t: t.uniform_(1, 16).log_(), rank, tp)
        _init_shard(self.dt_bias, (g.dim,), ShardSpec(0), dt_bias, rank, tp)

    def new_cache(self, batch: int, max_length: int | None = None) -> GatedDeltaNetCache:
        """An empty cache for `batch` sequences (any length: its size does not grow)."""
        w, d = self.conv.weight, self.g.head_dim
        return GatedDeltaNetCache(w.new_zeros(batch, self.g.conv_kernel - 1, w.shape[0]),
                                  torch.zeros(batch, self.heads, d, d, dtype=torch.float32, device=w.device))

    @staticmethod
    def check_parallel(cfg: ModelConfig, layer: int, tp: int, cp: int = 1, ep: int = 1) -> None:
        """ParallelLayoutError where whole heads cannot split over tp (and, by all-to-all, cp): the one copy of this
        check (the layer's build, the preflight and the plan ask it)."""
        n = cfg.kimi_delta.num_heads
        if n % (tp * cp):
            what = f"tp={tp}" if cp == 1 else f"tp x cp = {tp} x {cp}"
            raise ParallelLayoutError(
                f"{what} does not divide the Kimi Delta Attention heads ({n}): it splits whole heads over tp"
                + (" and, by all-to-all, over cp; use a cp that divides the heads per tp rank, or cp=1" if cp > 1
                   else ""))

    def forward(self, x: torch.Tensor, ctx: Context | None = None, cache: GatedDeltaNetCache | None = None):
        d, dims = self.g.head_dim, self.dims
        heads = self.heads
        hd = heads * d
        # one matmul enters the TP region for q|k|v|b (under SP: gathers the sequence, keeps only the shard)
        qkv, b = self.in_proj(x).split([3 * hd, heads], dim=-1)
        f = self.f_b_proj(self.f_a_proj(x))   # the decay's pre-activation, per channel
        gate = self.g_b_proj(self.g_a_proj(x))
        docs = ctx.docs if ctx is not None else None
        starts = None if docs is None else document_starts(docs.ids)
        conv_w, A_log, dt_bias = self.conv.weight, self.A_log, self.dt_bias
        if dims.cp > 1:
            if cache is not None:
                raise ConfigError("context parallelism (cp > 1) does not decode with a cache: generate at cp=1")
            q, k, v, b, f = to_head_group([*qkv.split(hd, dim=-1), b, f], dims)
            qkv = torch.cat([q, k, v], dim=-1)  # every token, this cp rank's heads/cp
            conv_w = cp_share(conv_w, (hd,) * 3, dims)
            A_log, dt_bias = cp_share(A_log, (heads,), dims), cp_share(dt_bias, (hd,), dims)
            heads //= dims.cp
        mixed, conv_tail = causal_conv(qkv, conv_w, None if cache is None else cache.conv, starts)
        q, k, v = (t.unflatten(-1, (heads, d)) for t in mixed.split(heads * d, dim=-1))
        f32 = compute_dtype(f.dtype)
        decay = -A_log.to(f32).exp().unsqueeze(-1) * F.softplus(f.to(f32).unflatten(-1, (heads, d))
                                                                  + dt_bias.to(f32).view(heads, d))
        o, state = self.core(q, k, v, decay, b.sigmoid(), starts, None if cache is None else cache.state,
                             cache is not None)
        if dims.cp > 1:
            o = to_own_tokens(o, dims)
        if cache is not None:
            cache.conv, cache.state = conv_tail, state
        o = self.o_norm(o, gate.unflatten(-1, (self.heads, d)))
        return self.o_proj(o.flatten(-2))

    # -- sizes, without building (ModelConfig.num_parameters, flops_per_token) ----------------------------------

    @staticmethod
    def num_parameters(cfg: ModelConfig, layer: int, active: bool = False) -> int:
        g, h = cfg.kimi_delta, cfg.hidden_size
        low_rank = 2 * (h * g.head_dim + g.head_dim * g.dim)  # f_a, f_b, g_a, g_b
        return (h * sum(g.in_proj_parts) + sum(g.conv_parts) * g.conv_kernel + low_rank + g.num_heads + g.dim
                + g.head_dim + g.dim * h)

    @staticmethod
    def sequence_flops(cfg: ModelConfig, layer: int, seq_len: int) -> int:
        """Forward FLOPs per token beyond the projections (2 per multiply-add, the causal half not discounted),
        independent of the sequence length: Gated DeltaNet's chunked rule (gated_deltanet.py: C (5 d + 3 d) + 6 d^2
        per head, d_k = d_v = d) plus the per-channel factors inside each sub-chunk of 16 tokens (for k beta k^T and
        q k^T: 2 x 16 d multiply-adds per token)."""
        g = cfg.kimi_delta
        c, d = g.chunk_size, g.head_dim
        sub = SUB if c % SUB == 0 else c
        return g.num_heads * (c * 8 * d + 6 * d * d + 4 * sub * d)
