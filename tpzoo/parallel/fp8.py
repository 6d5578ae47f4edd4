"""FP8 training of the tensor-parallel linear layers: recipes, dynamic scales that agree across tensor-parallel
ranks, the three GEMMs of a linear layer, and the weights cast once per optimizer step.

A linear layer y = x W^T runs three GEMMs: the forward, the input gradient (dgrad, dy W) and the weight gradient
(wgrad, dy^T x). In FP8 each operand is quantized q = cast(t * s) with a scale s = fp8_max / amax (dynamic: the
amax of the tensor at hand, no delayed history) and the GEMM multiplies the fp8 operands, applies 1/(s_a s_b) and
returns the activations' dtype. Master weights (fp32), main gradients, checkpoints and the stored weights are
untouched: only the GEMM operands are cast. The casts, the amax and the scaled GEMM are in fp8_ops.py (fused
Triton casts on CUDA: tpzoo.kernels.fp8_cast).

Recipes (FP8_RECIPES):
  tensorwise  one scale per tensor; forward operands (x, W) e4m3, gradients e5m2: Transformer Engine's "hybrid"
              format, the e5m2 range for gradients whose amax moves. The backward GEMMs reuse the forward's scales
              of x and W; the gradient gets one scale for dgrad and wgrad, and one cast writes it in both layouts.
  rowwise     one scale per row of each GEMM operand along its contraction dim (torch._scaled_mm's row-wise
              scaling: scale_a [M, 1], scale_b [1, N]): forward x per token and W per output channel; dgrad dy per
              token and W per input channel; wgrad dy per output channel and x per input channel (over the tokens).
              e4m3 throughout and scales rounded down to powers of two, as torchao's "rowwise" recipe: a per-row
              scale already follows each row's range, so e4m3's extra mantissa bit beats e5m2's range, and
              power-of-two scales make the dequantization exact. A per-row scale over a dim that is not split
              across ranks is taken inside the cast kernel (amax and cast in one launch).

Scales agree across TP ranks: an amax taken over a dimension that is split over the tensor-parallel group is
all-reduced (max) over it, so every rank quantizes its shard exactly as one rank holding the whole tensor would
(tp = 2 trains the same model as tp = 1). A column-parallel layer splits W's output dim (and dy's features), a
row-parallel layer W's input dim (and x's features); a replicated layer (tpzoo.parallel.ReplicatedLinear: latent
attention's down projections) splits no weight dim, but under sequence parallelism its tokens are split over tp.
Amaxes over tokens are reduced over the context-parallel group when cp > 1 (each cp rank holds part of every
sequence), and over tp for a replicated layer under SP. The reductions of a GEMM are concatenated into one
all-reduce per group (tpzoo.parallel.comm), issued before its other collectives, in the same order on every rank.
Under sequence parallelism the column layers' all-gather stays in the activations' dtype and quantizes after the
gather (an FP8 all-gather, halving those bytes, is not done).

Weights are cast once per optimizer step: the first forward after new weights casts W in both layouts its GEMMs
take (row-major for the forward, transposed for the input gradient; tensorwise one kernel, rowwise one per
scale axis) and the layer keeps them (2 bytes per weight element, tpzoo.plan counts them); later micro-batches,
the recomputation and the backward reuse them. They are cast again when the weight changes: the optimizer
publishing new weights calls weights_changed() (DistributedAdamW.publish), and an in-place write to the
parameter (a torch optimizer, a load) moves its version counter; a frozen weight (LoRA's base) is cast once.
`cache_weights=False` (ZeRO-3 gathering each layer per use, where keeping fp8 copies of every layer would undo
the sharding) casts per use: forward, recomputation and backward each cast what they need.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from tpzoo.errors import brief

from . import comm
from . import wgrad
from .eager import eager
from .fp8_ops import ALIGN, E4M3, E5M2, EPS, amax, cast, cast_rows, scale_of, scaled_mm  # noqa: F401 (re-exported)
from .wgrad import SKIP, bias_grad, input_wanted, route, weight_grad
from .wgrad import rows as _rows

FP8_RECIPES = ("none", "tensorwise", "rowwise")


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
    """The three GEMMs of an Fp8Linear on small bf16 operands (40 tokens: the weight gradient's contraction
    padded), output dtypes as in training (the weight gradient in fp32, for the main gradient): (y, dx, dw)."""
    fp8 = Fp8Linear(rec, "column", cache_weights=False)
    x = torch.randn(40, 32, device=device, dtype=torch.bfloat16)
    w = torch.randn(16, 32, device=device, dtype=torch.bfloat16)
    y, saved = fp8.forward(x, w, backward=True)
    dy = torch.randn_like(y)
    scales = fp8.backward_scales(dy, w, saved, True, True)
    out = (y, fp8.input_grad(dy, w, saved, scales), fp8.weight_grad(dy, x, saved, scales, torch.float32))
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return out


# -- weights cast once per optimizer step ----------------------------------------------------------------------

_epoch = 0  # bumped whenever new weights are published: every cached fp8 weight is stale


def weights_changed() -> None:
    """New weights were published (an optimizer step, a load into the parameters): each layer casts its weight
    again at its next use. DistributedAdamW.publish calls it; in-place writes to a parameter need no call (its
    version counter moves)."""
    global _epoch
    _epoch += 1


class _Fp8Weight:
    """One weight's fp8 copies for the current weights (`key`): q [out, in] (the forward's operand) with its
    dequantization scale, qt [in, out] (the input gradient's) with its, and the tensorwise amax both use."""
    __slots__ = ("key", "q", "inv", "qt", "inv_t", "amax")

    def __init__(self, key):
        self.key, self.q, self.inv, self.qt, self.inv_t, self.amax = key, None, None, None, None, None


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
            if len(idx) == 1:  # one amax: reduced in place, no concatenation
                comm.all_reduce(out[idx[0]], group, op=dist.ReduceOp.MAX)
                continue
            parts = [out[i].reshape(-1) for i in idx]
            if len({p.dtype for p in parts}) > 1:
                parts = [p.float() for p in parts]
            flat = torch.cat(parts)
            comm.all_reduce(flat, group, op=dist.ReduceOp.MAX)
            for i, part in zip(idx, flat.split([out[i].numel() for i in idx])):
                out[i] = part.view(out[i].shape)
        return out


class Fp8Linear:
    """The FP8 GEMMs of one column-parallel, row-parallel or replicated layer (what `layer.fp8` holds; enable_fp8
    attaches it), and
    its weight's fp8 copies (the module docstring).

    `kind`: "column" (W's output dim, and the output gradient's features, split over tp), "row" (W's input dim
    and the input's features split) or "replicated" (nothing split; `tp_group` given only when the tokens are,
    under SP). `tp_group` / `cp_group`: None when that size is 1. x: [tokens, in],
    W: [out, in], dy: [tokens, out] (this rank's shards). The collectives of each GEMM happen before its matmul
    (forward(); backward_scales() for both backward GEMMs, issued before any other backward collective of the
    layer; weight_grad() only reduces over cp), in the same order on every rank (a cached weight is cached on
    every rank alike). `weight_casts` counts the cast kernels run on the weight."""

    def __init__(self, recipe: Fp8Recipe, kind: str, tp_group=None, cp_group=None, cache_weights: bool = True):
        if kind not in ("column", "row", "replicated"):
            raise ValueError(f"Fp8Linear kind must be 'column', 'row' or 'replicated', got {kind!r}")
        self.recipe, self.kind, self.tp = recipe, kind, tp_group
        self._w_split = None if kind == "replicated" else self.tp  # where W itself is split
        # where the tokens are split: cp, and tp for a replicated layer under SP (the others gather them first)
        self.cp = (self.tp, cp_group) if kind == "replicated" else (cp_group,)
        self._out_split = self.tp if kind == "column" else None  # tp group where the out features are split
        self._in_split = self.tp if kind == "row" else None      # tp group where the in features are split
        self.cache_weights, self._cached, self.weight_casts = cache_weights, None, 0

    def _weight(self, w: torch.Tensor) -> _Fp8Weight:
        """The fp8 copies of the current weights (cached, or a new empty entry to fill)."""
        key = (w.data_ptr(), w._version, _epoch if w.requires_grad else -1)
        entry = self._cached
        if entry is None or entry.key != key:
            entry = _Fp8Weight(key)
            self._cached = entry if self.cache_weights else None
        return entry

    def forward(self, x: torch.Tensor, w: torch.Tensor, backward: bool = False) -> tuple[torch.Tensor, tuple]:
        """x W^T in x's dtype, and what the backward reuses (the weight's fp8 copies; tensorwise x's amax).
        `backward`: a backward will follow (the caller's autograd decides; a Function's forward runs without
        grad mode), so the input gradient's copy of W is cast now, with the forward's, once for the step."""
        r, red, e = self.recipe, _Reductions(), self._weight(w)
        need_q = e.q is None
        need_t = self.cache_weights and e.qt is None and backward
        if r.rowwise:  # x per token, W per output channel: over the input features; W per input channel: over out
            ix = red.add(amax(x, 1), self._in_split) if self._in_split is not None else None
            iw = red.add(amax(w, 1), self._in_split) if need_q and self._in_split is not None else None
            iwt = red.add(amax(w, 0), self._out_split) if need_t else None
            a = red.run()
            x8, inv_x = cast_rows(x, E4M3, True) if ix is None else cast(x, a[ix], E4M3, "rows", True)[::2]
            if need_q:
                e.q, e.inv = cast_rows(w, E4M3, True) if iw is None else cast(w, a[iw], E4M3, "rows", True)[::2]
                e.inv = e.inv.view(1, -1)  # scale_b [1, out]
            if need_t:
                _, e.qt, e.inv_t = cast(w, a[iwt], E4M3, "cols", True, want_q=False, want_t=True)
            self.weight_casts += need_q + need_t
            return scaled_mm(x8, e.q.t(), inv_x, e.inv, x.dtype, fast_accum=True), (e,)
        ix = red.add(amax(x), self._in_split, *self.cp)
        iw = red.add(amax(w), self._w_split) if need_q else None
        a = red.run()
        if need_q or need_t:  # one kernel writes both layouts
            e.amax = a[iw] if need_q else e.amax
            q, qt, e.inv = cast(w, e.amax, E4M3, "tensor", False, want_q=need_q, want_t=need_t)
            e.q, e.qt = q if need_q else e.q, qt if need_t else e.qt
            self.weight_casts += 1
        x8, _, inv_x = cast(x, a[ix], E4M3, "tensor", False)
        return scaled_mm(x8, e.q.t(), inv_x, e.inv, x.dtype, fast_accum=True), (a[ix], e)

    def backward_scales(self, dy: torch.Tensor, w: torch.Tensor, saved: tuple, need_input_grad: bool,
                        need_weight_grad: bool) -> tuple:
        """The backward's tensor-parallel agreement, once per backward call, before its other collectives, and the
        output gradient's casts: tensorwise one scale and one cast writing dy in both layouts (dgrad's row-major,
        wgrad's transposed); rowwise (dgrad only) dy per token, and W per input channel if not cached."""
        r, red, e = self.recipe, _Reductions(), saved[-1]
        need_t = need_input_grad and e.qt is None
        if not r.rowwise:
            ig = red.add(amax(dy), self._out_split, *self.cp)
            a = red.run()
            if need_t:  # not cached (or cast without a backward in view): the forward's scale, no reduction
                _, e.qt, _ = cast(w, e.amax, E4M3, "tensor", False, want_q=False, want_t=True)
                self.weight_casts += 1
            return cast(dy, a[ig], r.grad_dtype, "tensor", False, want_q=need_input_grad, want_t=need_weight_grad)
        if not need_input_grad:
            return ()
        ig = red.add(amax(dy, 1), self._out_split) if self._out_split is not None else None
        iwt = red.add(amax(w, 0), self._out_split) if need_t else None
        a = red.run()
        if need_t:
            _, e.qt, e.inv_t = cast(w, a[iwt], E4M3, "cols", True, want_q=False, want_t=True)
            self.weight_casts += 1
        return cast_rows(dy, r.grad_dtype, True) if ig is None else cast(dy, a[ig], r.grad_dtype, "rows", True)[::2]

    def input_grad(self, dy: torch.Tensor, w: torch.Tensor, saved: tuple, scales: tuple) -> torch.Tensor:
        """dy W (this rank's partial sum for a column layer), in dy's dtype."""
        e = saved[-1]
        if self.recipe.rowwise:
            dy8, inv_g = scales
            return scaled_mm(dy8, e.qt.t(), inv_g, e.inv_t, dy.dtype)
        dy8, _, inv_g = scales
        return scaled_mm(dy8, e.qt.t(), inv_g, e.inv, dy.dtype)

    def weight_grad(self, dy: torch.Tensor, x: torch.Tensor, saved: tuple, scales: tuple,
                    out_dtype: torch.dtype | None = None) -> torch.Tensor:
        """dy^T x ([out, in]) in `out_dtype` (default dy's: fp32 to accumulate into a main gradient). Both operands
        are cast transposed (the token dim contracted, padded on CUDA)."""
        r, out_dtype = self.recipe, out_dtype or dy.dtype
        if r.rowwise:  # dy per output channel and x per input channel, both over the tokens
            red = _Reductions()
            ig, ix = red.add(amax(dy, 0), *self.cp), red.add(amax(x, 0), *self.cp)
            a = red.run()
            _, dy8t, inv_g = cast(dy, a[ig], r.grad_dtype, "cols", True, want_q=False, want_t=True)
            _, x8t, inv_x = cast(x, a[ix], E4M3, "cols", True, want_q=False, want_t=True)
            return scaled_mm(dy8t, x8t.t(), inv_g.view(-1, 1), inv_x, out_dtype)
        _, dy8t, inv_g = scales
        _, x8t, inv_x = cast(x, saved[0], E4M3, "tensor", False, want_q=False, want_t=True)
        return scaled_mm(dy8t, x8t.t(), inv_g, inv_x, out_dtype)

    def __repr__(self) -> str:
        return f"Fp8Linear({self.recipe.name}, {self.kind})"


# -- the seam the layers call -----------------------------------------------------------------------------------

class _Fp8LinearFunction(torch.autograd.Function):
    """y = x W^T + b with the three GEMMs in FP8 (Fp8Linear). Saves x and W as they are (the backward casts x
    again, transposed; the weight's fp8 copies come from the forward). Routes the weight and bias gradients as
    tpzoo.parallel.wgrad does (zero-bubble's phases, gradient-accumulation fusion)."""

    @staticmethod
    def forward(ctx, x, weight, bias, fp8: Fp8Linear, backward: bool):
        y, ctx.fp8_saved = fp8.forward(_rows(x), weight, backward)
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
            scales = fp8.backward_scales(dy2, weight, ctx.fp8_saved, need_x, way_w != SKIP)
            if need_x:
                grad_x = fp8.input_grad(dy2, weight, ctx.fp8_saved, scales).view(*dy.shape[:-1], weight.shape[1])
            x2 = _rows(x)
            grad_w = weight_grad(ctx, 1, dy2, x2, way_w,
                                 lambda dtype: fp8.weight_grad(dy2, x2, ctx.fp8_saved, scales, dtype))
        return grad_x, grad_w, bias_grad(ctx, 2, dy2, way_b), None, None


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
           fp8: Fp8Linear | None = None) -> torch.Tensor:
    """F.linear, or with `fp8` (a layer's Fp8Linear) its three GEMMs in FP8: the one call the layers make."""
    if fp8 is None:
        return wgrad.linear(x, weight, bias)  # with gradient-accumulation fusion where it applies
    if getattr(fp8, "frozen_weight", False):  # a kept-quantized weight's own matmuls (tpzoo.quant.modules)
        return fp8.linear(x, weight, bias)
    return _fp8_linear(x, weight, bias, fp8)


@eager
def _fp8_linear(x, weight, bias, fp8: Fp8Linear):
    """Never traced by torch.compile (tpzoo.parallel.eager: a graph break): the FP8 GEMMs run their own fused
    casts, and the weight cache is Python state."""
    backward = torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad)
    return _Fp8LinearFunction.apply(x, weight, bias, fp8, backward)


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


def enable_fp8(modules, recipe: str | None, cache_weights: bool = True) -> Fp8Report:
    """Run the eligible linear layers of `modules` (model chunks; meta or materialized) in FP8 with `recipe`
    ("none", "tensorwise", "rowwise"; anything else is one ValueError line). Eligible: modules whose class says
    `fp8_kind` ("column" / "row": tpzoo's parallel linear layers, LoRA's frozen bases included; the LM head
    says None). A layer whose local weight dims are not multiples of 16 stays as it is and is reported.
    `cache_weights`: keep each weight's fp8 copies until the weights change (False: cast per use; ZeRO-3)."""
    rec = get_recipe(recipe)
    report = Fp8Report(rec.name if rec else "none")
    for chunk in modules if isinstance(modules, (list, tuple)) else [modules]:
        for name, m in chunk.named_modules():
            kind = getattr(type(m), "fp8_kind", None)
            if kind is None or getattr(m.fp8, "frozen_weight", False):  # (a kept-quantized weight: its own GEMMs)
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
            m.fp8 = Fp8Linear(rec, kind, dims.tp_group if tp_split else None,
                              dims.cp_group if dims.cp > 1 else None, cache_weights)
            report.fp8_layers.append(name)
    return report
