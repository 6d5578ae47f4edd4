"""Channel mixer "moe": a mixture of experts (Mixtral, Qwen3-MoE, OLMoE): a top-k router, dropless token dispatch
over the expert-parallel group, the local experts as a grouped matmul, and the combine weighted by the router.

TP split (Megatron-Core's classic default; rank order in tpzoo/parallel/dims.py): experts over ep (ep rank r holds
experts [r * E/ep, (r + 1) * E/ep): `gate_up` [E/ep, 2 ffn/tp, h], `down` [E/ep, h, ffn/tp]), each expert split
over tp like the dense MLP (expert tensor parallelism etp = tp: gate|up column-wise, down row-wise). The router
weight is replicated (its gradient partial under SP, like a norm's).
What crosses ranks: tokens enter the TP region as the dense MLP's do (all-gather of the sequence under SP); the
router runs on the tokens *before* that entry (this rank's shard under SP) and its top-k weights enter through the
same collective, so each router gradient is counted once. Each tp rank dispatches its tokens over the ep group
(its peers share its tp coordinate) with all_to_all_single and per-rank split sizes (one small all-to-all of
per-expert counts first: those sizes are host ints, the one host sync of the layer), computes its slice of every
local expert, sends the partial outputs back, and the weighted combine is followed by the MLP's usual TP
all-reduce (reduce-scatter under SP). At ep = 1 nothing leaves the device: the permutation and its inverse are
gathers, the per-expert counts a scatter-add, and the experts grouped GEMMs whose offsets are the counts'
cumulative sums (experts.py; the loop fallback reads the counts on the host). Expert gradients (`expert_parallel`
parameters) are summed over the expert-data-parallel group (dims.expert_grad_group) instead of dp x cp.
Shared experts (DeepSeek-V3, Qwen3-Next; moe.shared_expert_ffn > 0): a dense gated MLP beside the routed experts,
every token through it, `shared_experts.{fc_in, fc_out}` split over tp exactly like the dense MLP (mlp.py: gate|up
fused column-parallel, down row-parallel, with its own entry and exit collectives: one more all-gather and
reduce-scatter under SP, all-reduce without, per layer); with moe.shared_expert_gate (Qwen3-Next) its output is
multiplied by sigmoid(`shared_expert_gate`(x)), a replicated [1, hidden] weight applied to the tokens this rank
holds (partial gradient under SP). Its output is added to the routed experts'.
Cache: none.

Auxiliary output: each forward records its router statistics (ctx.record, key "router"); the RouterStatistics
rule sums them over the model's layers (carried between pipeline stages) and turns the total into HF's
load-balancing loss and the z-loss on the last stage (`router_losses`). The layer also keeps its last statistics
and logits (`last_stats`, overwritten per call) for inspection (`router_logits`).
"""
from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from tpzoo.parallel import (ParallelLayoutError, ShardSpec, copy_to_tp, gather_from_sequence, mark_parallel,
                            reduce_from_tp, reduce_scatter_to_sequence, shard)
from tpzoo.parallel import comm

from ..aux import AuxRule
from ..config import ModelConfig
from ..inputs import Context
from ..layout import ModelLayout
from . import register_channel_mixer
from .experts import expert_mlp
from .mlp import MLP
from .replicated import ReplicatedLinear


class _AllToAllV(torch.autograd.Function):
    """Uneven all-to-all of rows; its gradient goes back the same way with the split sizes swapped."""

    @staticmethod
    def forward(ctx, x, send: list, recv: list, group):
        ctx.send, ctx.recv, ctx.group = send, recv, group
        return comm.all_to_all_v(x, send, recv, group)

    @staticmethod
    def backward(ctx, grad):
        return comm.all_to_all_v(grad.contiguous(), ctx.recv, ctx.send, ctx.group), None, None, None


class Router(nn.Module):
    """Linear gate h -> E, softmax in fp32, top-k, optionally renormalized (Mixtral's top-k softmax is exactly
    this with renormalization). Replicated over tp; its gradient is partial under sequence parallelism."""

    def __init__(self, cfg: ModelConfig, layout: ModelLayout):
        super().__init__()
        moe = cfg.moe
        self.top_k, self.normalize, self.std = moe.num_experts_per_tok, moe.norm_topk_prob, cfg.initializer_range
        self.weight = mark_parallel(nn.Parameter(torch.empty(moe.num_experts, cfg.hidden_size, dtype=layout.dtype,
                                                             device="meta")), None, layout.sequence_parallel)

    def reset_parameters(self) -> None:
        if self.weight.device.type != "meta":
            nn.init.normal_(self.weight, std=self.std)

    def forward(self, x: torch.Tensor):
        logits = F.linear(x, self.weight)
        probs = torch.softmax(logits.float(), dim=-1)
        top, index = torch.topk(probs, self.top_k, dim=-1)
        if self.normalize:
            top = top / top.sum(dim=-1, keepdim=True)
        return logits, probs, top.to(logits.dtype), index


class RouterStatistics(AuxRule):
    """The "router" auxiliary output: per layer, models.kinds.moe._router_stats; per chunk, stage_stats' vector;
    reduced into HF's load-balancing loss and the z-loss by router_losses."""
    key = "router"
    reports = ("router_aux_loss", "router_z_loss")

    def size(self, cfg: ModelConfig) -> int:
        return stats_size(cfg.moe.num_experts)

    def combine(self, cfg: ModelConfig, records: list, device) -> torch.Tensor:
        return stage_stats(records, cfg.moe.num_experts, device)

    def trains(self, cfg: ModelConfig) -> bool:
        moe = cfg.moe
        return bool(moe_layer_count(cfg)) and moe.output_router_logits and bool(
            moe.router_aux_loss_coef or moe.router_z_loss_coef)

    def carried(self, cfg: ModelConfig, loss) -> bool:
        # training: when the loss includes them; evaluation (aux_losses off): whenever they are reported
        return self.trains(cfg) if loss.aux_losses else bool(moe_layer_count(cfg))

    def reduce(self, cfg: ModelConfig, layout: ModelLayout, total: torch.Tensor) -> tuple:
        aux, z = router_losses(total, moe_layer_count(cfg), cfg.moe.num_experts, layout)
        term = cfg.moe.router_aux_loss_coef * aux + cfg.moe.router_z_loss_coef * z if self.trains(cfg) else None
        return term, {"router_aux_loss": aux.detach(), "router_z_loss": z.detach()}


def moe_layer_count(cfg: ModelConfig) -> int:
    """MoE layers in the whole model (the router loss couples all of them)."""
    return sum(cfg.channel_mixer(i) == "moe" for i in range(cfg.num_layers))


@register_channel_mixer("moe")
class MoE(nn.Module):
    """A mixture of experts in place of the dense MLP of layer `layer` ([b, s(/tp under SP), h] in and out)."""
    aux_rules = (RouterStatistics(),)

    def __init__(self, cfg: ModelConfig, layer: int, layout: ModelLayout):
        super().__init__()
        dims = layout.dims
        E, ffn, h, tp, ep = cfg.moe.num_experts, cfg.expert_ffn, cfg.hidden_size, dims.tp, dims.ep
        if E % ep:
            raise ParallelLayoutError(f"ep={ep} does not divide num_experts={E}")
        if ffn % tp:
            raise ParallelLayoutError(f"tp={tp} does not divide the expert hidden size {ffn}")
        self.cfg, self.layer, self.dims, self.sequence_parallel = cfg, layer, dims, layout.sequence_parallel
        self.num_experts, self.top_k, self.local = E, cfg.moe.num_experts_per_tok, E // ep
        self.router = Router(cfg, layout)
        kw = {"dtype": layout.dtype, "device": "meta"}
        self.gate_up = _expert_param(torch.empty(self.local, 2 * ffn // tp, h, **kw), ShardSpec(1, parts=(ffn, ffn)))
        self.down = _expert_param(torch.empty(self.local, h, ffn // tp, **kw), ShardSpec(2))
        self.std, self.out_std = cfg.initializer_range, cfg.initializer_range / math.sqrt(2 * cfg.num_layers)
        self.activation = cfg.mlp.activation
        # "auto": grouped GEMMs where torch._grouped_mm runs (CUDA bf16, Hopper+), else the loop (experts.py);
        # "grouped" / "loop" force one (tests compare them)
        self.expert_gemm = "auto"
        self.last_stats: dict | None = None
        moe = cfg.moe
        if moe.shared_expert_ffn:  # registered after the routed experts: their parameter order stays
            self.shared_experts = MLP(cfg, layer, layout, ffn=moe.shared_expert_ffn)
            if moe.shared_expert_gate:
                self.shared_expert_gate = ReplicatedLinear(h, 1, layout, std=cfg.initializer_range)

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """Draw every expert's full weights (the same at any tp, ep), keep this rank's experts and tp shard."""
        if self.gate_up.device.type == "meta":
            return
        cfg, dims = self.cfg, self.dims
        E, ffn, h = self.num_experts, cfg.expert_ffn, cfg.hidden_size
        mine = slice(dims.ep_rank * self.local, (dims.ep_rank + 1) * self.local)
        for param, shape, std in ((self.gate_up, (E, 2 * ffn, h), self.std), (self.down, (E, h, ffn), self.out_std)):
            full = torch.empty(shape, dtype=torch.float32, device=param.device).normal_(std=std)
            param.copy_(shard(full[mine], param.tp_spec, dims.tp_rank, dims.tp))

    def forward(self, x: torch.Tensor, ctx: Context) -> torch.Tensor:
        b, h = x.shape[0], x.shape[-1]
        group = self.dims.tp_group
        logits, probs, weights, index = self.router(x.reshape(-1, h))
        self.last_stats = _router_stats(logits, probs, index, self.num_experts, ctx.token_mask)
        ctx.record(self.layer, RouterStatistics.key, self.last_stats)
        k = self.top_k
        # Enter the TP region: x (and the router's output, computed on the same tokens) as the dense MLP does.
        if self.sequence_parallel and self.dims.tp > 1:
            x_full = gather_from_sequence(x, -2, group)
            weights = gather_from_sequence(weights.view(b, -1, k), -2, group)
            index = comm.all_gather(index.view(b, -1, k), group, dim=1)
        else:
            x_full = copy_to_tp(x, group)
            weights = copy_to_tp(weights, group)
        tokens = x_full.reshape(-1, h)
        y = self._dispatch_compute_return(tokens, index.reshape(-1))  # [T * k, h], partial over tp
        out = (y.view(-1, k, h) * weights.reshape(-1, k, 1).to(y.dtype)).sum(dim=1).view(x_full.shape)
        if self.sequence_parallel:
            out = reduce_scatter_to_sequence(out, -2, group)
        else:
            out = reduce_from_tp(out, group)
        return out + self._shared(x) if hasattr(self, "shared_experts") else out

    def _shared(self, x: torch.Tensor) -> torch.Tensor:
        """The shared experts' output (gated by sigmoid(shared_expert_gate(x)) where the config says)."""
        y = self.shared_experts(x)
        if hasattr(self, "shared_expert_gate"):
            y = y * torch.sigmoid(self.shared_expert_gate(x))
        return y

    @staticmethod
    def num_parameters(cfg: ModelConfig, layer: int, active: bool = False) -> int:
        moe, h = cfg.moe, cfg.hidden_size
        expert = 3 * h * cfg.expert_ffn  # gate, up, down
        shared = MLP.num_parameters(cfg, layer, ffn=moe.shared_expert_ffn) if moe.shared_expert_ffn else 0
        return (h * moe.num_experts + expert * (moe.num_experts_per_tok if active else moe.num_experts) + shared
                + (h if moe.shared_expert_gate else 0))

    def _dispatch_compute_return(self, tokens: torch.Tensor, expert_of: torch.Tensor) -> torch.Tensor:
        """Rows of `tokens` repeated for each of their k experts (assignment a = token * k + j), sent to the rank
        of the expert, computed, returned, in assignment order."""
        order = torch.argsort(expert_of, stable=True)  # assignments grouped by expert
        rows = tokens.index_select(0, order // self.top_k)
        # (scatter_add, not bincount: CUDA's bincount reads the largest index on the host)
        counts = torch.zeros(self.num_experts, dtype=torch.int64, device=expert_of.device).scatter_add_(
            0, expert_of, torch.ones_like(expert_of))
        ep, group = self.dims.ep, self.dims.group("ep")
        if ep == 1:
            y = self._experts(rows, counts)  # the counts stay on the device (the grouped GEMMs' offsets)
        else:
            # received[r, e]: how many rows ep rank r sends to my local expert e
            received = comm.all_to_all(counts.view(ep, self.local), group)
            host = torch.cat([counts, received.flatten()]).cpu().tolist()  # the split sizes, as host ints
            send_counts, recv = host[: self.num_experts], host[self.num_experts:]
            send = [sum(send_counts[r * self.local:(r + 1) * self.local]) for r in range(ep)]
            recv_splits = [sum(recv[r * self.local:(r + 1) * self.local]) for r in range(ep)]
            arrived = _AllToAllV.apply(rows, send, recv_splits, group)  # ordered (source rank, local expert)
            by_expert, per_expert = _source_major_to_expert_major(recv, ep, self.local, tokens.device)
            y_local = self._experts(arrived[by_expert], per_expert)
            y = _AllToAllV.apply(y_local.index_select(0, _inverse(by_expert)), recv_splits, send, group)
        return y.index_select(0, _inverse(order))

    def _experts(self, rows: torch.Tensor, counts) -> torch.Tensor:
        """The local experts over their contiguous row groups (counts: a device tensor or host ints)."""
        return expert_mlp(rows, counts, self.gate_up, self.down, self.activation, self.expert_gemm)


def _expert_param(t: torch.Tensor, spec: ShardSpec) -> nn.Parameter:
    p = mark_parallel(nn.Parameter(t), spec)
    p.expert_parallel = True  # dim 0 split over ep; gradients summed over the expert-data-parallel group
    return p


def _inverse(perm: torch.Tensor) -> torch.Tensor:
    """The inverse of a permutation, by one scatter (on the device; cheaper than a second sort)."""
    inv = torch.empty_like(perm)
    inv[perm] = torch.arange(perm.numel(), device=perm.device)
    return inv


def _source_major_to_expert_major(recv: list[int], ep: int, local: int, device):
    """Row permutation from (source rank, expert) blocks to (expert, source rank) blocks, and rows per expert."""
    offsets, off = [], 0
    for n in recv:
        offsets.append(off)
        off += n
    # built on the host from the host split sizes (explicitly: a default device may be meta or cuda), one copy over
    pieces = [torch.arange(offsets[r * local + e], offsets[r * local + e] + recv[r * local + e], device="cpu")
              for e in range(local) for r in range(ep)]
    per_expert = [sum(recv[r * local + e] for r in range(ep)) for e in range(local)]
    perm = torch.cat(pieces) if pieces else torch.zeros(0, dtype=torch.long, device="cpu")
    return perm.to(device), per_expert


def _router_stats(logits, probs, index, num_experts: int, mask=None) -> dict:
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


def router_logits(model) -> list[torch.Tensor]:
    """Each MoE layer's router logits of the model chunk's last forward ([tokens, E]; this rank's sequence shard
    under SP), in layer order."""
    return [layer.mlp.last_stats["logits"] for layer in model.layers.values() if isinstance(layer.mlp, MoE)]


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
    dims = layout.dims
    if layout.sequence_parallel:
        totals = reduce_from_tp(totals, dims.tp_group)
    if dims.cp > 1:
        totals = _AllReduceSum.apply(totals, dims.cp_group)
    counts, probs, z, rows = totals.split([num_experts, num_experts, 1, 1])
    aux = num_experts * torch.sum((counts / rows) * (probs / rows))
    return aux, z.sum() / (rows.sum() / num_layers)
