"""Plan costs of the "mlp" channel mixer (models/kinds/mlp.py), exact (tests/test_plan_*.py).

On one tp rank with f = ffn / tp: fc_in column-parallel [f (x2 gate|up), h], fc_out row-parallel [h, f] (its
output matmul follows the last saved tensor: full recomputation stops before it). Kept per token: fc_in's input
(this rank's shard under SP), and SwiGLU / GeGLU's gate|up and product (3 e f; the torch references also keep the
activation's output: 4 e f), GeLU's input and output (2 e f). Collectives: the TP region's entry and exit.
"""
from __future__ import annotations


from ..costs import Acts, Matmul, Stateless, Weights, entry_exit, register_cost


def gated_mlp_acts(e: int, f: int, kernels: str, gated: bool = True) -> int:
    """Bytes per token an MLP of local width f keeps between its two matmuls."""
    if gated:  # SwiGLU and GeGLU: the same kernel pair (the torch references keep the same tensors too)
        return e * f * (4 if kernels == "reference" else 3)
    return 2 * e * f


@register_cost("mlp")
class MLPCost(Stateless):
    @staticmethod
    def plan_weights(cfg, layer, at) -> Weights:
        m, h = cfg.mlp, cfg.hidden_size
        f = m.ffn_hidden_size // at.tp
        n_in = f * (2 if m.gated else 1)
        return Weights(numel=h * n_in + f * h + ((n_in + h) if m.bias else 0), tensors=2 + 2 * m.bias,
                       partial_sp=h if m.bias else 0)

    @staticmethod
    def plan_matmuls(cfg, layer, at) -> list:
        m, h = cfg.mlp, cfg.hidden_size
        f = m.ffn_hidden_size // at.tp
        return [Matmul("fc_in", f * (2 if m.gated else 1), h), Matmul("fc_out", h, f, tail=True)]

    @staticmethod
    def plan_mixing_flops(cfg, layer, at, seq_len: int) -> float:
        return 0.0

    @staticmethod
    def plan_activations(cfg, layer, at, micro_batch: int, seq_len: int) -> int:
        if at.recompute == "full":
            return 0
        f = cfg.mlp.ffn_hidden_size // at.tp
        return Acts(full=gated_mlp_acts(at.act_bytes, f, at.kernels, cfg.mlp.gated),
                    shard=at.act_bytes * cfg.hidden_size).bytes(micro_batch * seq_len, at.sp_div)

    @staticmethod
    def plan_collectives(cfg, layer, at, tokens: int) -> list:
        return entry_exit(cfg, at, tokens, tail=True)
