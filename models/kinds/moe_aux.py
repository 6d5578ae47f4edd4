"""The auxiliary outputs of the mixture-of-experts channel mixer (moe.py), as models/aux.py's rules.

  "router"   (RouterStatistics; the softmax routers) each MoE layer's router statistics of a forward (assignments
             per expert, routing-probability sums, logsumexp^2 sums, tokens counted), summed over the model's layers
             (carried between pipeline stages), reduced on the last stage into transformers' load-balancing loss and
             the z-loss (`router_losses`), which train when the config says so (HF's output_router_logits).
  "seq_aux"  (SequenceAuxLoss; the sigmoid router, moe.router_aux_loss_coef > 0) Megatron-Core's sequence-wise
             auxiliary loss (routers.seq_aux_loss): each layer's share of it (the per-sequence expert counts summed
             over the ranks holding parts of the sequences: tp under SP, cp), summed over the layers and, on the
             last stage, over those ranks: one scalar added to the loss.
"""
from __future__ import annotations

import torch

from tpzoo.parallel import comm, reduce_from_tp
from tpzoo.parallel.eager import eager_apply

from ..aux import AuxRule
from ..config import ModelConfig
from ..layout import ModelLayout


class RouterStatistics(AuxRule):
    """The "router" auxiliary output: per layer, router_stats; per chunk, stage_stats' vector;
    reduced into HF's load-balancing loss and the z-loss by router_losses."""
    key = "router"
    reports = ("router_aux_loss", "router_z_loss")

    def size(self, cfg: ModelConfig) -> int:
        return stats_size(cfg.moe.num_experts)

    def combine(self, cfg: ModelConfig, records: list, device) -> torch.Tensor:
        return stage_stats(records, cfg.moe.num_experts, device)

    @staticmethod
    def applies(cfg: ModelConfig) -> bool:
        """HF's load-balancing loss reads softmax scores: the softmax routers' (not the sigmoid router's)."""
        return cfg.moe.router != "sigmoid" and bool(moe_layer_count(cfg))

    def trains(self, cfg: ModelConfig) -> bool:
        moe = cfg.moe
        return self.applies(cfg) and moe.output_router_logits and bool(
            moe.router_aux_loss_coef or moe.router_z_loss_coef)

    def carried(self, cfg: ModelConfig, loss) -> bool:
        # training: when the loss includes them; evaluation (aux_losses off): whenever they are reported
        return self.trains(cfg) if loss.aux_losses else self.applies(cfg)

    def reduce(self, cfg: ModelConfig, layout: ModelLayout, total: torch.Tensor) -> tuple:
        aux, z = router_losses(total, moe_layer_count(cfg), cfg.moe.num_experts, layout)
        term = cfg.moe.router_aux_loss_coef * aux + cfg.moe.router_z_loss_coef * z if self.trains(cfg) else None
        return term, {"router_aux_loss": aux.detach(), "router_z_loss": z.detach()}


class SequenceAuxLoss(AuxRule):
    """The "seq_aux" auxiliary output: each layer records its share of Megatron-Core's sequence-wise loss (coefficient
    included; a scalar with gradient), the chunk sums them, the last stage sums the shares of the sequence's ranks."""
    key = "seq_aux"
    reports = ("router_seq_aux_loss",)

    def size(self, cfg: ModelConfig) -> int:
        return 1

    def trains(self, cfg: ModelConfig) -> bool:
        return cfg.moe.router == "sigmoid" and cfg.moe.router_aux_loss_coef > 0 and bool(moe_layer_count(cfg))

    def carried(self, cfg: ModelConfig, loss) -> bool:
        return self.trains(cfg) and loss.aux_losses  # (evaluation leaves it out: the layers record none then)

    def reduce(self, cfg: ModelConfig, layout: ModelLayout, total: torch.Tensor) -> tuple:
        total = sequence_total(total, layout)
        return total.sum(), {"router_seq_aux_loss": total.sum().detach()}


def sequence_total(value: torch.Tensor, layout: ModelLayout) -> torch.Tensor:
    """Per-rank shares of one loss over the ranks holding parts of the same sequences: under SP the tp ranks (the
    loss is then replicated over tp: identity backward), under cp the cp ranks (each adds the loss to its own
    tokens: the gradient is summed over cp too)."""
    dims = layout.dims
    if layout.sequence_parallel:
        value = reduce_from_tp(value, dims.tp_group)
    if dims.cp > 1:
        value = eager_apply(_AllReduceSum, value, dims.cp_group)
    return value


def moe_layer_count(cfg: ModelConfig) -> int:
    """MoE layers in the whole model (the router loss couples all of them)."""
    return sum(cfg.channel_mixer(i) == "moe" for i in range(cfg.num_layers))


def router_stats(logits, probs, index, num_experts: int, mask=None) -> dict:
    """This call's sums over its tokens (this rank's sequence shard under SP; only those of `mask`, [tokens], when
    given):
    the top-k assignments per expert (no gradient), the routing probabilities per expert and logsumexp(logits)^2
    (both with gradient), and the number of tokens counted."""
    counts = torch.zeros(num_experts, dtype=torch.float32, device=probs.device)
    lse2 = torch.logsumexp(logits.float(), dim=-1).square()
    if mask is None:
        ones = torch.ones(index.numel(), dtype=torch.float32, device=probs.device)
        prob_sum, z_sum, tokens = probs.sum(dim=0), lse2.sum(), torch.tensor(
            float(probs.shape[0]), device=probs.device)
    else:
        mask = mask.to(torch.float32)
        ones = mask.repeat_interleave(index.shape[-1])
        prob_sum, z_sum, tokens = (probs * mask[:, None]).sum(dim=0), (lse2 * mask).sum(), mask.sum()
    counts.index_add_(0, index.reshape(-1), ones)
    return {"logits": logits, "counts": counts, "prob_sum": prob_sum, "z_sum": z_sum, "tokens": tokens}


def stage_stats(stats: list[dict], num_experts: int, device) -> torch.Tensor:
    """The sums of this chunk's MoE layers as one fp32 tensor [counts (E, no gradient), routing-probability sums
    (E), sum of logsumexp^2 (1), (layer, token) rows counted (1)]: what a pipeline stage adds to the statistics
    it passes on, and what the ranks of one sequence sum (all additive)."""
    if not stats:
        return torch.zeros(stats_size(num_experts), dtype=torch.float32, device=device)
    counts = torch.stack([s["counts"] for s in stats]).sum(0)
    probs = torch.stack([s["prob_sum"] for s in stats]).sum(0)
    z = torch.stack([s["z_sum"] for s in stats]).sum().reshape(1)
    rows = torch.stack([s["tokens"] for s in stats]).sum().reshape(1)
    return torch.cat([counts, probs.float(), z.float(), rows.float()])


def stats_size(num_experts: int) -> int:
    return 2 * num_experts + 2


class _AllReduceSum(torch.autograd.Function):
    """Sum over a group whose ranks all use the result in their own part of one loss: the gradient is summed too."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return comm.all_reduce(x.clone(), group)

    @staticmethod
    def backward(ctx, grad):
        return comm.all_reduce(grad.contiguous().clone(), ctx.group), None


def router_losses(totals: torch.Tensor, num_layers: int, num_experts: int, layout: ModelLayout) -> tuple:
    """(load-balancing loss, z-loss) of one forward from `totals` (stage_stats summed over every MoE layer of the
    model, all pipeline stages included; this rank's tokens), `num_layers` MoE layers in the model.

    The load-balancing loss is transformers' load_balancing_loss_func on the concatenated layers: E * sum_e
    f_e * P_e, f_e the fraction of all (layer, token, top-k slot) assignments that chose expert e (over layers *
    tokens rows), P_e the mean routing probability of e over all (layer, token) rows. The z-loss is the mean over
    tokens of logsumexp(logits)^2, summed over layers. Under SP each rank holds its shard's sums; one all-reduce
    over tp (identity backward: every tp rank computes the same loss, on the same tokens) makes them total. Under
    context parallelism (cp > 1) each cp rank holds its chunks of the sequence: the sums are added over cp too,
    and since each cp rank adds the loss to its own tokens, the gradient of the totals is summed over cp."""
    totals = sequence_total(totals, layout)
    counts, probs, z, rows = totals.split([num_experts, num_experts, 1, 1])
    aux = num_experts * torch.sum((counts / rows) * (probs / rows))
    return aux, z.sum() / (rows.sum() / num_layers)
