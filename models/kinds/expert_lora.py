"""LoRA on the routed experts of a mixture of experts (`--lora-experts`): one rank-r adapter per expert on each of
its two stacked weights, computed beside the experts' own matmuls.

Per expert e, with s = alpha / r, the fused gate|up weight W_gu[e] [2f, h] and the down weight W_d[e] [h, f]:
    gate|up = x W_gu[e]^T + s (x A_gu[e]^T) B_gu[e]^T        A_gu [E, r, h], B_gu [E, 2f, r]
    out     = a W_d[e]^T  + s (a A_d[e]^T)  B_d[e]^T         A_d  [E, r, f], B_d  [E, h, r]
This is PEFT 0.21's ParamWrapper on transformers 5's fused expert parameters (`mlp.experts.gate_up_proj` /
`down_proj`, `target_parameters`): one adapter on the fused gate|up as transformers 5 holds it (gate and up share
the expert's A, as Phi-3's fused gate_up_proj does in tpzoo's dense LoRA), one on down. The PEFT layout (lora_A
[E*r, in] in blocks per expert, lora_B [out, E*r] with expert e's columns e, e + E, ...) is the export's business
(models/lora.py); here every tensor is stacked by expert, which is what expert parallelism splits.

TP split (etp = tp, as the experts'): gate_up is column-parallel per expert, so A_gu is replicated (every tp rank
computes the same u = x A^T from the same rows; its gradient is partial, summed over tp by finish_tp_grads: marked
like a norm weight) and B_gu splits with gate_up's parts (gate rows, up rows); down is row-parallel, so A_d splits
with its input (f / tp) and B_d is replicated, its partial output added before the layer's own reduction (its
gradient partial, summed over tp). No collective is added per micro-batch; the input gradient through A joins the
experts' own (summed by the TP region's entry).
EP: ep rank r holds the adapters of its experts only (dim 0; `expert_parallel`: gradients summed over the
expert-data-parallel group, like the expert weights'). Checkpoints hold every expert's adapters, so a LoRA run
resumes, and its adapters load, at any ep.
Compute: on the grouped path two grouped matmuls per weight with the experts' own group offsets
(experts.GroupedLinear: no host sync, no Python loop over experts); on the loop path (CPU, fp32, older GPUs, and a
kept-quantized base's per-expert dequantization) each expert's adapter beside its own matmul. Either way an expert
that receives no row gets exact zero adapter gradients.
Initialization as PEFT's (nn.Linear(in, E*r)'s Kaiming-uniform: U(-1/sqrt(in), 1/sqrt(in)) for every A, B = 0),
drawn full-size from the layer's own seed and sliced (the same adapters at any tp and ep). No dropout: PEFT's
ParamWrapper refuses it (x cannot be factored out of B A x), so `--lora-experts` with `--lora-dropout` is refused.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from tpzoo.parallel import ShardSpec, mark_parallel, shard

from .experts import GroupedLinear

NAMES = ("gate_up", "down")  # the experts' stacked weights, in the order HF registers them (PEFT's nesting)


class ExpertLoRA(nn.Module):
    """The adapters of one MoE layer's routed experts (`moe`: models/kinds/moe.MoE, built on its device)."""

    def __init__(self, moe: nn.Module, rank: int, alpha: float, dtype=None, device=None):
        super().__init__()
        if rank <= 0 or alpha <= 0:
            raise ValueError(f"LoRA needs rank > 0 and alpha > 0 (got rank {rank}, alpha {alpha})")
        dims, cfg = moe.dims, moe.cfg
        self.rank, self.alpha, self.scale, self.names = rank, alpha, alpha / rank, list(NAMES)
        self.num_experts, self.local, self.ep_rank = moe.num_experts, moe.local, dims.ep_rank
        self.tp, self.tp_rank = dims.tp, dims.tp_rank
        E, f, h, r = moe.num_experts, cfg.expert_ffn, cfg.hidden_size, rank
        quantized = getattr(moe, "quantized", {}).get("gate_up")  # a kept-quantized base computes in its own dtype
        kw = {"dtype": dtype or (quantized.compute_dtype if quantized is not None else moe.gate_up.dtype),
              "device": device if device is not None else moe.gate_up.device}
        # name -> (full A, A's spec, full B, B's spec); the specs split over tp only (dim 0 is the experts)
        self.shapes = {"gate_up": ((E, r, h), ShardSpec(None), (E, 2 * f, r), ShardSpec(1, parts=(f, f))),
                       "down": ((E, r, f), ShardSpec(2), (E, h, r), ShardSpec(None))}
        self.A, self.B = nn.ParameterDict(), nn.ParameterDict()
        for name, (full_a, spec_a, full_b, spec_b) in self.shapes.items():
            # partial gradients over tp (summed by finish_tp_grads): the replicated factor of each weight
            self.A[name] = _expert_param(full_a, spec_a, name == "gate_up", self, kw)
            self.B[name] = _expert_param(full_b, spec_b, name == "down", self, kw)

    @torch.no_grad()
    def init_adapter(self) -> None:
        """Every A from the current RNG state (all experts drawn full-size, this rank's experts and tp shard kept),
        every B = 0."""
        mine = slice(self.ep_rank * self.local, (self.ep_rank + 1) * self.local)
        for name, (full_a, spec_a, _, _) in self.shapes.items():
            a = self.A[name]
            full = torch.empty(full_a, dtype=torch.float32, device=a.device)
            bound = 1 / math.sqrt(full_a[-1])  # kaiming_uniform_(a=sqrt(5)) of each expert's [r, in]
            full.uniform_(-bound, bound)
            if a.device.type != "meta":
                a.copy_(shard(full[mine], spec_a, self.tp_rank, self.tp))
                self.B[name].zero_()

    # -- compute (models/kinds/experts.py and tpzoo/quant/modules.py call these) --------------------------------
    def grouped(self, name: str, x: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
        """s (x A^T) B^T of every local expert over its rows (x grouped by expert, offs the groups' ends)."""
        u = GroupedLinear.apply(x, self.A[name], offs)
        return GroupedLinear.apply(u * self.scale, self.B[name], offs)

    def per_expert(self) -> "_PerExpert":
        """The adapters unbound by expert, for a loop over experts (one backward that stacks each tensor's
        gradients: indexing per expert would zero-fill a whole-tensor gradient per expert)."""
        return _PerExpert(self)

    def delta(self, name: str) -> torch.Tensor:
        """s B A of every local expert, in the weight's layout ([E, out, in]): what --merge adds (fp32)."""
        return self.scale * torch.bmm(self.B[name].float(), self.A[name].float())

    def extra_repr(self) -> str:
        return (f"{self.local} of {self.num_experts} experts x ({', '.join(self.names)}): rank={self.rank}, "
                f"alpha={self.alpha:g}")


class _PerExpert:
    def __init__(self, lora: ExpertLoRA):
        self.scale = lora.scale
        self.a = {n: lora.A[n].unbind(0) for n in lora.names}
        self.b = {n: lora.B[n].unbind(0) for n in lora.names}

    def add(self, name: str, out: torch.Tensor, x: torch.Tensor, e: int) -> torch.Tensor:
        """out + s (x A_e^T) B_e^T of local expert e (rows x [n, in], out [n, out]): the scale and the sum fused into
        one addmm, two autograd nodes per adapter (the loop runs them per expert)."""
        return torch.addmm(out, F.linear(x, self.a[name][e]), self.b[name][e].t(), alpha=self.scale)


def _expert_param(full: tuple, spec: ShardSpec, partial: bool, lora: ExpertLoRA, kw: dict) -> nn.Parameter:
    local = list(full)
    local[0] = lora.local
    if spec.dim is not None:
        local[spec.dim] = spec.local_size(full[spec.dim], lora.tp)
    p = mark_parallel(nn.Parameter(torch.empty(local, **kw)), spec, sequence_parallel=partial)
    p.expert_parallel = True  # dim 0 split over ep; gradients summed over the expert-data-parallel group
    return p


def add_expert_lora(chunk, rank: int, alpha: float) -> int:
    """Attach an ExpertLoRA to every mixture-of-experts layer of the chunk (as `mlp.lora`); returns how many."""
    from .moe import MoE

    n = 0
    for mod in chunk.modules():
        if isinstance(mod, MoE):
            mod.lora = ExpertLoRA(mod, rank, alpha)
            n += 1
    return n


def expert_loras(chunk) -> list[tuple[str, ExpertLoRA]]:
    """(module name of the MoE layer, its ExpertLoRA) of the chunk, in module order."""
    return [(name.removesuffix(".lora"), m) for name, m in chunk.named_modules() if isinstance(m, ExpertLoRA)]
