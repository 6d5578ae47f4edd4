"""Plan costs of Kimi Delta Attention, the "kimi_delta" token mixer (models/kinds/kimi_delta.py; Kimi Linear), tested
against that module (tests/test_plan_kimi_delta.py).

On one tp rank with Hl = num_heads / tp heads of d = head_dim (d_k = d_v = d), D = Hl d, K the short convolution's
kernel: in_proj column-parallel [3D + Hl, h] (q|k|v|b), the conv's weight [3D, K], A_log [Hl] and dt_bias [D]
split with the heads; the decay's and the output gate's down projections f_a_proj and g_a_proj [d, h] replicated
(each rank runs them on its own tokens: its sequence shard under SP, where their gradients are partial like a
norm's), their up projections f_b_proj and g_b_proj [D, d] column-parallel; the gated norm's weight [d] replicated
with a partial gradient at any layout (each rank normalizes its own heads); o_proj row-parallel [h, D].
Its generation state is fixed-size (KDA's state): per sequence the recurrent state, Hl x d x d in fp32, and the
conv's last K-1 inputs (3D channels): nothing that grows with the length, no KV.
Its core per head and token (forward FLOPs, the causal half not discounted): Gated DeltaNet's chunked rule (C (5 d +
3 d) + 6 d^2, tpzoo/plan/kinds/gated_deltanet.py) plus the per-channel decay factors of k beta k^T and q k^T inside
each sub-chunk of 16 tokens (4 x 16 d), the kind's own sequence_flops; plus the conv's 2 K per channel.
Collectives (tp > 1): three column entries, x into in_proj and the two d-wide latents into f_b_proj and g_b_proj
(without SP: all-reduces of their gradients; with SP: all-gathers, their conjugates, and the regather of each for
its weight gradient), o_proj's exit. Under context parallelism two all-to-alls over cp per forward (q|k|v|b|f of
this rank's tokens to the whole sequence of heads / cp: 4D + Hl features per token; the rule's output back, D) and
two in backward.
Activations (approximate, unlike Gated DeltaNet's exact count): what the torch reference's per-channel chunked rule
keeps, counted term by term on the CPU at tp 1 (bf16, d 8 and 16, chunks of 64, sub-chunks of 16) and within 2% of
the measured bytes when the sequence fills whole chunks: per padded token and head in fp32 the sub-chunk pair
factors and the two copies bmm makes of them (3 sub d), the cross-sub-chunk ones (3 m d, m = C / sub), two C-wide
rows (the solves' L and q k^T), and about 16.5 d of chunked vectors (U, W, q_in, k_out, k beta, ...); per token and
head the fp32 q, k, v, decay and the L2 norms' tensors (6 d) and in the activation dtype the projections, the conv's
pre-activation and output (9 d), the rule's output and the gate (2 d); per token the layer's input (its shard under
SP) and the two latents. A sequence ending in a partial chunk keeps fewer of bmm's copies (up to 20% less); fla's
kernels (CUDA) keep what Gated DeltaNet's fla path keeps, with a decay per channel (not measured here: no GPU).
"""
from __future__ import annotations

from tpzoo.parallel.dims import ParallelLayoutError

from ..costs import Collective, Matmul, Stateless, Weights, register_cost
from .gated_deltanet import head_exchange

SUB = 16  # the rule's sub-chunk (kernels/gated_delta.py SUB)


class _Shape:
    def __init__(self, cfg, tp: int):
        g = getattr(cfg, "kimi_delta", None)
        if g is None:
            raise ParallelLayoutError("a 'kimi_delta' layer needs the model config's kimi_delta settings")
        self.h, self.d, self.K, self.C = cfg.hidden_size, g.head_dim, g.conv_kernel, g.chunk_size
        self.hl = g.num_heads // tp
        self.D = self.hl * self.d
        self.conv = 3 * self.D              # q|k|v channels
        self.proj = 3 * self.D + self.hl    # q|k|v|b


@register_cost("kimi_delta")
class KimiDeltaCost(Stateless):
    @staticmethod
    def plan_weights(cfg, layer, at) -> Weights:
        s = _Shape(cfg, at.tp)
        down = 2 * s.d * s.h  # f_a_proj, g_a_proj (replicated)
        numel = s.hl + s.D + s.h * s.proj + s.conv * s.K + down + 2 * s.D * s.d + s.d + s.D * s.h
        return Weights(numel=numel, tensors=10, partial_sp=down, partial=s.d)

    @staticmethod
    def plan_matmuls(cfg, layer, at) -> list:
        s = _Shape(cfg, at.tp)
        return [Matmul("in_proj", s.proj, s.h),
                Matmul("f_a_proj", s.d, s.h, shard=True, fp8=False), Matmul("f_b_proj", s.D, s.d),
                Matmul("g_a_proj", s.d, s.h, shard=True, fp8=False), Matmul("g_b_proj", s.D, s.d),
                Matmul("o_proj", s.h, s.D)]

    @staticmethod
    def plan_mixing_flops(cfg, layer, at, seq_len: int) -> float:
        s = _Shape(cfg, at.tp)
        sub = SUB if s.C % SUB == 0 else s.C
        return 2 * s.K * s.conv + s.hl * (s.C * 8 * s.d + 6 * s.d * s.d + 4 * sub * s.d)

    @staticmethod
    def plan_activations(cfg, layer, at, micro_batch: int, seq_len: int) -> int:
        if at.recompute == "full":
            return 0
        s, e = _Shape(cfg, at.tp), at.act_bytes
        d, hl, C = s.d, s.hl, s.C
        tokens = micro_batch * seq_len
        if at.kernels == "reference":
            sub = SUB if C % SUB == 0 else C
            padded = micro_batch * -(-seq_len // C) * C
            rule = 4 * padded * hl * ((3 * sub + 3 * (C // sub)) * d + 2 * C) + 2 * padded * hl * 33 * d
            rule += tokens * hl * 4 * 6 * d
        else:  # fla: q, k (+ fp32 norm statistics), v, the per-channel g, beta, the chunk's solve
            rule = tokens * hl * (2 * e * d + 8 + e * d + 4 * d + e + 4 * C)
        return rule + tokens * hl * e * 11 * d + tokens * e * (s.h // at.sp_div + 2 * d)

    @staticmethod
    def plan_collectives(cfg, layer, at, tokens: int) -> list:
        s, e = _Shape(cfg, at.tp), at.act_bytes
        out = []
        if at.tp > 1:
            full = tokens * s.h * e
            entries = [full, tokens * s.d * e, tokens * s.d * e]  # x, f's latent, the gate's latent
            if at.sequence_parallel:
                out += [Collective("all_gather", "tp", p) for p in entries]
                out += [Collective("reduce_scatter", "tp", p, phase="backward") for p in entries]
                out += [Collective("all_gather", "tp", p, phase="regather") for p in entries]
                out += [Collective("reduce_scatter", "tp", full), Collective("all_gather", "tp", full,
                                                                              phase="backward")]
            else:
                out += [Collective("all_reduce", "tp", p, phase="backward") for p in entries]
                out += [Collective("all_reduce", "tp", full)]
        if at.cp > 1:
            out += head_exchange(tokens * (4 * s.D + s.hl) * e, tokens * s.D * e)  # q|k|v|b|f; the output
        return out

    @staticmethod
    def plan_cache_bytes(cfg, layer, at, batch: int, length: int) -> int:
        """The kind's GatedDeltaNetCache: the conv's last K-1 inputs and the fp32 recurrent state, any length."""
        s = _Shape(cfg, at.tp)
        return batch * ((s.K - 1) * s.conv * at.act_bytes + 4 * s.hl * s.d * s.d)
