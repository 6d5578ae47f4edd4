"""What Muon updates, and the matrices it orthogonalizes: the placement rule, the pieces of a fused weight, the
Newton-Schulz iteration and the learning-rate rule (torch.optim.Muon's, torch 2.13).

Placement (`place`). Muon takes every matrix of the hidden layers (parameters under `layers.`):
  - the weight of each linear layer (column-, row-parallel, replicated: attention's q|k|v and out, MLA's q_a / q_b
    / kv_a / kv_b / o, the MLP's gate|up and down, a shared expert's, Gated DeltaNet's in_proj and out_proj);
  - every routed expert's matrices (the 3-D expert weights, [experts, out, in]): one matrix per expert;
  - LoRA's adapters (A and B, each a matrix) when a LoRA run trains them.
AdamW (the run's lr, weight decay, betas, eps) takes the rest: everything outside the hidden layers (embeddings,
learned positions, the final norm, the LM head), vectors (norms, biases, A_log, dt_bias, sinks, a router's
selection bias), biases stored as matrices (experts' biases, named `*bias*`) and the matrices a kind declares as
not Muon's (`param.muon = False`: a router's gate, the short convolution's taps). Any other trained matrix is
refused with one line: Muon cannot tell whether it is a projection.

Pieces. One Muon parameter may hold several matrices: a fused weight's parts (ShardSpec.parts: q|k|v, gate|up,
Gated DeltaNet's q|k|v|z|b|a) are orthogonalized one by one, each whole (replicated kv heads counted once), and a
routed experts' weight expert by expert. So q_proj, k_proj and v_proj are orthogonalized separately as Moonlight
and Kimi K2 do, also where a Hugging Face checkpoint stores them fused (GPT-2's c_attn, Phi-3's qkv_proj). A
LoRA adapter is one matrix. The learning rate of each piece follows its own shape: lr x 0.2 x sqrt(max(rows,
cols)) (adjust_lr_fn="match_rms_adamw", Moonlight's rule: AdamW's lr and weight decay carry over).

Newton-Schulz. torch.optim.Muon's quintic iteration (its coefficients, eps 1e-7, in bfloat16), batched over the
pieces of one shape: bit for bit the per-matrix result (tests/test_muon.py). In float32 on request (`ns_dtype`,
Megatron-Core's emerging_optimizers default; the layout tests use it: bfloat16 turns the summation-order noise of
two layouts' gradients into whole-ulp differences of the update).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from tpzoo.checkpoint.lora_io import is_lora_param
from tpzoo.errors import ConfigError
from tpzoo.parallel import ColumnParallelLinear, ReplicatedLinear, RowParallelLinear
from tpzoo.parallel.sharding import ShardSpec
from tpzoo.parallel.utils import param_spec

NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)  # torch.optim._muon DEFAULT_A, _B, _C (Keller Jordan's)
NS_EPS = 1e-7


@dataclass(frozen=True)
class Matrices:
    """How one Muon parameter (full, unsharded) splits into the matrices Muon orthogonalizes."""
    spec: ShardSpec          # its tensor-parallel layout (tp_spec)
    experts: bool = False    # dim 0 indexes routed experts, each orthogonalized on its own
    split: bool = True       # the fused parts (spec.parts along spec.dim) one by one; False: whole (LoRA)

    def matrix_dims(self, full_shape) -> list[tuple[int, int]]:
        """(rows, cols) of each piece of one matrix (an expert's, or the weight's), in order; `full_shape`: the whole
        parameter's."""
        rows, cols = full_shape[-2:]
        parts = self.spec.parts if self.split and self.spec.dim is not None else None
        if not parts or len(parts) == 1:
            return [(rows, cols)]
        along = self.spec.dim % len(full_shape) - (len(full_shape) - 2)  # 0: rows, 1: columns
        return [(p, cols) if along == 0 else (rows, p) for p in parts]

    def pieces(self, full: torch.Tensor) -> list[torch.Tensor]:
        """Views of `full` (the whole parameter) that Muon orthogonalizes, in order."""
        mats = list(full.unbind(0)) if self.experts else [full]
        sizes = self.matrix_dims(full.shape)
        if len(sizes) == 1:
            return mats
        along = self.spec.dim % full.dim() - (full.dim() - 2)
        split = [s[along] for s in sizes]
        return [piece for m in mats for piece in m.split(split, dim=along)]

    def lr_factors(self, full_shape) -> list[float]:
        """0.2 x sqrt(max(rows, cols)) of each piece of one matrix (match_rms_adamw); `full_shape`: the whole
        parameter's."""
        return [0.2 * math.sqrt(max(r, c)) for r, c in self.matrix_dims(full_shape)]

    def flops(self, full_shape, ns_steps: int) -> float:
        """Newton-Schulz FLOPs of every piece: per iteration X X^T (2 m^2 n), A A (2 m^3), B X (2 m^2 n), m <= n."""
        per = 0.0
        for r, c in self.matrix_dims(full_shape):
            m, n = min(r, c), max(r, c)
            per += ns_steps * (4 * m * m * n + 2 * m ** 3)
        return per * (full_shape[0] if self.experts else 1)


def full_shape(param: torch.Tensor, tp: int) -> tuple[int, ...]:
    """The unsharded shape over tensor-parallel size `tp` of this rank's shard `param` (experts: its ep rank's)."""
    spec, shape = param_spec(param), list(param.shape)
    if spec.dim is not None:
        d = spec.dim % param.dim()
        shape[d] = sum(spec.parts) if spec.parts else shape[d] * tp
    return tuple(shape)


def place(chunks) -> dict[int, tuple[str, Matrices]]:
    """{id(param): (name, Matrices)} of every trained parameter Muon updates (module docstring); raises ConfigError
    naming a trained matrix of a hidden layer that it can place nowhere."""
    out = {}
    for chunk in chunks:
        linear = {id(m.weight) for name, m in chunk.named_modules()
                  if name.startswith("layers.") and isinstance(m, (ColumnParallelLinear, RowParallelLinear,
                                                                   ReplicatedLinear))}
        for name, p in chunk.named_parameters():
            if not p.requires_grad or id(p) in out:
                continue
            m = _matrices(name, p, id(p) in linear)
            if m is not None:
                out[id(p)] = (name, m)
    return out


def _matrices(name: str, p, linear: bool) -> Matrices | None:
    spec = param_spec(p)
    if is_lora_param(name):
        return Matrices(spec, split=False)
    leaf = name.rsplit(".", 1)[-1]
    if not name.startswith("layers.") or p.dim() < 2 or "bias" in leaf or getattr(p, "muon", None) is False:
        return None
    if linear and p.dim() == 2:
        return Matrices(spec)
    if getattr(p, "expert_parallel", False) and p.dim() == 3:
        return Matrices(spec, experts=True)
    raise ConfigError(f"--optimizer muon cannot place {name} {list(p.shape)}: a matrix of a hidden layer that is "
                      f"neither a linear layer's weight nor an expert weight; mark it for AdamW (param.muon = False) "
                      f"or use --optimizer adamw")


def orthogonalize(pieces: list[torch.Tensor], steps: int, dtype=torch.bfloat16, coefficients=NS_COEFFICIENTS,
                  eps: float = NS_EPS) -> list[torch.Tensor]:
    """torch.optim.Muon's Newton-Schulz zeroth power of every piece (in `dtype`: torch's bfloat16, or float32), the
    pieces of one shape in one batch."""
    out: list = [None] * len(pieces)
    by_shape: dict[tuple, list[int]] = {}
    for i, t in enumerate(pieces):
        by_shape.setdefault(tuple(t.shape), []).append(i)
    for idx in by_shape.values():
        result = newton_schulz(torch.stack([pieces[i] for i in idx]), steps, dtype, coefficients, eps)
        for j, i in enumerate(idx):
            out[i] = result[j]
    return out


def newton_schulz(g: torch.Tensor, steps: int, dtype=torch.bfloat16, coefficients=NS_COEFFICIENTS,
                  eps: float = NS_EPS) -> torch.Tensor:
    """A batch [n, rows, cols] through torch.optim._muon._zeropower_via_newtonschulz's arithmetic (in `dtype`,
    torch's is bfloat16; the wide orientation; Frobenius norm at most 1; `steps` quintic iterations), batched
    matmuls in place of its 2-D ones."""
    a, b, c = coefficients
    x = g.to(dtype)
    tall = g.size(-2) > g.size(-1)
    if tall:
        x = x.mT.contiguous()  # a transposed view would take the batched matmul's slow strided path on CPU
    x = x / x.norm(dim=(-2, -1), keepdim=True).clamp(min=eps)
    for _ in range(steps):
        gram = x @ x.mT
        x = torch.baddbmm(x, torch.baddbmm(gram, gram, gram, beta=b, alpha=c), x, beta=a)
    return x.mT if tall else x
