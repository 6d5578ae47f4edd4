"""The column-parallel matmul under sequence parallelism, at the activation memory of Korthikanti et al.

Forward: all-gather this rank's sequence shard x_local -> x (the whole sequence), y = x W^T + b. Autograd would
keep x, the whole sequence, for the weight gradient: s*b*h per column layer instead of s*b*h/tp. This Function
keeps only x_local and gathers it again in backward, as Megatron-Core does:

  start all-gather(x_local)              (async)
  grad_x = grad_y W                      overlaps the gather
  wait; start reduce-scatter(grad_x)     (async; each rank keeps the gradient of its own sequence shard)
  grad_W = grad_y^T x, grad_b            overlaps the reduce-scatter
  wait

Collectives per layer and micro-batch: forward 1 all-gather, backward 1 all-gather + 1 reduce-scatter (the
extra all-gather is the price of the memory; its bytes equal the forward's).

Zero-bubble's split backward (tpzoo.pipeline.weight_grad) runs this node twice: B asks only for grad_x, W only
for grad_W/grad_b. `grad_phase` tells the node which pass it is in, so B does no weight matmul and keeps nothing
but x_local for W, and W re-gathers x_local and computes nothing of the input gradient (no reduce-scatter).
Native ops learn the same from the autograd engine; a Python Function cannot ask it about leaf parameters.
The weight gradients are accumulated into the fp32 main gradients where gradient-accumulation fusion applies
(tpzoo.parallel.wgrad).

FP8 (`fp8`: the layer's tpzoo.parallel.fp8.Fp8Linear): the layer's own weight runs its three GEMMs in FP8 on the
gathered input (the gather itself stays in the activations' dtype); the extra weights (LoRA's A) do not. The
backward's scale agreement (an all-reduce over tp) is issued before the re-gather.
"""
from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F

from . import comm
from .eager import eager
from .mappings import gather_from_sequence
from .wgrad import SKIP, bias_grad, grad_phase, input_wanted, route, weight_grad
from .wgrad import rows as _flat

__all__ = ["gathered_linear", "grad_phase", "keep_gathered_inputs"]

_KEEP_GATHERED = False     # benchmarks only: the former behaviour (autograd keeps the gathered input)


@contextlib.contextmanager
def keep_gathered_inputs():
    """Benchmark switch: let autograd keep the gathered full-sequence input (no re-gather in backward), the
    behaviour before this module existed, to measure both side by side in one run."""
    global _KEEP_GATHERED
    previous, _KEEP_GATHERED = _KEEP_GATHERED, True
    try:
        yield
    finally:
        _KEEP_GATHERED = previous


class _GatheredLinear(torch.autograd.Function):
    """y_i = x W_i^T + b_i for one gathered x and several (W_i, b_i): a layer and its LoRA A share one gather."""

    @staticmethod
    def forward(ctx, x_local, dim, group, fp8, backward, *weights_and_biases):
        ctx.dim, ctx.group, ctx.fp8 = dim, group, fp8
        pairs = list(zip(weights_and_biases[::2], weights_and_biases[1::2]))
        ctx.has_bias = [b is not None for _, b in pairs]
        # autograd edge of each weight/bias (edges skip the non-tensor inputs: dim, group, absent biases)
        present = [t is not None for t in weights_and_biases]
        ctx.edges = [1 + sum(present[:j]) for j in range(len(present))]
        ctx.save_for_backward(x_local, *(w for w, _ in pairs))
        x = comm.all_gather(x_local, group, dim=dim)
        outs = [F.linear(x, w, b) for w, b in pairs[1 if fp8 else 0:]]
        if fp8 is not None:  # the layer's weight in FP8 (its extra weights, LoRA's A, are not)
            (w, b), x2 = pairs[0], _flat(x)
            y, ctx.fp8_saved = fp8.forward(x2, w, backward)
            y = y.view(*x.shape[:-1], w.shape[0])
            outs.insert(0, y + b if b is not None else y)
        return tuple(outs) if len(outs) > 1 else outs[0]

    @staticmethod
    def backward(ctx, *grad_ys):
        x_local, *weights = ctx.saved_tensors
        # where each weight's and bias's gradient goes (tpzoo.parallel.wgrad): inputs 5, 6, 7, ... are W_0, b_0, ...
        ways = [route(ctx, 5 + j, ctx.edges[j]) for j in range(2 * len(weights))]
        need_x = input_wanted(ctx)
        need_w = any(w != SKIP for w in ways)
        fp8 = ctx.fp8 if grad_ys[0] is not None and (need_x or ways[0] != SKIP) else None
        scales = (fp8.backward_scales(_flat(grad_ys[0]), weights[0], ctx.fp8_saved, need_x, ways[0] != SKIP)
                  if fp8 is not None else None)
        gathering = comm.all_gather_start(x_local, ctx.group, dim=ctx.dim) if need_w else None
        x = scattering = None
        if need_x:
            def dgrad(i, g, w):
                if i == 0 and fp8 is not None:
                    return fp8.input_grad(_flat(g), w, ctx.fp8_saved, scales).view(*g.shape[:-1], x_local.shape[-1])
                return g.matmul(w)

            grad_x_full = sum(dgrad(i, g, w) for i, (g, w) in enumerate(zip(grad_ys, weights)) if g is not None)
            # (overlaps the gather)
            if gathering is not None:
                x = gathering.wait()  # posted in the same order on every rank: the gather, then the scatter
            scattering = comm.reduce_scatter_start(grad_x_full, ctx.group, dim=ctx.dim)
        grads_wb = [None] * len(ways)
        if need_w:  # overlaps the reduce-scatter
            x = _flat(gathering.wait() if x is None else x)
            for i, g in enumerate(grad_ys):
                if g is None:
                    continue
                g = _flat(g)
                fp8_gemm = None
                if i == 0 and fp8 is not None:  # the layer's weight: its FP8 weight-gradient GEMM
                    fp8_gemm = lambda dtype, g=g, x=x: fp8.weight_grad(g, x, ctx.fp8_saved, scales, dtype)  # noqa: E731
                grads_wb[2 * i] = weight_grad(ctx, ctx.edges[2 * i], g, x, ways[2 * i], fp8_gemm)
                grads_wb[2 * i + 1] = bias_grad(ctx, ctx.edges[2 * i + 1], g, ways[2 * i + 1])
        grad_x = scattering.wait() if scattering is not None else None
        return (grad_x, None, None, None, None, *grads_wb)


@eager  # a collective inside (and FP8's Python state): a graph break under torch.compile
def gathered_linear(x_local: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, dim: int, group,
                    extra: tuple = (), fp8=None) -> torch.Tensor | tuple:
    """y = all_gather(x_local along `dim`) W^T + b; backward reduce-scatters the input gradient. Saves only
    x_local (see the module docstring). `group`: a real TP group of size > 1. `extra`: more (W, b) pairs fed
    the same gathered input (a LoRA A); then the outputs come as a tuple, in order. `fp8`: the layer's
    Fp8Linear (W's GEMMs in FP8), or None."""
    pairs = ((weight, bias), *extra)
    if _KEEP_GATHERED:
        from .fp8 import linear

        x = gather_from_sequence(x_local, dim, group)
        outs = (linear(x, weight, bias, fp8), *(F.linear(x, w, b) for w, b in extra))
        return outs if extra else outs[0]
    backward = fp8 is not None and torch.is_grad_enabled() and (
        x_local.requires_grad or any(t is not None and t.requires_grad for pair in pairs for t in pair))
    return _GatheredLinear.apply(x_local, dim, group, fp8, backward, *(t for pair in pairs for t in pair))
