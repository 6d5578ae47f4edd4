"""Plan costs of the "moe" channel mixer (models/kinds/moe.py), exact (tests/test_plan_experts.py), and of shared
experts beside the routed ones (DeepSeekMoE, Qwen3-Next: not on main yet, see shared_expert_ffn: a dense MLP
split over tp, its own entry and exit collectives; a replicated sigmoid gate where the config says).

On one rank: the router [E, h] replicated (its gradient partial under SP, like a norm's: it sees this rank's tokens),
E/ep experts each split over tp like the dense MLP (etp = tp: gate|up [2f, h] and down [h, f], f = expert ffn / tp,
stacked per rank). A token goes through the router and k experts. Kept per token (moe_mlp_bytes): k dispatched rows
and their experts' intermediates; per token of the shard the router's outputs; per layer its statistics.
Collectives: under SP the MoE gathers its input (and the router's top-k weights and indices) itself and
reduce-scatters its output (no column layer re-gathers it in backward), else it enters like a column layer and
leaves with an all-reduce; the top-k weights enter the TP region with the tokens. Expert parallelism (ep > 1): the
per-expert counts (one all_to_all of E int64) and two all_to_all_v of the T*k rows of h (dispatch, return) forward,
the two row exchanges again in backward ((ep-1)/ep of the rows leave the rank in expectation).
"""
from __future__ import annotations


from ..costs import Acts, Collective, Matmul, Stateless, Weights, entry_exit, register_cost
from .mlp import gated_mlp_acts


def shared_expert_ffn(cfg) -> int:
    """Total hidden width of the always-on shared experts beside the routed ones (0: none): MoEConfig.shared_expert_ffn
    as the frontier / hybrid families set it (DeepSeek n_shared_experts * moe_intermediate_size, Qwen3-Next
    shared_expert_intermediate_size; read with a default: main's MoEConfig has no such field yet). They compute as
    the MoE kind does: a dense gated MLP on this rank's tokens, split over tp like the dense MLP, with its own
    entry and exit collectives (models/kinds/moe.py on those branches)."""
    return int(getattr(cfg.moe, "shared_expert_ffn", 0) or 0)


def shared_expert_gate(cfg) -> bool:
    """Qwen3-Next's sigmoid gate on the shared expert (one [1, h] weight, replicated, partial under SP)."""
    return bool(getattr(cfg.moe, "shared_expert_gate", False))


def moe_mlp_bytes(cfg, at) -> tuple:
    """(per token of the full sequence, per token of this rank's shard, per layer) bytes an MoE MLP keeps beyond its
    input, in place of the dense MLP's. Every token is dispatched as k rows, and over the ep group this rank computes
    T * k rows in expectation (balanced routing; exactly at ep = 1): per row the dispatched input (e*h), its expert's
    gate|up output and activation (the dense MLP's 3 e*f, 4 with the torch references, over f = expert ffn / tp),
    the returned output the combine multiplies (e*h), the top-k weight (e) and the int64 orders that put rows back
    (two, and two more for the received rows at ep > 1). Per shard token the router: the logits (e*E, kept in
    last_stats), fp32 probabilities (4E; in 16-bit also the fp32 logits logsumexp keeps), the top-k indices (8k),
    the renormalization's inputs (4k + 4) and the z-loss's logsumexp (4). Per layer the router statistics of
    last_stats (fp32 counts and probability sums, the z-loss sum: 8E + 8), alive until the next forward."""
    e, k, E, h = at.act_bytes, cfg.moe.num_experts_per_tok, cfg.moe.num_experts, cfg.hidden_size
    f = cfg.expert_ffn // at.tp
    row = e * h + gated_mlp_acts(e, f, at.kernels) + e * h + e + 16 + (16 if at.ep > 1 else 0)
    router = e * E + 4 * E + (4 * E if e < 4 else 0) + 8 * k + ((4 * k + 4) if cfg.moe.norm_topk_prob else 0) + 4
    return k * row, router, 8 * E + 8


@register_cost("moe")
class MoECost(Stateless):
    @staticmethod
    def plan_weights(cfg, layer, at) -> Weights:
        E, h = cfg.moe.num_experts, cfg.hidden_size
        experts = E // at.ep * 3 * h * (cfg.expert_ffn // at.tp)
        shared = 3 * h * (shared_expert_ffn(cfg) // at.tp)  # gate|up column, down row (no biases)
        gate = h if shared_expert_gate(cfg) else 0
        return Weights(numel=E * h + experts + shared + gate, tensors=3 + (2 if shared else 0) + (gate > 0),
                       partial_sp=E * h + gate, expert=experts)

    @staticmethod
    def plan_matmuls(cfg, layer, at) -> list:
        E, k, h = cfg.moe.num_experts, cfg.moe.num_experts_per_tok, cfg.hidden_size
        f, local = cfg.expert_ffn // at.tp, E // at.ep
        out = [Matmul("router", E, h, shard=True, fp8=False),
               Matmul("gate_up", 2 * f, h, count=local, per_token=k, fp8=False),
               Matmul("down", h, f, count=local, per_token=k, fp8=False, tail=True)]
        shared = shared_expert_ffn(cfg) // at.tp
        if shared:  # TP-split like the dense MLP
            out += [Matmul("shared_in", 2 * shared, h), Matmul("shared_out", h, shared, tail=True)]
        if shared_expert_gate(cfg):
            out.append(Matmul("shared_gate", 1, h, shard=True, fp8=False))
        return out

    @staticmethod
    def plan_mixing_flops(cfg, layer, at, seq_len: int) -> float:
        return 0.0

    @staticmethod
    def plan_activations(cfg, layer, at, micro_batch: int, seq_len: int) -> int:
        e, E = at.act_bytes, cfg.moe.num_experts
        if at.recompute == "full":  # the router's last_stats outlive the checkpoint: logits and sums
            return Acts(shard=e * E, fixed=8 * E + 8).bytes(micro_batch * seq_len, at.sp_div)
        full, router, fixed = moe_mlp_bytes(cfg, at)
        shared = shared_expert_ffn(cfg) // at.tp
        shard = e * cfg.hidden_size + router
        if shared:  # the dense MLP's intermediates (its input is x, kept already); with the gate its sigmoid and
            # the MLP output it multiplies (not measured: main has no gate)
            full += gated_mlp_acts(e, shared, at.kernels)
            shard += (e + e * cfg.hidden_size) if shared_expert_gate(cfg) else 0
        return Acts(full=full, shard=shard, fixed=fixed).bytes(micro_batch * seq_len, at.sp_div)

    @staticmethod
    def plan_collectives(cfg, layer, at, tokens: int) -> list:
        out = []
        e, k, h, t = at.act_bytes, cfg.moe.num_experts_per_tok, cfg.hidden_size, at.tp
        if t > 1:
            full, weights = tokens * h * e, tokens * k * e
            if at.sequence_parallel:  # gathers its input, the top-k weights and indices; reduce-scatters its output
                out += [Collective("all_gather", "tp", full), Collective("all_gather", "tp", weights),
                        Collective("all_gather", "tp", weights // e * 8),
                        Collective("reduce_scatter", "tp", full, tail=True),
                        Collective("reduce_scatter", "tp", full, phase="backward"),
                        Collective("reduce_scatter", "tp", weights, phase="backward"),
                        Collective("all_gather", "tp", full, phase="backward")]
            else:
                out += [Collective("all_reduce", "tp", full, tail=True),
                        Collective("all_reduce", "tp", full, phase="backward"),
                        Collective("all_reduce", "tp", weights, phase="backward")]
        if shared_expert_ffn(cfg):  # the shared MLP enters and leaves the TP region itself
            out += entry_exit(cfg, at, tokens, tail=True)
        if at.ep > 1:
            rows = tokens * k * h * e
            out += [Collective("all_to_all", "ep", cfg.moe.num_experts * 8),
                    Collective("all_to_all_v", "ep", rows, 2), Collective("all_to_all_v", "ep", rows, 2, "backward")]
        return out
