"""Gated DeltaNet, the linear-attention token mixer of Qwen3.5 and Qwen3-Next, tensor-parallel.

    x -> in_proj -> q|k|v -> causal depthwise conv (kernel K) + SiLU -> q, k (L2-normalized), v
                 -> z (output gate), b -> beta = sigmoid(b), a -> g = -exp(A_log) * softplus(a + dt_bias)
    o = gated delta rule(q, k, v, g, beta) (kernels/gated_delta.py)   ->   out_proj(RMSNorm(o) * w * silu(z))

TP split: by key heads. Each rank holds num_key_heads/tp whole key heads with the num_value_heads/tp value heads
that read them (value head h reads key head h // (value heads / key heads)), so no part of the recurrence crosses
ranks. in_proj is one column-parallel matmul whose parts q|k|v|z|b|a are split separately (HF's in_proj_qkv,
in_proj_z, in_proj_b, in_proj_a; Qwen3-Next's grouped in_proj_qkvz / in_proj_ba are regrouped into it by
gated_deltanet_hf.py); the conv's channels (this rank's q|k|v), A_log and dt_bias split with the heads; the gated
norm's weight [d_v] is replicated and its gradient, partial (each rank sees its heads only), is summed over TP
like a sequence-parallel norm's; out_proj is row-parallel.
What crosses ranks: the column entry (identity, or the SP all-gather of the sequence) and the row exit (all-reduce,
or the SP reduce-scatter), as for attention. With context parallelism (dims.cp > 1, each cp rank holding 2 of the
2*cp load-balanced chunks) two all-to-alls over the cp group per forward (two in backward), as Megatron-Core does:
q|k|v|b|a of this rank's tokens and all its heads -> every token of heads/cp of them, before the conv; the rule's
output back. The gathered sequence is put in natural order, so the conv and the recurrence see the whole sequence
in order and the result is exact. Needs the key heads per TP rank divisible by cp.
Cache (generation): GatedDeltaNetCache, the conv's last K-1 inputs [b, K-1, this rank's channels] and the
recurrent state [b, this rank's value heads, d_k, d_v] (fp32): a fixed size, nothing that grows with the length.
Documents (packing): the conv reads no token of another document and the recurrence restarts at every document,
so a packed row equals its documents run one by one.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from tpzoo import kernels
from tpzoo.errors import ConfigError
from tpzoo.kernels.gated_delta import document_starts
from tpzoo.parallel import (ColumnParallelLinear, ParallelDims, ParallelLayoutError, RowParallelLinear, ShardSpec,
                            mark_parallel, normal_init)
from tpzoo.parallel.layers import _init_shard
from tpzoo.parallel.ulysses import exchange, gathered_order


@dataclass(frozen=True)
class GatedDeltaNetConfig:
    hidden_size: int
    num_key_heads: int       # HF linear_num_key_heads
    num_value_heads: int     # HF linear_num_value_heads (a multiple of the key heads)
    key_head_dim: int        # HF linear_key_head_dim
    value_head_dim: int      # HF linear_value_head_dim
    conv_kernel: int = 4     # HF linear_conv_kernel_dim
    norm_eps: float = 1e-6   # HF rms_norm_eps (the gated norm's)
    init_std: float = 0.02   # HF initializer_range
    chunk_size: int = 64

    def __post_init__(self):
        if self.num_value_heads % self.num_key_heads:
            raise ConfigError(f"linear_num_value_heads={self.num_value_heads} is not a multiple of "
                              f"linear_num_key_heads={self.num_key_heads}")
        if self.conv_kernel < 1:
            raise ConfigError(f"linear_conv_kernel_dim must be >= 1, got {self.conv_kernel}")

    @property
    def key_dim(self) -> int:
        return self.num_key_heads * self.key_head_dim

    @property
    def value_dim(self) -> int:
        return self.num_value_heads * self.value_head_dim

    @property
    def conv_parts(self) -> tuple[int, ...]:
        return self.key_dim, self.key_dim, self.value_dim  # q | k | v

    @property
    def in_proj_parts(self) -> tuple[int, ...]:
        return (*self.conv_parts, self.value_dim, self.num_value_heads, self.num_value_heads)  # .. | z | b | a

    @classmethod
    def from_hf(cls, hf) -> GatedDeltaNetConfig:
        """From a transformers Qwen3.5 (text) or Qwen3-Next config."""
        if getattr(hf, "hidden_act", "silu") not in ("silu", "swish"):
            raise ConfigError(f"Gated DeltaNet's short convolution uses SiLU; hidden_act={hf.hidden_act!r}")
        return cls(hf.hidden_size, hf.linear_num_key_heads, hf.linear_num_value_heads, hf.linear_key_head_dim,
                   hf.linear_value_head_dim, hf.linear_conv_kernel_dim, hf.rms_norm_eps,
                   getattr(hf, "initializer_range", 0.02))


@dataclass
class GatedDeltaNetCache:
    """One layer's generation state for a batch of sequences (this rank's heads and channels)."""
    conv: torch.Tensor    # [b, K-1, channels]: the short conv's last inputs
    state: torch.Tensor   # [b, value heads, d_k, d_v], fp32: the recurrent state
    length: int = 0       # tokens seen


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


class ShortConv(nn.Module):
    """The causal depthwise convolution's weight [this rank's q|k|v channels, K]; split with the heads."""

    def __init__(self, cfg: GatedDeltaNetConfig, dims: ParallelDims, dtype=None, device=None):
        super().__init__()
        self.dims, self.spec, self.std = dims, ShardSpec(0, parts=cfg.conv_parts), cfg.init_std
        self.full_shape = (sum(cfg.conv_parts), cfg.conv_kernel)
        self.weight = mark_parallel(nn.Parameter(torch.empty(
            self.spec.local_size(self.full_shape[0], dims.tp), cfg.conv_kernel, dtype=dtype, device=device)),
            self.spec)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        _init_shard(self.weight, self.full_shape, self.spec, normal_init(self.std), self.dims.tp_rank, self.dims.tp)


class GatedRMSNorm(nn.Module):
    """RMSNorm over each head's d_v, times silu(z) (transformers' RMSNormGated: norm, weight, then the gate in fp32).
    The weight is replicated; its gradient is partial over TP (marked like a sequence-parallel norm's)."""

    def __init__(self, size: int, eps: float, dtype=None, device=None):
        super().__init__()
        self.eps = eps
        self.weight = mark_parallel(nn.Parameter(torch.empty(size, dtype=dtype, device=device)), None, True)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        if self.weight.device.type != "meta":
            with torch.no_grad():
                self.weight.fill_(1.0)

    def forward(self, x: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        return (kernels.rms_norm(x, self.weight, self.eps) * F.silu(z.float())).to(x.dtype)


class GatedDeltaNet(nn.Module):
    """Gated DeltaNet on this rank of `dims` (module docstring). forward(x, cache=None, docs=None): x [b, s, hidden]
    (under SP this rank's s/tp tokens); cache a GatedDeltaNetCache (new_cache) to prefill or decode into; docs a
    models.documents.Documents (its ids [b, S] over the whole sequence) of a packed batch."""

    def __init__(self, cfg: GatedDeltaNetConfig, dims: ParallelDims, sequence_parallel: bool = False, dtype=None,
                 device=None):
        super().__init__()
        tp, cp = dims.tp, dims.cp
        if cfg.num_key_heads % (tp * cp):
            what = f"tp={tp}" if cp == 1 else f"tp x cp = {tp} x {cp}"
            raise ParallelLayoutError(
                f"{what} does not divide linear_num_key_heads={cfg.num_key_heads}: Gated DeltaNet splits whole "
                f"key-head groups over tp{' and, by all-to-all, over cp' if cp > 1 else ''}"
                + ("; use a cp that divides the key heads per tp rank, or cp=1" if cp > 1 else ""))
        self.cfg, self.dims, self.sequence_parallel = cfg, dims, sequence_parallel
        self.key_heads, self.value_heads = cfg.num_key_heads // tp, cfg.num_value_heads // tp
        device = dims.device if device is None else device
        kw = dict(dtype=dtype, device=device)
        # A_log and dt_bias are drawn first, by this module's own reset_parameters, before its children's: the order
        # a model's init_weights (every submodule's reset_parameters in registration order) also follows.
        self.A_log = mark_parallel(nn.Parameter(torch.empty(self.value_heads, **kw)), 0)
        self.dt_bias = mark_parallel(nn.Parameter(torch.empty(self.value_heads, **kw)), 0)
        self.reset_parameters()
        init = normal_init(cfg.init_std)
        self.in_proj = ColumnParallelLinear(cfg.hidden_size, sum(cfg.in_proj_parts), bias=False,
                                            shard_spec=ShardSpec(0, parts=cfg.in_proj_parts),
                                            sequence_parallel=sequence_parallel, init_method=init, dims=dims, **kw)
        self.conv = ShortConv(cfg, dims, **kw)
        self.norm = GatedRMSNorm(cfg.value_head_dim, cfg.norm_eps, **kw)
        self.out_proj = RowParallelLinear(cfg.value_dim, cfg.hidden_size, bias=False,
                                          sequence_parallel=sequence_parallel, init_method=init, dims=dims, **kw)

    def reset_parameters(self) -> None:
        """A_log = log(uniform(0.01, 16)) (transformers' init), dt_bias = 1; the children reset themselves."""
        if self.A_log.device.type == "meta":
            return
        _init_shard(self.A_log, (self.cfg.num_value_heads,), ShardSpec(0), lambda t: t.uniform_(0.01, 16).log_(),
                    self.dims.tp_rank, self.dims.tp)
        with torch.no_grad():
            self.dt_bias.fill_(1.0)

    def new_cache(self, batch: int) -> GatedDeltaNetCache:
        """An empty cache for `batch` sequences: prefill with a forward of the prompt, then decode token by token."""
        w = self.conv.weight
        return GatedDeltaNetCache(
            w.new_zeros(batch, self.cfg.conv_kernel - 1, w.shape[0]),
            torch.zeros(batch, self.value_heads, self.cfg.key_head_dim, self.cfg.value_head_dim,
                        dtype=torch.float32, device=w.device))

    def forward(self, x: torch.Tensor, cache: GatedDeltaNetCache | None = None, docs=None) -> torch.Tensor:
        cfg, cp = self.cfg, self.dims.cp
        kd, vd, nv = self.key_heads * cfg.key_head_dim, self.value_heads * cfg.value_head_dim, self.value_heads
        # one matmul enters the TP region for all six parts (under SP: gathers the sequence, keeps only the shard)
        qkv, z, b, a = self.in_proj(x).split([2 * kd + vd, vd, nv, nv], dim=-1)
        starts = None if docs is None else document_starts(docs.ids)
        conv_w, A_log, dt_bias = self.conv.weight, self.A_log, self.dt_bias
        if cp > 1:
            if cache is not None:
                raise ConfigError("context parallelism (cp > 1) does not decode with a cache: generate at cp=1")
            qkv, b, a = self._to_heads(qkv, b, a)  # every token, this cp rank's heads/cp
            conv_w, A_log, dt_bias = self._head_group(conv_w, A_log, dt_bias)
            kd, vd, nv = kd // cp, vd // cp, nv // cp
        mixed, conv_tail = causal_conv(qkv, conv_w, None if cache is None else cache.conv, starts)
        q, k, v = mixed.split([kd, kd, vd], dim=-1)
        q, k = (t.unflatten(-1, (-1, cfg.key_head_dim)) for t in (q, k))
        v = v.unflatten(-1, (nv, cfg.value_head_dim))
        beta = b.sigmoid()
        g = -A_log.float().exp() * F.softplus(a.float() + dt_bias)
        o, state = kernels.gated_delta_rule(q, k, v, g, beta, initial_state=None if cache is None else cache.state,
                                            output_final_state=cache is not None, qk_l2norm=True, starts=starts,
                                            chunk_size=cfg.chunk_size)
        if cp > 1:
            o = self._to_sequence(o)
        if cache is not None:
            cache.conv, cache.state, cache.length = conv_tail, state, cache.length + z.shape[1]
        o = self.norm(o, z.unflatten(-1, (self.value_heads, cfg.value_head_dim)))
        return self.out_proj(o.flatten(-2))

    # context parallelism: all-to-all over heads (module docstring)

    def _to_heads(self, qkv, b, a):
        """This rank's tokens [B, 2c, *] of all its heads -> the whole sequence (natural order) of its cp group's
        heads: q|k|v|b|a packed per head group so that one all-to-all carries them."""
        cp, kd = self.dims.cp, self.key_heads * self.cfg.key_head_dim
        q, k, v = qkv.split([kd, kd, qkv.shape[-1] - 2 * kd], dim=-1)
        parts = [t.unflatten(-1, (cp, -1)) for t in (q, k, v, b, a)]  # [B, 2c, cp, width / cp]
        widths = [p.shape[-1] for p in parts]
        packed = torch.cat(parts, dim=-1).transpose(1, 2).contiguous()  # [B, cp, 2c, W]
        _, natural = gathered_order(packed.shape[2] // 2, cp, packed.device)
        whole = exchange(packed, self.dims.cp_group, cp, 1, 2).squeeze(1).index_select(1, natural)  # [B, S, W]
        q, k, v, b, a = whole.split(widths, dim=-1)
        return torch.cat([q, k, v], dim=-1), b, a

    def _to_sequence(self, o):
        """The rule's output [B, S, heads/cp, d_v] back to this rank's tokens of all its heads [B, 2c, heads, d_v]."""
        cp = self.dims.cp
        order, _ = gathered_order(o.shape[1] // (2 * cp), cp, o.device)
        ranked = o.flatten(-2).index_select(1, order).unsqueeze(1)  # [B, 1, S, W] in rank order
        back = exchange(ranked.contiguous(), self.dims.cp_group, cp, 2, 1)  # [B, cp, 2c, W]: head group by rank
        return back.transpose(1, 2).reshape(o.shape[0], -1, self.value_heads, self.cfg.value_head_dim)

    def _head_group(self, conv_w, A_log, dt_bias):
        """This cp rank's share of the per-head parameters: conv rows of its q, k, v heads; A_log, dt_bias."""
        cp, r, cfg = self.dims.cp, self.dims.cp_rank, self.cfg
        kd, vd, nv = self.key_heads * cfg.key_head_dim, self.value_heads * cfg.value_head_dim, self.value_heads
        rows = torch.cat([torch.arange(r * n // cp, (r + 1) * n // cp, device="cpu") + off
                          for n, off in ((kd, 0), (kd, kd), (vd, 2 * kd))]).to(conv_w.device)
        heads = slice(r * nv // cp, (r + 1) * nv // cp)
        return conv_w.index_select(0, rows), A_log[heads], dt_bias[heads]
