"""Channel mixer "moe": a mixture of experts (Mixtral, Qwen3-MoE, OLMoE, DeepSeek-V3, GLM-4.5, gpt-oss): a top-k
router (routers.py, chosen by moe.router), dropless token dispatch over the expert-parallel group, the local
experts as a grouped matmul, the combine weighted by the router, and shared experts beside them.

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
Expert biases (gpt-oss, moe.expert_bias): `gate_up_bias` [E/ep, 2 ffn/tp] splits with gate|up; `down_bias` [E, h]
is whole on every rank (small) and added after the TP reduction on the tokens this rank holds, as
sum_k w_k b_{e_k} (a row-parallel layer's bias: partial gradient under SP). gpt-oss's experts run the clamped
SwiGLU (moe.swiglu_limit, experts.clamped_swiglu).
Shared experts (DeepSeek-V3, Qwen3-Next; moe.shared_expert_ffn > 0): a dense gated MLP beside the routed experts,
every token through it, `shared_experts.{fc_in, fc_out}` split over tp exactly like the dense MLP (mlp.py: gate|up
fused column-parallel, down row-parallel, with its own entry and exit collectives: one more all-gather and
reduce-scatter under SP, all-reduce without, per layer); with moe.shared_expert_gate (Qwen3-Next) its output is
multiplied by sigmoid(`shared_expert_gate`(x)), a replicated [1, hidden] weight applied to the tokens this rank
holds (partial gradient under SP). Its output is added to the routed experts'.
Cache: none.

Auxiliary outputs (moe_aux.py): the softmax routers record their statistics (key "router": HF's load-balancing
loss and the z-loss), the sigmoid router its share of the sequence-wise auxiliary loss when
moe.router_aux_loss_coef > 0 (key "seq_aux"). The layer keeps its last router logits (`last_logits`, overwritten
per call) for inspection (`router_logits`).

Auxiliary-loss-free balancing (the sigmoid router, moe.bias_update_rate > 0): each training forward (not a
recomputation, not evaluation) adds this rank's expert loads (assignments per expert of the tokens it routes: its
shard under SP; without SP only tp rank 0 counts, the others route the same tokens) to `step_load`. After each
optimizer step models/aux.after_optimizer_step sums every MoE layer's loads of the step over every rank in one
all-reduce (`step_sums` / `apply_step_sums`) and each layer moves its `e_score_correction_bias` by
rate * sign(mean load - load): the same bias on every rank, the single-process run's.
"""
from __future__ import annotations

import dataclasses
import functools
import math

import torch
import torch.nn as nn

from tpzoo.errors import ConfigError
from tpzoo.parallel import (ParallelLayoutError, ShardSpec, copy_to_tp, gather_from_sequence, mark_parallel,
                            reduce_from_tp, reduce_scatter_to_sequence, shard)
from tpzoo.parallel import comm
from tpzoo.parallel.eager import eager

from ..config import ModelConfig
from ..inputs import Context
from ..layout import ModelLayout
from ..recompute import is_recomputing
from ..registry import register_channel_mixer
from . import moe_hf
from .experts import _activation, clamped_swiglu, expert_mlp
from .mlp import MLP
from .moe_aux import RouterStatistics, SequenceAuxLoss, router_stats
from .replicated import ReplicatedLinear
from .routers import expert_load, make_router, seq_aux_loss, updated_expert_bias


class _AllToAllV(torch.autograd.Function):
    """Uneven all-to-all of rows; its gradient goes back the same way with the split sizes swapped."""

    @staticmethod
    def forward(ctx, x, send: list, recv: list, group):
        ctx.send, ctx.recv, ctx.group = send, recv, group
        return comm.all_to_all_v(x, send, recv, group)

    @staticmethod
    def backward(ctx, grad):
        return comm.all_to_all_v(grad.contiguous(), ctx.recv, ctx.send, ctx.group), None, None, None


@register_channel_mixer("moe")
class MoE(nn.Module):
    """A mixture of experts in place of the dense MLP of layer `layer` ([b, s(/tp under SP), h] in and out)."""
    hf_tensor_maps = staticmethod(moe_hf.hf_tensor_maps)  # its Hugging Face names
    aux_rules = (RouterStatistics(), SequenceAuxLoss())

    def __init__(self, cfg: ModelConfig, layer: int, layout: ModelLayout):
        super().__init__()
        dims, moe = layout.dims, cfg.moe
        E, ffn, h, tp, ep = moe.num_experts, cfg.expert_ffn, cfg.hidden_size, dims.tp, dims.ep
        self.check_parallel(cfg, layer, tp, dims.cp, ep)
        self.cfg, self.layer, self.dims, self.layout = cfg, layer, dims, layout
        self.sequence_parallel = layout.sequence_parallel
        self.num_experts, self.top_k, self.local = E, moe.num_experts_per_tok, E // ep
        self.router = make_router(cfg, layout)
        kw = {"dtype": layout.dtype, "device": "meta"}
        self.gate_up = _expert_param(torch.empty(self.local, 2 * ffn // tp, h, **kw), ShardSpec(1, parts=(ffn, ffn)))
        self.down = _expert_param(torch.empty(self.local, h, ffn // tp, **kw), ShardSpec(2))
        if moe.expert_bias:  # gpt-oss (see the module docstring for where each is added)
            self.gate_up_bias = _expert_param(torch.empty(self.local, 2 * ffn // tp, **kw),
                                              ShardSpec(1, parts=(ffn, ffn)))
            self.down_bias = mark_parallel(nn.Parameter(torch.empty(E, h, **kw)), None, layout.sequence_parallel)
        self.std, self.out_std = cfg.initializer_range, cfg.initializer_range / math.sqrt(2 * cfg.num_layers)
        self.activation = (cfg.mlp.activation if moe.swiglu_limit is None else
                           functools.partial(clamped_swiglu, alpha=moe.swiglu_alpha, limit=moe.swiglu_limit))
        # "auto": grouped GEMMs where torch._grouped_mm runs (CUDA bf16, Hopper+), else the loop (experts.py);
        # "grouped" / "loop" force one (tests compare them)
        self.expert_gemm = "auto"
        self.lora = None  # the routed experts' adapters (expert_lora.ExpertLoRA) under --lora-experts
        self.last_stats: dict | None = None
        self.last_logits: torch.Tensor | None = None
        if moe.shared_expert_ffn:  # registered after the routed experts: their parameter order stays
            self.shared_experts = MLP(cfg, layer, layout, ffn=moe.shared_expert_ffn)
            if moe.shared_expert_gate:
                self.shared_expert_gate = ReplicatedLinear(h, 1, layout, std=cfg.initializer_range)
                self.shared_expert_gate.weight.muon = False  # a gate: AdamW's under --optimizer muon
        # auxiliary-loss-free balancing: this rank's loads of the step (only one tp rank counts replicated tokens)
        self.balancing = self.step_sums_size(cfg, layer) > 0
        self.counts_loads = layout.split_sequence or dims.tp_rank == 0
        self.step_load: torch.Tensor | None = None

    @staticmethod
    def check_parallel(cfg: ModelConfig, layer: int, tp: int, cp: int = 1, ep: int = 1) -> None:
        """ParallelLayoutError where the experts cannot split over ep, or each expert's (and the shared experts')
        hidden units over tp: the one copy of these checks (the layer's build, the preflight and the plan)."""
        moe, ffn = cfg.moe, cfg.expert_ffn
        if moe.num_experts % ep:
            raise ParallelLayoutError(f"ep={ep} does not divide num_experts={moe.num_experts}")
        if ffn % tp:
            raise ParallelLayoutError(f"tp={tp} does not divide the expert hidden size {ffn}")
        if moe.shared_expert_ffn % tp:
            raise ParallelLayoutError(f"tp={tp} does not divide the shared experts' width {moe.shared_expert_ffn}")

    @staticmethod
    def run_settings(cfg: ModelConfig, run, lora: bool = False) -> ModelConfig:
        """cfg with a training run's settings of this kind (tpzoo/train/run_model.py asks every kind; `run` a
        TrainConfig): the sigmoid router's (DeepSeek-V3, GLM-4.5) selection-bias update rate and sequence-wise
        auxiliary loss, --router-bias-update-rate and --router-aux-loss-coef; a model without that router keeps its
        config, and a rate or loss asked of one is refused. `lora`: the run trains adapters on a frozen base, whose
        selection biases stay frozen too unless a rate is given, which is refused (its checkpoints and PEFT
        adapters hold only the adapters)."""
        moe, given = cfg.moe, run.is_set("router_bias_update_rate")
        # unset, the rate follows the run (TrainConfig: 0 with --lora-rank / --lora-from); a resumed LoRA run
        # given neither trains adapters too
        rate = run.router_bias_update_rate if given or not lora else 0.0
        if moe.router != "sigmoid":
            if run.router_aux_loss_coef:
                raise ConfigError(f"--router-aux-loss-coef {run.router_aux_loss_coef:g}: the sequence-wise auxiliary "
                                  f"loss is the sigmoid router's (DeepSeek-V3, GLM-4.5); this model has none")
            if given and rate:
                raise ConfigError(f"--router-bias-update-rate {rate:g}: auxiliary-loss-free balancing moves the "
                                  f"sigmoid router's selection bias (DeepSeek-V3, GLM-4.5); this model's router has "
                                  f"none")
            return cfg
        if lora and rate:
            raise ConfigError(f"--router-bias-update-rate {rate:g} with LoRA: a LoRA run keeps the base frozen, its "
                              f"selection biases included (its checkpoints and PEFT adapters hold only the adapters); "
                              f"leave the rate unset (0 under LoRA), or fine-tune every weight to rebalance the experts")
        if run.replicas > 1 and run.sync_every > 1 and rate:  # (synchronous: the loads are summed over the world)
            raise ConfigError(f"--replicas {run.replicas} --sync-every {run.sync_every} (DiLoCo) with "
                              f"--router-bias-update-rate {rate:g}: the selection bias's update is not made per DiLoCo "
                              f"replica yet; pass --router-bias-update-rate 0, or --sync-every 1")
        return cfg.replace(moe=dataclasses.replace(moe, bias_update_rate=rate,
                                                   router_aux_loss_coef=run.router_aux_loss_coef))

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
        if hasattr(self, "down_bias"):
            self.gate_up_bias.zero_()
            self.down_bias.zero_()

    def forward(self, x: torch.Tensor, ctx: Context) -> torch.Tensor:
        b, h = x.shape[0], x.shape[-1]
        group = self.dims.tp_group
        logits, weights, index, probs = self.router(x.reshape(-1, h))
        self._record(ctx, x, logits, index, probs)
        local_weights, local_index = weights, index  # this rank's tokens (its shard under SP)
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
        if hasattr(self, "down_bias"):  # sum_k w_k b_{e_k}, on this rank's tokens, after the reduction
            bias = self.down_bias.index_select(0, local_index.reshape(-1)).view(-1, k, h)
            out = out + (bias * local_weights.unsqueeze(-1).to(bias.dtype)).sum(1).view(out.shape)
        return out + self._shared(x) if hasattr(self, "shared_experts") else out

    def _record(self, ctx: Context, x, logits, index, probs) -> None:
        """What the layer leaves beside its output: the auxiliary records (moe_aux.py), the step's expert loads."""
        cfg = self.cfg
        self.last_logits = logits
        if RouterStatistics.applies(cfg):
            self.last_stats = router_stats(logits, probs, index, self.num_experts, ctx.token_mask)
            ctx.record(self.layer, RouterStatistics.key, self.last_stats)
        if self.training and self.aux_rules[1].trains(cfg):  # (not in evaluation: only training adds it)
            dims = self.dims
            groups = ([dims.tp_group] if self.layout.split_sequence else []) + ([dims.cp_group] if dims.cp > 1 else [])
            share = seq_aux_loss(logits, self.top_k, cfg.moe.router_aux_loss_coef, x.shape[0], "sigmoid",
                                 ctx.token_mask, groups=groups)
            ctx.record(self.layer, SequenceAuxLoss.key, share.reshape(1))
        if self.balancing and self.training and torch.is_grad_enabled() and not is_recomputing():
            self._count_loads(index.detach(), ctx.token_mask)

    @eager  # Python state across calls (None, then the step's sum): a compiled block would recompile on it
    def _count_loads(self, index: torch.Tensor, token_mask) -> None:
        if self.step_load is None:
            self.step_load = torch.zeros(self.num_experts, dtype=torch.float32, device=index.device)
        if self.counts_loads:
            self.step_load += expert_load(index, self.num_experts, token_mask)

    def _shared(self, x: torch.Tensor) -> torch.Tensor:
        """The shared experts' output (gated by sigmoid(shared_expert_gate(x)) where the config says)."""
        y = self.shared_experts(x)
        if hasattr(self, "shared_expert_gate"):
            y = y * torch.sigmoid(self.shared_expert_gate(x))
        return y

    # -- auxiliary-loss-free balancing: models/aux.after_optimizer_step ----------------------------------------
    @staticmethod
    def step_sums_size(cfg: ModelConfig, layer: int) -> int:
        """Size of what the layer sums over every rank after an optimizer step (its expert loads), 0: nothing."""
        moe = cfg.moe
        return moe.num_experts if moe.router == "sigmoid" and moe.bias_update_rate > 0 else 0

    def step_sums(self) -> torch.Tensor:
        """This rank's expert loads of the step (zeros when it routed nothing it counts)."""
        if self.step_load is None:
            return torch.zeros(self.num_experts, dtype=torch.float32, device=self.router.weight.device)
        return self.step_load

    @torch.no_grad()
    def apply_step_sums(self, loads: torch.Tensor | None) -> None:
        """Move the selection bias by the loads of the whole step (None: a skipped step, the loads dropped)."""
        if loads is not None:
            bias = self.router.e_score_correction_bias
            bias.copy_(updated_expert_bias(bias, loads, self.cfg.moe.bias_update_rate))
        self.step_load = None

    # -- sizes, without building ---------------------------------------------------------------------------
    @staticmethod
    def num_parameters(cfg: ModelConfig, layer: int, active: bool = False) -> int:
        """Parameters (not the selection-bias buffer); `active`: those one token uses (the router, its top-k
        experts with their biases, the shared experts)."""
        moe, h = cfg.moe, cfg.hidden_size
        expert = 3 * h * cfg.expert_ffn + ((2 * cfg.expert_ffn + h) if moe.expert_bias else 0)
        shared = MLP.num_parameters(cfg, layer, ffn=moe.shared_expert_ffn) if moe.shared_expert_ffn else 0
        router = h * moe.num_experts + (moe.num_experts if moe.router_bias else 0)
        return (router + expert * (moe.num_experts_per_tok if active else moe.num_experts) + shared
                + (h if moe.shared_expert_gate else 0))

    @eager  # the rows per expert are data (a host sync, or all-to-all sizes): compiled, each count would recompile
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
        if hasattr(self, "quantized"):  # kept-quantized experts: dequantized one at a time (tpzoo.quant)
            from tpzoo.quant.modules import expert_mlp as quantized_expert_mlp

            q = self.quantized
            return quantized_expert_mlp(rows, counts, q.get("gate_up", self.gate_up), q.get("down", self.down),
                                        _activation(self.activation), self.lora)
        return expert_mlp(rows, counts, self.gate_up, self.down, self.activation, self.expert_gemm,
                          getattr(self, "gate_up_bias", None), lora=self.lora)


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


def router_logits(model) -> list[torch.Tensor]:
    """Each MoE layer's router logits of the model chunk's last forward ([tokens, E]; this rank's sequence shard
    under SP), in layer order."""
    return [layer.mlp.last_logits for layer in model.layers.values() if isinstance(layer.mlp, MoE)]
