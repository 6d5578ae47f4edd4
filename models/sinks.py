"""Attention with learned per-head sinks (gpt-oss): one extra logit per head joins every query row's softmax and
carries no value, so a row may attend "nowhere". Equivalently: out = softmax-attention * sigmoid(lse - sink).

    sink_attention(q [b, h, sq, d], k, v [b, kv_heads, sk, d(v)], sinks [h], scale=, window=, past=, mask=)
        -> [b, h, sq, dv]

The exact local core of the sink variant (CPU, and CUDA under TPZOO_KERNELS=torch): one block of ring attention's
kernels (tpzoo.parallel.ring_attention: a fused kernel returning the log-sum-exp for causal blocks, the torch math
with an explicit mask for windows, documents and decoding), the sink merged into the log-sum-exp, and a backward
that hands the block kernel the merged output and log-sum-exp (so q, k, v get the gradients of the softmax that
includes the sink) plus the sink's own gradient. Ring attention (cp, `sinks=`) and FlexAttention
(models/kinds/document_attention.py) take the same sinks; Ulysses attends locally over heads `ulysses.local_heads`
of them.

TP split: the sinks are split by head with the query heads (each rank passes its heads' sinks; their gradients
are then whole, nothing crosses tp ranks). Under cp they are replicated and their gradient is partial per rank
(its query rows): summed with the other replicated weights over dp x cp. No cache: decoding passes the cached
keys and `past`.
"""
from __future__ import annotations

import torch

from tpzoo.parallel.attention_kernels import choose_kernel
from tpzoo.parallel.ring_attention import (_expand, _fold, block_backward, block_forward, merge_sinks, sink_grad)


class _SinkAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, sinks, scale, causal, mask, kernel):
        groups = q.shape[1] // k.shape[1]
        out, lse, state = block_forward(q, _expand(k, groups), _expand(v, groups), scale, causal, mask, kernel)
        lse = merge_sinks(out, lse, sinks)
        result = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, result, lse, sinks)
        ctx.scale, ctx.causal, ctx.mask, ctx.kernel, ctx.state = scale, causal, mask, kernel, state
        return result

    @staticmethod
    def backward(ctx, d_out):
        q, k, v, out, lse, sinks = ctx.saved_tensors
        groups = q.shape[1] // k.shape[1]
        delta = (d_out.to(lse.dtype) * out.to(lse.dtype)).sum(-1) if ctx.kernel == "torch" else None
        dq, dk, dv = block_backward(d_out, q, _expand(k, groups), _expand(v, groups), out, lse, delta, ctx.scale,
                                    ctx.causal, ctx.mask, ctx.kernel, ctx.state)
        d_sinks = sink_grad(d_out, out, lse, sinks) if ctx.needs_input_grad[3] else None
        return (dq.to(q.dtype), _fold(dk, groups).to(k.dtype), _fold(dv, groups).to(v.dtype), d_sinks,
                None, None, None, None)


def sink_attention(q, k, v, sinks, *, scale: float | None = None, window: int | None = None, past: int = 0,
                   mask: torch.Tensor | None = None, fused: bool | str | None = None) -> torch.Tensor:
    """Causal attention with sinks; query i sits at position past + i, keys at 0..sk-1; `window` a sliding window;
    `mask` (boolean, broadcast to [b, h, sq, sk]: True = visible) replaces the causal/window mask (documents).
    fused: as ring_attention's (None: the fastest block kernel for an unmasked causal block)."""
    if tuple(sinks.shape) != (q.shape[1],):
        raise ValueError(f"attention sinks {tuple(sinks.shape)} are not one per query head ({q.shape[1]})")
    if q.shape[1] % k.shape[1]:
        raise ValueError(f"{q.shape[1]} query heads are not a multiple of {k.shape[1]} kv heads")
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    sq, sk = q.shape[2], k.shape[2]
    plain = mask is None and past == 0 and sq == sk and (window is None or sk <= window)
    kernel = choose_kernel(q, fused) if plain and v.shape[-1] <= q.shape[-1] else "torch"
    if mask is None and not plain:
        qpos = torch.arange(past, past + sq, device=q.device).unsqueeze(-1)
        kpos = torch.arange(sk, device=q.device).unsqueeze(0)
        mask = kpos <= qpos
        if window is not None:
            mask &= qpos - kpos < window
    if kernel == "torch" and mask is None:  # the torch math masks explicitly
        mask = torch.ones(sq, sk, dtype=torch.bool, device=q.device).tril()
    return _SinkAttention.apply(q, k, v, sinks, scale, kernel != "torch", mask, kernel)
