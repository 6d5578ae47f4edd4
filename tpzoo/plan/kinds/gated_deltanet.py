"""Plan costs of Gated DeltaNet, the "gated_deltanet" token mixer (models/kinds/gated_deltanet.py; Qwen3.5, Qwen3-Next),
tested against that module (tests/test_plan_kinds.py).

On one tp rank with kh = key heads / tp, vh = value heads / tp, kd = kh d_k, vd = vh d_v, K the short convolution's
kernel: in_proj column-parallel [2kd + 2vd + 2vh, h] (q|k|v|z|b|a), the conv's weight [2kd + vd, K], A_log and
dt_bias [vh], out_proj row-parallel [h, vd], the gated norm's weight [d_v] replicated with a partial gradient at any
layout (each rank normalizes its own heads). Its generation state is fixed-size: per sequence the recurrent state,
vh x d_k x d_v in fp32, and the conv's last K-1 inputs (nothing that grows with the length; no KV).
Its core, the chunked gated delta rule (chunks of C = 64 tokens, kernels/gated_delta.py), per value head and
token: C (5 d_k + 3 d_v) + 6 d_k d_v multiply-adds' worth of FLOPs (the chunk's k k^T, q k^T and the two
triangular solves, the scan's three state products and one C x C product), plus the conv's 2 K per channel.
Kept for the backward per token of the full sequence (this rank's heads), torch reference (what the CPU runs;
exact in 16-bit, tested): in_proj's output (the conv keeps it whole: q|k|v are views), the conv's padded input and
pre-activation, beta, the decay's fp32 softplus input and output, the L2 norms' fp32 inputs and statistics; per
chunk, in fp32, five C x C matrices per value head (the decay mask D, k k^T before and after it, q k^T before and
after it), the chunked k, k beta, q, q decayed (from the second chunk on), k decayed to the chunk's end, v, U, W, u,
three decay vectors and beta, and one d_k x d_v state per chunk; then the gated norm's tensors and out_proj's
input. With the fused kernels (fla on CUDA) the rule keeps q, k, v, g, beta, their norms' statistics and the
chunk's C-wide solve instead (approximate: fla's own choice, not measured here).
Collectives: the TP region's entry and exit (tp > 1); under context parallelism two all-to-alls over cp per
forward (q|k|v|b|a of this rank's tokens to whole sequences of heads / cp, and the rule's output back) and two in
backward, synchronous.
"""
from __future__ import annotations

from tpzoo.parallel.dims import ParallelLayoutError

from ..costs import Collective, Matmul, Stateless, Weights, entry_exit, register_cost

CHUNK = 64


class _Shape:
    def __init__(self, cfg, tp: int):
        g = gated_deltanet_config(cfg)
        self.h = cfg.hidden_size
        self.nk, self.nv, self.dk, self.dv = g.num_key_heads, g.num_value_heads, g.key_head_dim, g.value_head_dim
        self.kh, self.vh = self.nk // tp, self.nv // tp
        self.kd, self.vd = self.kh * self.dk, self.vh * self.dv
        self.K, self.C = g.conv_kernel, getattr(g, "chunk_size", CHUNK)
        self.conv = 2 * self.kd + self.vd                       # q|k|v channels
        self.proj = 2 * self.kd + 2 * self.vd + 2 * self.vh     # q|k|v|z|b|a


def gated_deltanet_config(cfg):
    """ModelConfig.gated_deltanet (the sub-config issue 33 phase 2 adds, with GatedDeltaNetConfig's field names)."""
    g = getattr(cfg, "gated_deltanet", None)
    if g is None:
        raise ParallelLayoutError("a 'gated_deltanet' layer needs the model config's gated_deltanet settings")
    return g


def head_exchange(inputs: int, output: int) -> list:
    """A linear attention's context parallelism (ulysses.exchange): its inputs' heads exchanged for the whole
    sequence by one all-to-all over cp, the rule's output back by another, and both again in backward."""
    return [Collective("all_to_all", "cp", inputs), Collective("all_to_all", "cp", output),
            Collective("all_to_all", "cp", inputs, phase="backward"),
            Collective("all_to_all", "cp", output, phase="backward")]


def rule_bytes(s: _Shape, micro_batch: int, seq_len: int, e: int, kernels: str) -> int:
    """What the gated delta rule keeps for one micro-batch (module docstring)."""
    b, vh, kh, dk, dv, C = micro_batch, s.vh, s.kh, s.dk, s.dv, s.C
    tokens = b * seq_len
    if kernels != "reference":  # fla: q, k (+ fp32 norm statistics), v, g, beta, the chunk's solve
        return tokens * (2 * e * kh * dk + 8 * kh + e * vh * dv + 4 * vh + e * vh + 4 * vh * C)
    n = -(-seq_len // C)
    padded = b * n * C  # every sequence padded to whole chunks
    # the L2 norms' fp32 inputs (in fp32 they are views of the conv's whole output) and statistics
    norms = tokens * (8 * kh + (4 * s.conv if e == 4 else 8 * s.kd))
    per_padded = 4 * vh * (5 * dk + 3 * dv + 4) + (4 * vh * dk if n > 1 else 0)  # k, kβ, q, W, k_out (+ q_in);
    # v, U, u; beta and three decay vectors
    return norms + padded * per_padded + 5 * 4 * vh * b * n * C * C + 4 * vh * b * n * (1 + dk * dv) + C * C


@register_cost("gated_deltanet")
class GatedDeltaNetCost(Stateless):
    @staticmethod
    def plan_weights(cfg, layer, at) -> Weights:
        s = _Shape(cfg, at.tp)
        numel = 2 * s.vh + s.h * s.proj + s.conv * s.K + s.dv + s.vd * s.h
        return Weights(numel=numel, tensors=6, partial=s.dv)

    @staticmethod
    def plan_matmuls(cfg, layer, at) -> list:
        s = _Shape(cfg, at.tp)
        return [Matmul("in_proj", s.proj, s.h), Matmul("out_proj", s.h, s.vd)]

    @staticmethod
    def plan_mixing_flops(cfg, layer, at, seq_len: int) -> float:
        s = _Shape(cfg, at.tp)
        return 2 * s.K * s.conv + s.vh * (s.C * (5 * s.dk + 3 * s.dv) + 6 * s.dk * s.dv)

    @staticmethod
    def plan_activations(cfg, layer, at, micro_batch: int, seq_len: int) -> int:
        if at.recompute == "full":
            return 0
        s, e = _Shape(cfg, at.tp), at.act_bytes
        tokens, rows = micro_batch * seq_len, micro_batch * (seq_len + s.K - 1)
        conv = tokens * e * (s.proj + s.conv) + rows * e * s.conv  # in_proj's output, the conv's pre-activation;
        # its input padded with the K-1 tokens before (zeros)
        gates = tokens * (e * s.vh + 8 * s.vh) + 8 * s.vh  # beta; softplus's fp32 input and output; -exp(A_log)
        if at.kernels == "reference":  # the norm: an fp32 copy of its input (in fp32 the rule's padded output
            # itself), the statistics, the normalized tensor
            copy = micro_batch * -(-seq_len // s.C) * s.C * 4 * s.vd if e == 4 else tokens * 4 * s.vd
            norm = copy + tokens * (4 * s.vh + e * s.vd)
        else:
            norm = tokens * (e * s.vd + 4 * s.vh)
        gate = tokens * (e * s.vd + 4 * s.vd + (0 if e == 4 else 4 * s.vd))  # norm output, silu(z) (z in fp32)
        out = tokens * e * s.vd  # out_proj's input
        return (conv + gates + rule_bytes(s, micro_batch, seq_len, e, at.kernels) + norm + gate + out
                + e * s.h * tokens // at.sp_div)  # in_proj's input: this rank's shard under SP

    @staticmethod
    def plan_collectives(cfg, layer, at, tokens: int) -> list:
        out = entry_exit(cfg, at, tokens, tail=False)
        if at.cp > 1:
            s, e = _Shape(cfg, at.tp), at.act_bytes
            out += head_exchange(tokens * (s.conv + 2 * s.vh) * e, tokens * s.vd * e)  # q|k|v|b|a; the output
        return out

    @staticmethod
    def plan_cache_bytes(cfg, layer, at, batch: int, length: int) -> int:
        """GatedDeltaNetCache: the conv's last K-1 inputs and the fp32 recurrent state, whatever the length."""
        s = _Shape(cfg, at.tp)
        return batch * ((s.K - 1) * s.conv * at.act_bytes + 4 * s.vh * s.dk * s.dv)
