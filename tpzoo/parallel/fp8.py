"""FP8 training of the tensor-parallel linear layers: recipes, dynamic scales, the scaled GEMM (CUDA and an exact
CPU emulation), and the three GEMMs of a linear layer with scales that agree across tensor-parallel ranks.

A linear layer y = x W^T runs three GEMMs: the forward, the input gradient (dgrad, dy W) and the weight gradient
(wgrad, dy^T x). In FP8 each operand is quantized q = cast(t * s) with a scale s = fp8_max / amax (dynamic: the
amax of the tensor at hand, no delayed history) and the GEMM multiplies the fp8 operands, applies 1/(s_a s_b) and
returns the activations' dtype. Master weights (fp32), main gradients, checkpoints and the stored weights are
untouched: only the GEMM operands are cast, each time.

Recipes (FP8_RECIPES):
  tensorwise  one scale per tensor; forward operands (x, W) e4m3, gradients e5m2: Transformer Engine's "hybrid"
              format, the e5m2 range for gradients whose amax moves. The fp8 x and W of the forward are reused
              (same scales) by the backward GEMMs; the gradient gets one scale for dgrad and wgrad.
  rowwise     one scale per row of each GEMM operand along its contraction dim (torch._scaled_mm's row-wise
              scaling: scale_a [M, 1], scale_b [1, N]): forward x per token and W per output channel; dgrad dy per
              token and W per input channel; wgrad dy per output channel and x per input channel (over the tokens).
              e4m3 throughout and scales rounded down to powers of two, as torchao's "rowwise" recipe: a per-row
              scale already follows each row's range, so e4m3's extra mantissa bit beats e5m2's range, and
              power-of-two scales make the dequantization exact.

Scales agree across TP ranks: an amax taken over a dimension that is split over the tensor-parallel group is
all-reduced (max) over it, so every rank quantizes its shard exactly as one rank holding the whole tensor would
(tp = 2 trains the same model as tp = 1). A column-parallel layer splits W's output dim (and dy's features), a
row-parallel layer W's input dim (and x's features); a replicated layer (tpzoo.parallel.ReplicatedLinear) splits
no weight dim, but under sequence parallelism its tokens are split over tp. Amaxes over tokens are reduced over
the context-parallel group when cp > 1 (each cp rank holds part of every sequence), and over tp for a replicated
layer under SP. The reductions of a GEMM are concatenated into one
all-reduce per group (tpzoo.parallel.comm): per micro-batch a column layer issues 2 (tensorwise) or 1 (rowwise)
scalar-sized all-reduces, a row layer 1. Under sequence parallelism the column layers' all-gather stays in the
activations' dtype and quantizes after the gather (an FP8 all-gather, halving those bytes, is not done).

CUDA: torch._scaled_mm (torch 2.11 and 2.13 share its signature: mat1 row-major [M, K], mat2 column-major
[K, N], K and N multiples of 16, fp32 scales: 0-dim for tensorwise, [M, 1] and [1, N] for row-wise; row-wise
output bf16, or fp32 where cuBLAS >= 12.9 on sm90 has it). Layers whose local dims are not multiples of 16 stay in
bf16 (enable_fp8 reports them); the token dim, the wgrad's K, is zero-padded to 16 when needed (exact). Elsewhere
the GEMM is emulated exactly: the same fp8 casts with the same scales, the fp8 values multiplied in fp32 (fp64 for
fp64 operands, as the parity tests use) and scaled once, so CPU tests run every line of the scaling logic.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from tpzoo.errors import brief

from . import comm
from . import wgrad
from .wgrad import SKIP, bias_grad, input_wanted, route, weight_grad
from .wgrad import rows as _rows

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
FP8_RECIPES = ("none", "tensorwise", "rowwise")
EPS = 1e-12       # amax floor: an all-zero tensor (padding rows) quantizes to zeros with a finite scale
ALIGN = 16        # torch._scaled_mm: K and N multiples of 16


@dataclass(frozen=True)
class Fp8Recipe:
    name: str
    rowwise: bool
    grad_dtype: torch.dtype     # the gradient operand's format (the forward operands are e4m3)
    pow2_scales: bool


_RECIPES = {"tensorwise": Fp8Recipe("tensorwise", rowwise=False, grad_dtype=E5M2, pow2_scales=False),
            "rowwise": Fp8Recipe("rowwise", rowwise=True, grad_dtype=E4M3, pow2_scales=True)}


def get_recipe(name: str | None) -> Fp8Recipe | None:
    """The recipe called `name`; None for "none" (or None). An unknown name is one ValueError line."""
    if name in (None, "none"):
        return None
    if name not in _RECIPES:
        raise ValueError(f"fp8 recipe {name!r} is unknown: choose one of {', '.join(FP8_RECIPES)}")
    return _RECIPES[name]


def hardware_problem(recipe: str | None, device: torch.device, capability: tuple[int, int] | None = None,
                     trial=None) -> str | None:
    """Why `recipe` cannot run its GEMMs on `device` (one line), or None. torch._scaled_mm needs FP8 tensor cores
    (compute capability 8.9+: Ada, Hopper, Blackwell), and which scalings it runs depends on the GPU and the torch
    build (row-wise scaling has been Hopper-only in some versions, and cuBLAS refuses it on sm_120): so after the
    capability, one small GEMM of the recipe's kind is tried (`trial(rec, device)`, default _trial_gemm). Either
    failure would otherwise be a traceback from inside the first forward. CPU runs the emulation: no problem."""
    rec = get_recipe(recipe)
    if rec is None or device.type != "cuda":
        return None
    capability = capability or torch.cuda.get_device_capability(device)
    name = torch.cuda.get_device_name(device) if torch.cuda.is_available() else "this GPU"
    if tuple(capability) < (8, 9):
        return (f"--fp8 {recipe} needs FP8 tensor cores (compute capability 8.9+: Ada, Hopper, Blackwell); "
                f"{name} has {capability[0]}.{capability[1]}: train without --fp8 (bf16)")
    try:
        (trial or _trial_gemm)(rec, device)
    except Exception as exc:  # noqa: BLE001 - whatever torch says, in one line
        other = "tensorwise" if rec.rowwise else "rowwise"
        return (f"--fp8 {recipe}: torch {torch.__version__} cannot run its scaled GEMMs on {name} "
                f"({brief(exc)}); try --fp8 {other}, or train without --fp8")
    return None


def _trial_gemm(rec: "Fp8Recipe", device: torch.device) -> tuple:
    """The three GEMMs of an Fp8Linear on small bf16 operands, output dtypes as in training (the weight gradient in
    fp32, for the main gradient): (y, dx, dw)."""
    fp8 = Fp8Linear(rec, "column")
    x = torch.randn(32, 32, device=device, dtype=torch.bfloat16)
    w = torch.randn(16, 32, device=device, dtype=torch.bfloat16)
    y, saved = fp8.forward(x, w)
    dy = torch.randn_like(y)
    scales = fp8.backward_scales(dy, w, True)
    out = (y, fp8.input_grad(dy, w, saved, scales), fp8.weight_grad(dy, x, saved, scales, torch.float32))
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return out


# -- scales and casts -------------------------------------------------------------------------------------------

def _quantize(t: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    wide = torch.float64 if t.dtype == torch.float64 else torch.float32
    top = torch.finfo(dtype).max
    return (t.to(wide) * scale).clamp(-top, top).to(dtype)


# On CUDA the cast runs as a torch.compile'd kernel: one pass over the tensor, where eager torch makes several and
# an fp32 copy of it (for a weight, about the size of the GEMM's savings). Same arithmetic, so the same fp8 values
# (tests/test_fp8.py checks it on a GPU). False: eager everywhere (benchmarks compare).
COMPILE_CASTS = True
_compiled_quantize = None


def _cuda_quantize(t: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    global _compiled_quantize
    if _compiled_quantize is None:
        _compiled_quantize = torch.compile(_quantize, dynamic=True)
    try:  # detached: a Parameter and a plain tensor would compile two graphs
        return _compiled_quantize(t.detach(), scale.detach(), dtype)
    except Exception as exc:  # noqa: BLE001 - no working inductor here: eager (the same values) from now on
        import warnings

        warnings.warn(f"tpzoo fp8: compiled casts unavailable ({type(exc).__name__}: {exc}); eager casts")
        _compiled_quantize = _quantize
        return _quantize(t, scale, dtype)


def amax(t: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """max |t| in fp32: over everything (a 0-dim tensor), or over `dim` (kept, size 1). One reduction kernel
    (the inf-norm), no |t| temporary."""
    return torch.linalg.vector_norm(t, float("inf"), dim=dim, keepdim=dim is not None).float()


def scale_of(amax_: torch.Tensor, dtype: torch.dtype, pow2: bool = False) -> torch.Tensor:
    """The quantization scale fp8_max / amax (fp32), rounded down to a power of two if `pow2`."""
    s = torch.finfo(dtype).max / amax_.clamp(min=EPS)
    return torch.exp2(torch.floor(torch.log2(s))) if pow2 else s


def quantize(t: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """cast(t * scale) to `dtype`, saturated at its largest finite value (e4m3fn has no infinity). The product
    is taken in fp32 (fp64 for fp64 tensors), as a fused cast kernel computes it."""
    if t.is_cuda and COMPILE_CASTS:
        return _cuda_quantize(t, scale, dtype)
    return _quantize(t, scale, dtype)


# -- the scaled GEMM --------------------------------------------------------------------------------------------

def scaled_mm(a: torch.Tensor, b: torch.Tensor, inv_a: torch.Tensor, inv_b: torch.Tensor, out_dtype: torch.dtype,
              fast_accum: bool = False) -> torch.Tensor:
    """(a @ b) * inv_a * inv_b in `out_dtype` for fp8 a [M, K], b [K, N]; inv_a / inv_b: the dequantization
    scales 1/s, 0-dim (tensorwise) or [M, 1] / [1, N] (row-wise). torch._scaled_mm on CUDA, else emulated."""
    if a.is_cuda and out_dtype != torch.float64:
        return _cuda_scaled_mm(a, b, inv_a, inv_b, out_dtype, fast_accum)
    wide = torch.float64 if out_dtype == torch.float64 else torch.float32
    return (a.to(wide) @ b.to(wide)).mul_(inv_a * inv_b).to(out_dtype)


_ROWWISE_FP32_OUT: dict = {}  # device index -> whether row-wise _scaled_mm gives fp32 output there


def _pad_k(t: torch.Tensor, dim: int) -> torch.Tensor:
    """Zero-pad dim `dim` (the contraction dim) to a multiple of ALIGN: zeros add nothing to the products."""
    k = t.shape[dim]
    if k % ALIGN == 0:
        return t
    shape = list(t.shape)
    shape[dim] = -(-k // ALIGN) * ALIGN
    out = torch.zeros(shape, dtype=t.dtype, device=t.device)
    out.narrow(dim, 0, k).copy_(t)
    return out


def _cuda_scaled_mm(a, b, inv_a, inv_b, out_dtype, fast_accum):
    a = _pad_k(a.contiguous(), 1)                    # mat1 row-major
    b = _pad_k(b.t().contiguous(), 1).t()            # mat2 column-major (its transpose row-major)
    rowwise = inv_a.dim() == 2
    inv_a, inv_b = inv_a.contiguous(), inv_b.contiguous()
    if rowwise and out_dtype == torch.float32:
        key = a.device.index
        if _ROWWISE_FP32_OUT.get(key, True):
            try:
                out = torch._scaled_mm(a, b, inv_a, inv_b, out_dtype=out_dtype, use_fast_accum=fast_accum)
                _ROWWISE_FP32_OUT[key] = True
                return out
            except (RuntimeError, ValueError):  # "Only bf16 high precision output types ... for row-wise scaling"
                _ROWWISE_FP32_OUT[key] = False
        return torch._scaled_mm(a, b, inv_a, inv_b, out_dtype=torch.bfloat16, use_fast_accum=fast_accum).float()
    return torch._scaled_mm(a, b, inv_a, inv_b, out_dtype=out_dtype, use_fast_accum=fast_accum)


# -- a linear layer's three GEMMs -------------------------------------------------------------------------------

@dataclass
class _Reductions:
    """Amaxes to make agree: each goes to the groups named for it, one all-reduce (max) per group."""
    tensors: list = field(default_factory=list)
    groups: list = field(default_factory=list)

    def add(self, t: torch.Tensor, *groups) -> int:
        self.tensors.append(t)
        self.groups.append(tuple(g for g in groups if g is not None))
        return len(self.tensors) - 1

    def run(self) -> list:
        out = list(self.tensors)
        for group in dict.fromkeys(g for gs in self.groups for g in gs):  # tp before cp, in order of first use
            idx = [i for i, gs in enumerate(self.groups) if group in gs]
            flat = torch.cat([out[i].reshape(-1) for i in idx])
            comm.all_reduce(flat, group, op=dist.ReduceOp.MAX)
            for i, part in zip(idx, flat.split([out[i].numel() for i in idx])):
                out[i] = part.view(out[i].shape)
        return out


class Fp8Linear:
    """The FP8 GEMMs of one column-parallel, row-parallel or replicated layer (what `layer.fp8` holds; enable_fp8
    attaches it).

    `kind`: "column" (W's output dim, and the output gradient's features, split over tp), "row" (W's input dim
    and the input's features split) or "replicated" (nothing split; `tp_group` given only when the tokens are,
    under SP). `tp_group` / `cp_group`: None when that size is 1. x: [tokens, in],
    W: [out, in], dy: [tokens, out] (this rank's shards). The collectives of each GEMM happen before its matmul
    (forward(); backward_scales() for both backward GEMMs, issued before any other backward collective of the
    layer; weight_grad() only reduces over cp), in the same order on every rank."""

    def __init__(self, recipe: Fp8Recipe, kind: str, tp_group=None, cp_group=None):
        if kind not in ("column", "row", "replicated"):
            raise ValueError(f"Fp8Linear kind must be 'column', 'row' or 'replicated', got {kind!r}")
        self.recipe, self.kind, self.tp = recipe, kind, tp_group
        self._out_split = self.tp if kind == "column" else None  # tp group where the out features are split
        self._in_split = self.tp if kind == "row" else None      # tp group where the in features are split
        self._w_split = None if kind == "replicated" else self.tp  # where W itself is split
        # where the tokens are split: cp, and tp for a replicated layer under SP (the others gather them first)
        self.cp = (self.tp, cp_group) if kind == "replicated" else (cp_group,)

    def _scale(self, amax_: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        return scale_of(amax_, dtype, self.recipe.pow2_scales)

    def forward(self, x: torch.Tensor, w: torch.Tensor) -> tuple[torch.Tensor, tuple]:
        """x W^T in x's dtype, and what the backward reuses (tensorwise: the scales of x and W)."""
        r = self.recipe
        red = _Reductions()
        if r.rowwise:  # x per token, W per output channel: both over the input features
            red.add(amax(x, 1), self._in_split)
            red.add(amax(w, 1), self._in_split)
            ax, aw = red.run()
            sx, sw = self._scale(ax, E4M3), self._scale(aw, E4M3)
            y = scaled_mm(quantize(x, sx, E4M3), quantize(w, sw, E4M3).t(), 1 / sx, (1 / sw).t(), x.dtype,
                          fast_accum=True)
            return y, ()
        red.add(amax(x), self._in_split, *self.cp)
        red.add(amax(w), self._w_split)
        ax, aw = red.run()
        sx, sw = self._scale(ax, E4M3), self._scale(aw, E4M3)
        y = scaled_mm(quantize(x, sx, E4M3), quantize(w, sw, E4M3).t(), 1 / sx, 1 / sw, x.dtype, fast_accum=True)
        return y, (sx, sw)

    def backward_scales(self, dy: torch.Tensor, w: torch.Tensor, need_input_grad: bool) -> tuple:
        """The backward's tensor-parallel agreement, once per backward call, before its other collectives:
        tensorwise the output gradient's scale (and dy cast once for both GEMMs); rowwise (dgrad only) the scales
        of dy per token and of W per input channel."""
        r, red = self.recipe, _Reductions()
        if not r.rowwise:  # one scale, one cast of dy for both GEMMs
            red.add(amax(dy), self._out_split, *self.cp)
            (ag,) = red.run()
            sg = self._scale(ag, r.grad_dtype)
            return sg, quantize(dy, sg, r.grad_dtype)
        if not need_input_grad:
            return ()
        red.add(amax(dy, 1), self._out_split)
        red.add(amax(w, 0), self._out_split)
        ag, aw = red.run()
        return self._scale(ag, r.grad_dtype), self._scale(aw, E4M3)

    def input_grad(self, dy: torch.Tensor, w: torch.Tensor, saved: tuple, scales: tuple) -> torch.Tensor:
        """dy W (this rank's partial sum for a column layer), in dy's dtype."""
        r = self.recipe
        if r.rowwise:
            sg, sw = scales
            return scaled_mm(quantize(dy, sg, r.grad_dtype), quantize(w, sw, E4M3), 1 / sg, 1 / sw, dy.dtype)
        (sg, dy8), (_, sw) = scales, saved
        return scaled_mm(dy8, quantize(w, sw, E4M3), 1 / sg, 1 / sw, dy.dtype)

    def weight_grad(self, dy: torch.Tensor, x: torch.Tensor, saved: tuple, scales: tuple,
                    out_dtype: torch.dtype | None = None) -> torch.Tensor:
        """dy^T x ([out, in]) in `out_dtype` (default dy's: fp32 to accumulate into a main gradient)."""
        r, out_dtype = self.recipe, out_dtype or dy.dtype
        if r.rowwise:  # dy per output channel and x per input channel, both over the tokens
            red = _Reductions()
            red.add(amax(dy, 0), *self.cp)
            red.add(amax(x, 0), *self.cp)
            ag, ax = red.run()
            sg, sx = self._scale(ag, r.grad_dtype), self._scale(ax, E4M3)
            return scaled_mm(quantize(dy, sg, r.grad_dtype).t(), quantize(x, sx, E4M3), (1 / sg).t(), 1 / sx,
                             out_dtype)
        (sg, dy8), (sx, _) = scales, saved
        return scaled_mm(dy8.t(), quantize(x, sx, E4M3), 1 / sg, 1 / sx, out_dtype)

    def __repr__(self) -> str:
        return f"Fp8Linear({self.recipe.name}, {self.kind})"


# -- the seam the layers call -----------------------------------------------------------------------------------

class _Fp8LinearFunction(torch.autograd.Function):
    """y = x W^T + b with the three GEMMs in FP8 (Fp8Linear). Saves x and W as they are (the backward casts
    again: row-wise scaling needs other axes, and the weight is the same until the optimizer step). Routes the
    weight and bias gradients as tpzoo.parallel.wgrad does (zero-bubble's phases, gradient-accumulation fusion)."""

    @staticmethod
    def forward(ctx, x, weight, bias, fp8: Fp8Linear):
        y, ctx.fp8_saved = fp8.forward(_rows(x), weight)
        ctx.fp8 = fp8
        ctx.save_for_backward(x, weight)
        y = y.view(*x.shape[:-1], weight.shape[0])
        return y + bias if bias is not None else y

    @staticmethod
    def backward(ctx, dy):
        x, weight = ctx.saved_tensors
        fp8 = ctx.fp8
        # where the weight's and bias's gradients go (tpzoo.parallel.wgrad: skipped, returned, or accumulated
        # into the fp32 main gradient: the FP8 weight-gradient GEMM with fp32 output, added)
        need_x, way_w, way_b = input_wanted(ctx), route(ctx, 1), route(ctx, 2)
        dy2 = _rows(dy)
        grad_x = grad_w = None
        if need_x or way_w != SKIP:
            scales = fp8.backward_scales(dy2, weight, need_x)
            if need_x:
                grad_x = fp8.input_grad(dy2, weight, ctx.fp8_saved, scales).view(*dy.shape[:-1], weight.shape[1])
            x2 = _rows(x)
            grad_w = weight_grad(ctx, 1, dy2, x2, way_w,
                                 lambda dtype: fp8.weight_grad(dy2, x2, ctx.fp8_saved, scales, dtype))
        return grad_x, grad_w, bias_grad(ctx, 2, dy2, way_b), None


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
           fp8: Fp8Linear | None = None) -> torch.Tensor:
    """F.linear, or with `fp8` (a layer's Fp8Linear) its three GEMMs in FP8: the one call the layers make."""
    if fp8 is None:
        return wgrad.linear(x, weight, bias)  # with gradient-accumulation fusion where it applies
    return _Fp8LinearFunction.apply(x, weight, bias, fp8)


# -- switching a model's layers ----------------------------------------------------------------------------------

@dataclass
class Fp8Report:
    """What enable_fp8 did: the recipe, the layers now in FP8, and those left in bf16 with their local shapes."""
    recipe: str
    fp8_layers: list = field(default_factory=list)
    fallbacks: list = field(default_factory=list)   # (name, out per rank, in per rank)

    def line(self) -> str:
        """One line for the start of a run (empty without fp8)."""
        if self.recipe == "none":
            return ""
        r = _RECIPES[self.recipe]
        fmt = "e4m3 throughout, row-wise scales" if r.rowwise else "e4m3 forward, e5m2 gradients, tensor scales"
        text = (f"fp8 {self.recipe} ({fmt}): {len(self.fp8_layers)} linear layers in FP8, the LM head, embeddings "
                f"and experts in the model dtype")
        if self.fallbacks:
            kinds: dict = {}
            for name, out, inp in self.fallbacks:  # one entry per role (layers.3.attn.out -> attn.out)
                role = ".".join(p for p in name.split(".") if not p.isdigit() and p != "layers")
                kinds.setdefault((role, out, inp), 0)
                kinds[(role, out, inp)] += 1
            text += ("; left in the model dtype (local dims not multiples of 16): "
                     + ", ".join(f"{role} [{out} x {inp}] x{n}" for (role, out, inp), n in kinds.items()))
        return text


def enable_fp8(modules, recipe: str | None) -> Fp8Report:
    """Run the eligible linear layers of `modules` (model chunks; meta or materialized) in FP8 with `recipe`
    ("none", "tensorwise", "rowwise"; anything else is one ValueError line). Eligible: modules whose class says
    `fp8_kind` ("column" / "row": tpzoo's parallel linear layers, LoRA's frozen bases included; the LM head
    says None). A layer whose local weight dims are not multiples of 16 stays as it is and is reported."""
    rec = get_recipe(recipe)
    report = Fp8Report(rec.name if rec else "none")
    for chunk in modules if isinstance(modules, (list, tuple)) else [modules]:
        for name, m in chunk.named_modules():
            kind = getattr(type(m), "fp8_kind", None)
            if kind is None:
                continue
            m.fp8 = None
            if rec is None:
                continue
            out, inp = m.weight.shape
            if out % ALIGN or inp % ALIGN:
                report.fallbacks.append((name, out, inp))
                continue
            dims = m.dims
            tp_split = dims.tp > 1 and (kind != "replicated" or m.sequence_parallel)
            m.fp8 = Fp8Linear(rec, kind, dims.tp_group if tp_split else None, dims.cp_group if dims.cp > 1 else None)
            report.fp8_layers.append(name)
    return report
