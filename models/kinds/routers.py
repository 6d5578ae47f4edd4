"""The routers of the mixture-of-experts channel mixer (moe.py), chosen by moe.router, as modules over functions of
the router logits, and the load bookkeeping of auxiliary-loss-free balancing.

    "softmax"       Mixtral, Qwen3-MoE, OLMoE, Qwen3-Next: softmax over every expert, top-k, optionally renormalized
    "sigmoid"       DeepSeek-V3, Kimi K2, Moonlight, GLM-4.5: sigmoid_group_topk with the selection bias
                    `e_score_correction_bias` (an fp32 buffer, saved in checkpoints) and routed_scaling_factor
    "topk_softmax"  gpt-oss: a router with a bias, top-k of the logits, softmax over the k

    sigmoid_group_topk(logits, bias, top_k, n_group, topk_group, norm_topk_prob, scaling) -> (weights, index)
        DeepSeek-V3 / Kimi K2 / Moonlight / GLM-4.5: sigmoid scores; the selection bias (`e_score_correction_bias`)
        chooses experts but does not weight them; only the `topk_group` groups with the largest sum of their top-2
        biased scores compete; the k weights are the unbiased scores, optionally renormalized, times
        `routed_scaling_factor`.
    topk_softmax(logits, top_k) -> (weights, index)
        gpt-oss: top-k on the logits (a linear with bias), softmax over the k.
    expert_load(index, num_experts, token_mask) -> [E] fp32         assignments per expert (no gradient)
    updated_expert_bias(bias, load, rate) -> bias + rate * sign(mean(load) - load)
    seq_aux_loss(logits, top_k, coeff, batch, ...)                Megatron-Core's sequence-wise auxiliary loss

Every router module returns (logits [T, E], weights [T, k], index [T, k], probs): probs the softmax over every
expert that HF's load-balancing loss reads (None for the sigmoid router, which has none).

TP split: a router is replicated over tp (weights, bias, selection bias). It runs on the tokens this rank holds
(its sequence shard under SP, whose weight gradient is then partial over tp, like a norm's: marked
`sequence_parallel`). The selection bias is a buffer with no gradient: it changes only by `updated_expert_bias`,
after the optimizer step, from the loads of the whole step summed over every rank that routed tokens (tp under SP,
dp, cp: `comm.all_reduce` of `expert_load` sums), so every rank applies the same update. Nothing crosses ranks
here except where a function takes a `group`. No cache.
"""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from tpzoo.errors import ConfigError
from tpzoo.parallel import comm, mark_parallel


def sigmoid_group_topk(logits: torch.Tensor, bias: torch.Tensor | None, top_k: int, n_group: int = 1,
                       topk_group: int = 1, norm_topk_prob: bool = True, scaling: float = 1.0):
    """(weights [T, k] fp32, index [T, k]) for router logits [T, E], as transformers' DeepseekV3TopkRouter /
    Glm4MoeTopkRouter compute them (the same ops in the same order, so ties break alike)."""
    num_experts = logits.shape[-1]
    if num_experts % n_group:
        raise ConfigError(f"n_group={n_group} does not divide the {num_experts} routed experts")
    scores = logits.float().sigmoid()
    choice = scores if bias is None else scores + bias
    if n_group > 1 and topk_group < n_group:  # (all groups kept: the mask would change nothing)
        per_group = num_experts // n_group
        group_scores = choice.view(-1, n_group, per_group).topk(2, dim=-1)[0].sum(dim=-1)
        group_idx = torch.topk(group_scores, k=topk_group, dim=-1, sorted=False)[1]
        group_mask = torch.zeros_like(group_scores).scatter_(1, group_idx, 1)
        keep = group_mask.unsqueeze(-1).expand(-1, n_group, per_group).reshape(-1, num_experts).bool()
        choice = choice.masked_fill(~keep, float("-inf"))
    index = torch.topk(choice, k=top_k, dim=-1, sorted=False)[1]
    weights = scores.gather(1, index)
    if norm_topk_prob:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return weights * scaling, index


def topk_softmax(logits: torch.Tensor, top_k: int):
    """(weights [T, k], index [T, k]): gpt-oss's top-k on the logits, then a softmax over the k (logits' dtype)."""
    top, index = torch.topk(logits, top_k, dim=-1)
    return torch.softmax(top, dim=-1, dtype=top.dtype), index


def expert_load(index: torch.Tensor, num_experts: int, token_mask: torch.Tensor | None = None) -> torch.Tensor:
    """Assignments per expert [E] (fp32, no gradient) of index [T, k]; only tokens with token_mask [T] set."""
    ones = torch.ones(index.shape, dtype=torch.float32, device=index.device)
    if token_mask is not None:
        ones = ones * token_mask.reshape(-1, 1).to(torch.float32)
    load = torch.zeros(num_experts, dtype=torch.float32, device=index.device)
    return load.index_add_(0, index.reshape(-1), ones.reshape(-1))


@torch.no_grad()
def updated_expert_bias(bias: torch.Tensor, load: torch.Tensor, rate: float) -> torch.Tensor:
    """Auxiliary-loss-free balancing (DeepSeek-V3; Megatron-Core's get_updated_expert_bias): an expert loaded
    below the mean gets its selection bias raised by `rate`, one above lowered, one at the mean kept. `load` is
    the step's total over every rank (the caller sums it); rate 0 freezes the bias. Returns a new fp32 tensor."""
    load = load.to(torch.float32)
    return (bias.to(torch.float32) + rate * torch.sign(load.mean() - load)).to(bias.dtype)


def aux_scores(logits: torch.Tensor, score: str) -> torch.Tensor:
    """The scores the auxiliary losses see (Megatron-Core's compute_routing_scores_for_aux_loss): the softmax, or
    the sigmoid normalized over all experts (no selection bias, no groups)."""
    if score == "softmax":
        return torch.softmax(logits.float(), dim=-1)
    if score == "sigmoid":
        s = torch.sigmoid(logits.float())
        return s / (s.sum(dim=-1, keepdim=True) + 1e-20)
    raise ConfigError(f"router score function {score!r}: choose softmax or sigmoid")


def seq_aux_loss(logits: torch.Tensor, top_k: int, coeff: float, batch: int, score: str = "sigmoid",
                 token_mask: torch.Tensor | None = None, group=None, groups: tuple = ()) -> torch.Tensor:
    """Megatron-Core's sequence-wise load-balancing loss (DeepSeek-V2/V3's complementary sequence-wise loss):
    per sequence, E / (k T^2) * sum_e (sum_t p_te) (sum_t [e in top-k of p_t]), averaged over the sequences and
    times `coeff`; p the aux scores (`aux_scores`), T the tokens of a sequence (with a token mask: the counted
    tokens of the micro-batch over `batch`, as Megatron's padding mask does).

    logits [batch * s, E] in batch-major order (tpzoo's [b, s] flattened). `group`: the ranks that hold other
    parts of the same sequences (tp under SP, cp); the assignment counts and T are summed over it (no gradient),
    and this rank's value is its share: the group's values add up to the loss (Megatron's convention). `groups`:
    several such groups (tp under SP and cp: one all-reduce each)."""
    num_experts = logits.shape[-1]
    p = aux_scores(logits, score)
    chosen = torch.zeros_like(p).scatter_(1, torch.topk(p, top_k, dim=-1)[1], 1.0)
    if token_mask is not None:
        mask = token_mask.reshape(-1, 1).to(p.dtype)
        p, chosen = p * mask, chosen * mask
    counts = chosen.view(batch, -1, num_experts).sum(dim=1)  # [b, E]
    tokens = chosen.sum() / top_k if token_mask is not None else torch.tensor(
        float(p.shape[0]), device=p.device)
    groups = tuple(groups) + ((group,) if group is not None else ())
    if groups:
        both = torch.cat([counts.flatten(), tokens.reshape(1)])
        for g in groups:
            both = comm.all_reduce(both, g)
        counts, tokens = both[:-1].view(batch, num_experts), both[-1]
    per_seq = tokens / batch
    prob_sums = p.view(batch, -1, num_experts).sum(dim=1)
    return (prob_sums * counts).sum() * (num_experts * coeff / (top_k * per_seq * per_seq)) / batch


ROUTERS = ("softmax", "sigmoid", "topk_softmax")


class Router(nn.Module):
    """The router weight [E, hidden] (HF's `gate.weight` / `router.weight`), replicated over tp, its gradient
    partial under SP; the kinds differ in how the logits become the top-k."""

    def __init__(self, cfg, layout, bias: bool = False):
        super().__init__()
        moe = cfg.moe
        self.top_k, self.num_experts, self.std = moe.num_experts_per_tok, moe.num_experts, cfg.initializer_range
        kw = {"dtype": layout.dtype, "device": "meta"}
        sp = layout.sequence_parallel
        self.weight = mark_parallel(nn.Parameter(torch.empty(moe.num_experts, cfg.hidden_size, **kw)), None, sp)
        self.weight.muon = False  # a gate, not a projection: AdamW's under --optimizer muon (tpzoo.train.muon)
        self.bias = mark_parallel(nn.Parameter(torch.empty(moe.num_experts, **kw)), None, sp) if bias else None

    def reset_parameters(self) -> None:
        if self.weight.device.type != "meta":
            nn.init.normal_(self.weight, std=self.std)
            if self.bias is not None:
                nn.init.zeros_(self.bias)


class SoftmaxRouter(Router):
    """Softmax in fp32 over every expert, top-k, renormalized when norm_topk_prob (Mixtral's top-k softmax is
    exactly this with renormalization)."""

    def __init__(self, cfg, layout):
        super().__init__(cfg, layout)
        self.normalize = cfg.moe.norm_topk_prob

    def forward(self, x: torch.Tensor):
        logits = F.linear(x, self.weight)
        probs = torch.softmax(logits.float(), dim=-1)
        top, index = torch.topk(probs, self.top_k, dim=-1)
        if self.normalize:
            top = top / top.sum(dim=-1, keepdim=True)
        return logits, top.to(logits.dtype), index, probs


class SigmoidRouter(Router):
    """DeepSeek-V3 / GLM-4.5: logits in fp32 (as HF computes them), sigmoid_group_topk with the selection bias, an fp32
    buffer `e_score_correction_bias` [E] (HF's name) that chooses experts without weighting them; it moves only after
    optimizer steps (moe.py: auxiliary-loss-free balancing)."""

    def __init__(self, cfg, layout):
        super().__init__(cfg, layout)
        moe = cfg.moe
        self.n_group, self.topk_group = moe.n_group, moe.topk_group
        self.normalize, self.scaling = moe.norm_topk_prob, moe.routed_scaling_factor
        self.register_buffer("e_score_correction_bias",
                             torch.empty(moe.num_experts, dtype=torch.float32, device="meta"))

    def reset_parameters(self) -> None:
        super().reset_parameters()
        if self.weight.device.type != "meta":
            self.e_score_correction_bias.zero_()

    def forward(self, x: torch.Tensor):
        logits = F.linear(x.float(), self.weight.float())
        weights, index = sigmoid_group_topk(logits, self.e_score_correction_bias, self.top_k, self.n_group,
                                            self.topk_group, self.normalize, self.scaling)
        return logits, weights, index, None


class TopKSoftmaxRouter(Router):
    """gpt-oss: logits = x W^T + b (the model dtype), top-k of the logits, softmax over the k."""

    def __init__(self, cfg, layout):
        super().__init__(cfg, layout, bias=cfg.moe.router_bias)

    def forward(self, x: torch.Tensor):
        logits = F.linear(x, self.weight, self.bias)
        weights, index = topk_softmax(logits, self.top_k)
        return logits, weights, index, torch.softmax(logits.float(), dim=-1)


def make_router(cfg, layout) -> Router:
    """The router module moe.router names."""
    kind = cfg.moe.router
    if kind not in ROUTERS:
        raise ConfigError(f"moe.router must be one of {ROUTERS}, got {kind!r}")
    return {"softmax": SoftmaxRouter, "sigmoid": SigmoidRouter, "topk_softmax": TopKSoftmaxRouter}[kind](cfg, layout)
