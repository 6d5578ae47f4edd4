"""Gradient-accumulation fusion: weight gradients accumulated straight into the fp32 main gradients.

Without it autograd hands each weight gradient over as a tensor of the model dtype (`.grad`), which the
GradBuffer's hook adds into the fp32 `main_grad` and frees: per weight and micro-batch a 16-bit gradient is
allocated, written, read back and added (4.5 % of the 1B step's GPU time in issue 24's profile). With it (as
Megatron's `gradient_accumulation_fusion`) the linear layers' backward accumulates grad_out^T x into the weight's
main gradient inside the matmul (addmm into main_grad; on CUDA with 16-bit weights a GEMM with fp32 output
accumulating into it, where torch has one) and gives autograd None for the weight: no `.grad`, no separate add.

Arrival. The GradBuffer still learns from autograd when a parameter's gradient of a backward pass is complete, so
the bucket overlap is unchanged: the engine runs a parameter's AccumulateGrad node after every use of it in the
pass has delivered its gradient, and the node's post-accumulate hook fires with `.grad` None when all of them were
fused (a weight used twice, fused once and natively once, is complete only when both are in). Buckets start when
the same hooks fire as without fusion, in the same order on every replica. The hook runs on an undefined
gradient in recent torch only: probed once (`hooks_see_fused_grads`); where it does not, fusion stays off.

Walks that do not run AccumulateGrad (torch.autograd.grad: zero-bubble's B and W, tpzoo.pipeline.weight_grad)
declare what they want with `grad_phase(phase, params)`: fused layers accumulate the declared parameters'
gradients into their buffers and the walker delivers them. An autograd.grad walk that declared nothing (a user's,
a test's) gets the gradients returned, as plain autograd would give them. Layers read the declaration in their
backward; native ops learn the same from the engine, which a Python Function cannot ask about leaf parameters
inside autograd.grad.

Where a gradient goes is the buffer's business (`fused_target`): the main gradient, or under ZeRO-2/3 the
bucket's staging buffer when the weight lies inside one bucket (one that crosses a bucket boundary is returned
to autograd, unfused). The fused layers: ColumnParallelLinear and RowParallelLinear (the LoRA adapters fed the
column layer's input included; in FP8, tpzoo.parallel.fp8, the weight-gradient GEMM writes fp32 and is added), the
sequence-parallel column matmul (tpzoo.parallel.column_linear) and the LM head's fused linear cross-entropy
(tpzoo.kernels.fused_linear_cross_entropy: its fp32 weight gradient, scaled, added). MoE experts and the router
stay unfused (native matmuls).
"""
from __future__ import annotations

import contextlib
import functools

import torch
import torch.nn.functional as F

_PHASE: str | None = None          # None: a whole backward; "input" (zero-bubble's B); "weight" (its W)
_REQUESTED: frozenset | None = None  # ids of the parameters an autograd.grad walk asks for (None: undeclared)

SKIP, FUSE, RETURN = "skip", "fuse", "return"


@contextlib.contextmanager
def grad_phase(phase: str | None, params=None):
    """Within the block, Python autograd nodes of tpzoo's linear layers compute only the input ("input") or only
    the weight ("weight") gradients; `params`: the parameters whose gradients the enclosed torch.autograd.grad
    walk asks for (fused ones go into their buffers, the caller delivers them: accumulate_grad(p, None)). A
    plain module global, not thread-local: CUDA's autograd runs backward on the engine's device threads."""
    global _PHASE, _REQUESTED
    if phase not in (None, "input", "weight"):
        raise ValueError(f"grad_phase must be None, 'input' or 'weight', got {phase!r}")
    previous = _PHASE, _REQUESTED
    _PHASE, _REQUESTED = phase, None if params is None else frozenset(map(id, params))
    try:
        yield
    finally:
        _PHASE, _REQUESTED = previous


def input_wanted(ctx, i: int = 0) -> bool:
    """Whether a backward computes the gradient of its (activation) input i."""
    return bool(ctx.needs_input_grad[i]) and _PHASE != "weight"


@functools.lru_cache(maxsize=None)
def hooks_see_fused_grads() -> bool:
    """Whether a post-accumulate-grad hook fires when autograd delivers no gradient tensor (the arrival signal
    fusion relies on; see the module docstring). Probed once per process, on the CPU."""
    fired = []

    class _NoGrad(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x.clone()

        @staticmethod
        def backward(ctx, g):
            return None

    with torch.inference_mode(False), torch.enable_grad():  # whatever mode the buffer is built in
        p = torch.zeros(1, device="cpu", requires_grad=True)
        p.register_post_accumulate_grad_hook(lambda t: fired.append(t.grad is None))
        _NoGrad.apply(p).sum().backward()
    return fired == [True]


def grad_buffer_of(param):
    """The GradBuffer `param`'s gradient goes to, or None. A parameter holds it by weak reference: the buffer holds
    its parameters, and a strong reference back would make a cycle, so a dropped model and optimizer would keep
    their memory (GPU memory included) until Python's cyclic GC happened to run."""
    ref = getattr(param, "_grad_buffer", None)
    return ref() if ref is not None else None


def _buffer(param):
    """The GradBuffer fusing `param`'s gradient, or None (no buffer, fusion off, a frozen parameter)."""
    buf = grad_buffer_of(param)
    return buf if buf is not None and buf.fuse and param.requires_grad else None


def fusable(*params) -> bool:
    """Whether a forward now should take the fused path for these parameters (any of them fused). Not inside a
    compiled block (tpzoo.train.compile): the fused Function's backward reads autograd's graph
    (ctx.next_functions), which Dynamo cannot trace; it would send the whole block back to eager and compile its
    pieces one shape at a time. There the native linear hands autograd a `.grad`, which the buffer's hook adds."""
    if torch.compiler.is_compiling():
        return False
    return torch.is_grad_enabled() and any(p is not None and _buffer(p) is not None for p in params)


def route(ctx, i: int, edge: int | None = None) -> str:
    """Where the gradient of input i (a parameter) of a linear Function's backward goes: SKIP (nobody asked for
    it), FUSE (accumulate into the buffer), RETURN (hand it to autograd). `edge`: the input's position among the
    Function's tensor inputs (autograd's edges skip the others), when it differs from i."""
    if not ctx.needs_input_grad[i] or _PHASE == "input":
        return SKIP
    node = ctx.next_functions[i if edge is None else edge][0]
    param = getattr(node, "variable", None)  # AccumulateGrad nodes hold their leaf
    if _REQUESTED is not None:
        return SKIP if param is None or id(param) not in _REQUESTED else FUSE if _buffer(param) else RETURN
    if param is None or _buffer(param) is None:
        return RETURN
    try:
        runs = torch._C._will_engine_execute_node(node)
    except RuntimeError:  # an undeclared autograd.grad walk: give it the gradient it asked for
        return RETURN
    return FUSE if runs else SKIP


def target(ctx, edge: int) -> torch.Tensor | None:
    """The fp32 tensor the gradient of the parameter on autograd edge `edge` accumulates into (after route() said
    FUSE), or None where the buffer has no single place for it now (a weight across ZeRO-2 buckets: hand it
    to autograd)."""
    param = ctx.next_functions[edge][0].variable
    return grad_buffer_of(param).fused_target(param)


_DTYPE_ADDMM: dict = {}  # (device type, dtype) -> which fp32-accumulating GEMM torch runs there


def accumulate_product(out: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
    """out += a @ b, out fp32. Same dtype: one addmm (the product is added into out inside the GEMM). 16-bit a, b
    on CUDA: a GEMM with fp32 output accumulating into out (torch's addmm out_dtype) where torch has it, else the
    product in fp32 then added, else in the 16-bit dtype (what autograd would have produced) then added."""
    if a.dtype == out.dtype:
        out.addmm_(a, b)
        return
    key = (a.device.type, a.dtype)
    way = _DTYPE_ADDMM.get(key, "addmm" if a.is_cuda else "plain")
    if way == "addmm":
        try:
            torch.addmm(out, a, b, out_dtype=torch.float32, out=out)
            _DTYPE_ADDMM[key] = way
            return
        except (RuntimeError, TypeError):
            way = "mm"
    if way == "mm":
        try:
            out.add_(torch.mm(a, b, out_dtype=torch.float32))
            _DTYPE_ADDMM[key] = way
            return
        except (RuntimeError, TypeError):
            way = "plain"
    _DTYPE_ADDMM[key] = way
    out.add_(torch.mm(a, b))


def weight_grad(ctx, edge: int, g2: torch.Tensor, x2: torch.Tensor, way: str, fp8_gemm=None) -> torch.Tensor | None:
    """The gradient g2^T x2 of the weight ([out, in]; g2 [tokens, out], x2 [tokens, in]) on autograd edge `edge`
    as route() `way` says: accumulated into its buffer (None returned), returned, or not computed. `fp8_gemm`:
    the layer's FP8 weight-gradient GEMM (tpzoo.parallel.fp8), called with the output dtype (None: g2's): fused,
    its fp32 product is added into the main gradient."""
    if way == FUSE:
        out = target(ctx, edge)
        if out is not None:
            if fp8_gemm is None:
                accumulate_product(out, g2.t(), x2)
            else:
                out.add_(fp8_gemm(out.dtype))
            return None
    if way == SKIP:
        return None
    return g2.t().mm(x2) if fp8_gemm is None else fp8_gemm(None)


def bias_grad(ctx, edge: int, g2: torch.Tensor, way: str) -> torch.Tensor | None:
    """The gradient of the bias on autograd edge `edge` (the column sums of g2), like weight_grad."""
    if way == FUSE:
        out = target(ctx, edge)
        if out is not None:
            out.add_(g2.sum(0, dtype=out.dtype))
            return None
    return None if way == SKIP else g2.sum(0)


def rows(t: torch.Tensor) -> torch.Tensor:
    """t as [tokens, features]."""
    return t.reshape(-1, t.shape[-1])


class _FusedLinear(torch.autograd.Function):
    """y = x W^T + b, the weight (and bias) gradients accumulated into their main gradients (module docstring)."""

    @staticmethod
    def forward(ctx, x, weight, bias):
        ctx.save_for_backward(x, weight)
        return F.linear(x, weight, bias)

    @staticmethod
    def backward(ctx, grad_y):
        x, weight = ctx.saved_tensors
        g2 = rows(grad_y)
        grad_x = g2.mm(weight).view(*grad_y.shape[:-1], weight.shape[1]) if input_wanted(ctx) else None
        grad_w = weight_grad(ctx, 1, g2, rows(x), route(ctx, 1))
        grad_b = bias_grad(ctx, 2, g2, route(ctx, 2))
        return grad_x, grad_w, grad_b


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear, with the weight and bias gradients fused into their main gradients where that applies."""
    if fusable(weight, bias):
        return _FusedLinear.apply(x, weight, bias)
    return F.linear(x, weight, bias)
