"""Token mixer "gated_deltanet": Gated DeltaNet, the linear attention of Qwen3.5 and Qwen3-Next.

    x -> in_proj -> q|k|v -> causal depthwise conv (kernel K) + SiLU -> q, k (L2-normalized), v
                 -> z (output gate), b -> beta = sigmoid(b), a -> g = -exp(A_log) * softplus(a + dt_bias)
    o = gated delta rule(q, k, v, g, beta) (kernels/gated_delta.py)   ->   out_proj(RMSNorm(o) * w * silu(z))

TP split: by key heads. Each rank holds num_key_heads/tp whole key heads with the num_value_heads/tp value heads
that read them (value head h reads key head h // (value heads / key heads)), so no part of the recurrence crosses
ranks. in_proj is one column-parallel matmul whose parts q|k|v|z|b|a are split separately (HF's in_proj_qkv,
in_proj_z, in_proj_b, in_proj_a; Qwen3-Next's grouped in_proj_qkvz / in_proj_ba are regrouped into it by
models/gated_deltanet_hf.py); the conv's channels (this rank's q|k|v), A_log and dt_bias split with the heads;
the gated norm's weight [d_v] is replicated and its gradient, partial (each rank sees its heads only), is summed
over TP like a sequence-parallel norm's; out_proj is row-parallel.
What crosses ranks: the column entry (identity, or the SP all-gather of the sequence) and the row exit (all-reduce,
or the SP reduce-scatter), as for attention. With context parallelism (dims.cp > 1, each cp rank holding 2 of the
2*cp load-balanced chunks) two all-to-alls over the cp group per forward (two in backward), as Megatron-Core does:
q|k|v|b|a of this rank's tokens and all its heads -> every token of heads/cp of them, before the conv; the rule's
output back. The gathered sequence is put in natural order, so the conv and the recurrence see the whole sequence
in order and the result is exact (whatever the layout's cp_mode: the recurrence has no ring form). Needs the key
heads per TP rank divisible by cp.
Cache (generation): GatedDeltaNetCache, the conv's last K-1 inputs [b, K-1, this rank's channels] and the
recurrent state [b, this rank's value heads, d_k, d_v] (fp32): a fixed size, nothing that grows with the length.
A prefill runs the chunked form from the cached state, a one-token step the recurrent form.
Documents (packing): the conv reads no token of another document and the recurrence restarts at every document,
so a packed row equals its documents run one by one.
Selective recomputation wraps `core` (the rule: its chunked intermediates are the layer's largest activations).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from tpzoo import kernels
from tpzoo.errors import ConfigError
from tpzoo.kernels.gated_delta import compute_dtype, document_starts
from tpzoo.parallel import (ColumnParallelLinear, ParallelLayoutError, RowParallelLinear, ShardSpec, mark_parallel,
                            normal_init)
from tpzoo.parallel.layers import _init_shard
from tpzoo.parallel.ulysses import exchange, gathered_order

from ..config import GatedDeltaNetConfig, ModelConfig
from ..inputs import Context
from ..layout import ModelLayout
from ..registry import register_token_mixer
from . import gated_deltanet_hf


@dataclass
class GatedDeltaNetCache:
    """One layer's generation state for a batch of sequences (this rank's heads and channels)."""
    conv: torch.Tensor    # [b, K-1, channels]: the short conv's last inputs
    state: torch.Tensor   # [b, value heads, d_k, d_v], fp32: the recurrent state


def causal_conv(x: torch.Tensor, weight: torch.Tensor, past: torch.Tensor | None = None,
                starts: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """silu(causal depthwise conv) of x [b, s, C] with weight [C, K] (tap K-1 on the token itself, tap K-1-j on
    the token j before), `past` [b, K-1, C] the inputs before x (zeros: none). With `starts` (document_starts) a
    tap that would read a token of an earlier document reads zero instead, as that document's own zero padding.
    Returns (y [b, s, C], the last K-1 inputs for the next call, earlier documents' zeroed)."""
    b, s, c = x.shape
    taps = weight.shape[1]
    past = x.new_zeros(b, taps - 1, c) if past is None else past.to(x.dtype)
    xp = torch.cat([past, x], dim=1)
    reach = None  # how many tokens before each token lie in its document (the row's first one: all of them)
    if starts is not None:
        idx = torch.arange(s, device=x.device).expand(b, s)
        reach = (idx - torch.where(starts, idx, -taps).cummax(dim=1).values).unsqueeze(-1)
    out = x * weight[:, taps - 1]
    for j in range(1, taps):
        tap = xp[:, taps - 1 - j: taps - 1 - j + s]
        if reach is not None:
            tap = torch.where(reach >= j, tap, 0.0)
        out = torch.addcmul(out, tap, weight[:, taps - 1 - j])
    tail = xp[:, xp.shape[1] - (taps - 1):].clone()  # a copy: a cache must not keep the whole prompt's inputs alive
    if reach is not None and taps > 1:  # the next token continues the last document: reach + 1
        j = torch.arange(taps - 1, 0, -1, device=x.device)  # how far before the next token each entry lies
        tail = torch.where((reach[:, -1:] + 1 >= j.view(1, -1, 1)), tail, 0.0)
    return F.silu(out), tail


def to_head_group(parts: list, dims) -> list:
    """Context parallelism's all-to-all over heads (module docstring): each part [B, 2c, width] holds this cp rank's
    tokens of all this tp rank's heads (width = heads x per-head width) -> [B, S, width / cp], every token in
    natural order of this cp rank's heads/cp. One exchange carries all the parts."""
    cp = dims.cp
    split = [t.unflatten(-1, (cp, -1)) for t in parts]  # [B, 2c, cp, width / cp]
    widths = [t.shape[-1] for t in split]
    packed = torch.cat(split, dim=-1).transpose(1, 2).contiguous()  # [B, cp, 2c, W]
    _, natural = gathered_order(packed.shape[2] // 2, cp, packed.device)
    whole = exchange(packed, dims.cp_group, cp, 1, 2).squeeze(1).index_select(1, natural)  # [B, S, W]
    return list(whole.split(widths, dim=-1))


def to_own_tokens(o: torch.Tensor, dims) -> torch.Tensor:
    """The rule's output [B, S, heads/cp, d_v] back to this rank's tokens of all its heads [B, 2c, heads, d_v]."""
    cp = dims.cp
    order, _ = gathered_order(o.shape[1] // (2 * cp), cp, o.device)
    ranked = o.flatten(-2).index_select(1, order).unsqueeze(1)  # [B, 1, S, W] in rank order
    back = exchange(ranked.contiguous(), dims.cp_group, cp, 2, 1)  # [B, cp, 2c, W]: head group by rank
    return back.transpose(1, 2).reshape(o.shape[0], -1, o.shape[2] * cp, o.shape[3])


def cp_share(t: torch.Tensor, parts: tuple, dims) -> torch.Tensor:
    """This cp rank's share of a per-head parameter made of consecutive parts of widths `parts` along dim 0 (each
    part's heads/cp of this rank): the conv's q, k, v rows, A_log, dt_bias of the heads it runs under cp."""
    return torch.cat([p.chunk(dims.cp, 0)[dims.cp_rank] for p in t.split(list(parts), 0)])


class ShortConv(nn.Module):
    """The causal depthwise convolution's weight [this rank's q|k|v channels, K]; split with the heads."""

    def __init__(self, g: GatedDeltaNetConfig, layout: ModelLayout, std: float):
        super().__init__()
        self.dims, self.spec, self.std = layout.dims, ShardSpec(0, parts=g.conv_parts), std
        self.full_shape = (sum(g.conv_parts), g.conv_kernel)
        rows = self.spec.local_size(self.full_shape[0], layout.tp)
        self.weight = mark_parallel(nn.Parameter(torch.empty(rows, g.conv_kernel, dtype=layout.dtype,
                                                             device="meta")), self.spec)
        self.weight.muon = False  # per-channel taps, not a projection: AdamW's under --optimizer muon

    def reset_parameters(self) -> None:
        _init_shard(self.weight, self.full_shape, self.spec, normal_init(self.std), self.dims.tp_rank, self.dims.tp)


class GatedRMSNorm(nn.Module):
    """RMSNorm over each head's d_v, times silu(z) (transformers' RMSNormGated: norm, weight, then the gate in fp32;
    `gate` the activation: Kimi Delta Attention's is the sigmoid). The weight is replicated; its gradient is partial
    over TP (marked like a sequence-parallel norm's)."""
    gate = staticmethod(F.silu)

    def __init__(self, size: int, eps: float, dtype=None):
        super().__init__()
        self.eps = eps
        self.weight = mark_parallel(nn.Parameter(torch.empty(size, dtype=dtype, device="meta")), None, True)

    def reset_parameters(self) -> None:
        if self.weight.device.type != "meta":
            with torch.no_grad():
                self.weight.fill_(1.0)

    def forward(self, x: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        return (kernels.rms_norm(x, self.weight, self.eps) * self.gate(z.to(compute_dtype(z.dtype)))).to(x.dtype)


class DeltaRule(nn.Module):
    """The gated delta rule with L2-normalized q, k (kernels.gated_delta_rule: chunked, or recurrent for one token):
    the parameterless core selective recomputation wraps."""

    def __init__(self, chunk_size: int):
        super().__init__()
        self.chunk_size = chunk_size

    def forward(self, q, k, v, g, beta, starts=None, initial_state=None, output_final_state: bool = False):
        return kernels.gated_delta_rule(q, k, v, g, beta, initial_state=initial_state,
                                        output_final_state=output_final_state, qk_l2norm=True, starts=starts,
                                        chunk_size=self.chunk_size)


@register_token_mixer("gated_deltanet")
class GatedDeltaNet(nn.Module):
    """Gated DeltaNet of layer `layer` (module docstring), settings in cfg.gated_deltanet. forward(x, ctx, cache):
    x [b, s(/tp under SP), hidden]; ctx.docs the packed batch's documents; cache a GatedDeltaNetCache."""
    hf_tensor_maps = staticmethod(gated_deltanet_hf.hf_tensor_maps)  # its Hugging Face names
    rotary = None

    def __init__(self, cfg: ModelConfig, layer: int, layout: ModelLayout):
        super().__init__()
        g, dims = cfg.gated_deltanet, layout.dims
        tp = dims.tp
        self.check_parallel(cfg, layer, tp, dims.cp, dims.ep)
        self.g, self.dims = g, dims
        self.key_heads, self.value_heads = g.num_key_heads // tp, g.num_value_heads // tp
        kw = {"dtype": layout.dtype, "device": "meta"}
        # A_log and dt_bias are drawn first, by this module's own reset_parameters, before its children's: the order
        # a model's init_weights (every submodule's reset_parameters in registration order) follows.
        self.A_log = mark_parallel(nn.Parameter(torch.empty(self.value_heads, **kw)), 0)
        self.dt_bias = mark_parallel(nn.Parameter(torch.empty(self.value_heads, **kw)), 0)
        init = normal_init(cfg.initializer_range)  # transformers' init of every projection (no residual scaling)
        self.in_proj = ColumnParallelLinear(cfg.hidden_size, sum(g.in_proj_parts), bias=False,
                                            shard_spec=ShardSpec(0, parts=g.in_proj_parts), init_method=init,
                                            **layout.linear)
        self.conv = ShortConv(g, layout, cfg.initializer_range)
        self.norm = GatedRMSNorm(g.value_head_dim, cfg.norm_eps, layout.dtype)
        self.out_proj = RowParallelLinear(g.value_dim, cfg.hidden_size, bias=False, init_method=init, **layout.linear)
        self.core = DeltaRule(g.chunk_size)

    def reset_parameters(self) -> None:
        """A_log = log(uniform(0.01, 16)) (transformers' init), dt_bias = 1; the children reset themselves."""
        if self.A_log.device.type == "meta":
            return
        _init_shard(self.A_log, (self.g.num_value_heads,), ShardSpec(0), lambda t: t.uniform_(0.01, 16).log_(),
                    self.dims.tp_rank, self.dims.tp)
        with torch.no_grad():
            self.dt_bias.fill_(1.0)

    def new_cache(self, batch: int, max_length: int | None = None) -> GatedDeltaNetCache:
        """An empty cache for `batch` sequences (any length: its size does not grow)."""
        w = self.conv.weight
        return GatedDeltaNetCache(
            w.new_zeros(batch, self.g.conv_kernel - 1, w.shape[0]),
            torch.zeros(batch, self.value_heads, self.g.key_head_dim, self.g.value_head_dim,
                        dtype=torch.float32, device=w.device))

    @staticmethod
    def check_parallel(cfg: ModelConfig, layer: int, tp: int, cp: int = 1, ep: int = 1) -> None:
        """ParallelLayoutError where whole key-head groups cannot split over tp (and, by all-to-all, cp): the one
        copy of this check (the layer's build, the preflight and the plan ask it)."""
        nk = cfg.gated_deltanet.num_key_heads
        if nk % (tp * cp):
            what = f"tp={tp}" if cp == 1 else f"tp x cp = {tp} x {cp}"
            raise ParallelLayoutError(
                f"{what} does not divide linear_num_key_heads={nk}: Gated DeltaNet splits whole "
                f"key-head groups over tp{' and, by all-to-all, over cp' if cp > 1 else ''}"
                + ("; use a cp that divides the key heads per tp rank, or cp=1" if cp > 1 else ""))

    def forward(self, x: torch.Tensor, ctx: Context | None = None, cache: GatedDeltaNetCache | None = None):
        g, cp = self.g, self.dims.cp
        kd, vd, nv = self.key_heads * g.key_head_dim, self.value_heads * g.value_head_dim, self.value_heads
        # one matmul enters the TP region for all six parts (under SP: gathers the sequence, keeps only the shard)
        qkv, z, b, a = self.in_proj(x).split([2 * kd + vd, vd, nv, nv], dim=-1)
        docs = ctx.docs if ctx is not None else None
        starts = None if docs is None else document_starts(docs.ids)
        conv_w, A_log, dt_bias = self.conv.weight, self.A_log, self.dt_bias
        if cp > 1:
            if cache is not None:
                raise ConfigError("context parallelism (cp > 1) does not decode with a cache: generate at cp=1")
            q, k, v, b, a = to_head_group([*qkv.split([kd, kd, vd], dim=-1), b, a], self.dims)
            qkv = torch.cat([q, k, v], dim=-1)  # every token, this cp rank's heads/cp
            conv_w = cp_share(conv_w, (kd, kd, vd), self.dims)
            A_log, dt_bias = cp_share(A_log, (nv,), self.dims), cp_share(dt_bias, (nv,), self.dims)
            kd, vd, nv = kd // cp, vd // cp, nv // cp
        mixed, conv_tail = causal_conv(qkv, conv_w, None if cache is None else cache.conv, starts)
        q, k, v = mixed.split([kd, kd, vd], dim=-1)
        q, k = (t.unflatten(-1, (-1, g.key_head_dim)) for t in (q, k))
        v = v.unflatten(-1, (nv, g.value_head_dim))
        beta = b.sigmoid()
        f32 = compute_dtype(a.dtype)
        decay = -A_log.to(f32).exp() * F.softplus(a.to(f32) + dt_bias)
        o, state = self.core(q, k, v, decay, beta, starts, None if cache is None else cache.state, cache is not None)
        if cp > 1:
            o = to_own_tokens(o, self.dims)
        if cache is not None:
            cache.conv, cache.state = conv_tail, state
        o = self.norm(o, z.unflatten(-1, (self.value_heads, g.value_head_dim)))
        return self.out_proj(o.flatten(-2))

    # -- sizes, without building (ModelConfig.num_parameters, flops_per_token) ----------------------------------

    @staticmethod
    def num_parameters(cfg: ModelConfig, layer: int, active: bool = False) -> int:
        g, h = cfg.gated_deltanet, cfg.hidden_size
        conv = sum(g.conv_parts) * g.conv_kernel
        return h * sum(g.in_proj_parts) + conv + 2 * g.num_value_heads + g.value_head_dim + g.value_dim * h

    @staticmethod
    def sequence_flops(cfg: ModelConfig, layer: int, seq_len: int) -> int:
        """Forward FLOPs per token beyond the projections (2 per multiply-add, the causal half not discounted, as
        attention's), independent of the sequence length (the conv's 2 K per channel is counted with the
        parameters, by ModelConfig.flops_per_token, as a depthwise matmul): the chunked rule per value head and
        chunk of C tokens (kernels/gated_delta.py): k k^T and q k^T (2 C^2 d_k), the two unitriangular solves
        (C^2 (d_k + d_v) / 2), the intra-chunk products with the new values (C^2 d_v) and the state's three products
        (3 C d_k d_v): per token C (5 d_k + 3 d_v) + 6 d_k d_v."""
        g = cfg.gated_deltanet
        c, dk, dv = g.chunk_size, g.key_head_dim, g.value_head_dim
        return g.num_value_heads * (c * (5 * dk + 3 * dv) + 6 * dk * dv)
