"""The functions tpzoo.kernels exports: each runs its Triton kernel when the dispatch seam says so (dispatch.py),
its torch reference (reference.py) otherwise."""
from __future__ import annotations

import torch

from tpzoo.parallel.cross_entropy import check_loss_args

from . import dispatch, reference

_FLOATS = (torch.float32, torch.float16, torch.bfloat16)


def _triton(module: str, *tensors: torch.Tensor | None, ok: bool = True):
    """The Triton module to use for this call, or None for the torch reference."""
    ts = [t for t in tensors if t is not None]
    if not ok or any(t.dtype not in _FLOATS or t.numel() == 0 for t in ts) or not dispatch.use_triton(*ts):
        return None
    return dispatch.load(module, *ts)


def _is_vector(t: torch.Tensor | None, n: int) -> bool:
    return t is None or tuple(t.shape) == (n,)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x / sqrt(mean(x^2) + eps) * weight over the last dim; fp32 statistics; the result's dtype is that of
    `weight * x` (x's dtype when they match)."""
    k = _triton("norms", x, weight, ok=_is_vector(weight, x.shape[-1]))
    return k.rms_norm(x, weight, eps) if k else reference.rms_norm(x, weight, eps)


def layer_norm(x: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None, eps: float) -> torch.Tensor:
    """F.layer_norm over the last dim (fp32 statistics, result in x's dtype)."""
    n = x.shape[-1]
    k = _triton("norms", x, weight, bias, ok=_is_vector(weight, n) and _is_vector(bias, n))
    return k.layer_norm(x, weight, bias, eps) if k else reference.layer_norm(x, weight, bias, eps)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate `x` [b, s, heads, head_dim] by position (half-split "rotate_half" convention, as in HF Llama).

    cos, sin: [s, head_dim // 2] or [b, s, head_dim // 2] (fp32), for the positions of x's tokens (so KV-cache
    offsets and scaled frequencies are the caller's). cos/sin get no gradient on the Triton path; a cos/sin
    that requires grad takes the reference.
    """
    ok = (x.dim() == 4 and x.shape[-1] % 2 == 0 and cos.shape == sin.shape and cos.dim() in (2, 3)
          and cos.shape[-1] == x.shape[-1] // 2 and cos.shape[-2] == x.shape[1]
          and (cos.dim() == 2 or cos.shape[0] in (1, x.shape[0]))
          and not (torch.is_grad_enabled() and (cos.requires_grad or sin.requires_grad)))
    k = _triton("rotary", x, cos, sin, ok=ok)
    return k.apply_rotary(x, cos, sin) if k else reference.apply_rotary(x, cos, sin)


def swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up; the backward recomputes silu from the saved inputs."""
    k = _triton("activations", gate, up, ok=gate.shape == up.shape and gate.dtype == up.dtype)
    return k.swiglu(gate, up) if k else reference.swiglu(gate, up)


def geglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """gelu_tanh(gate) * up (Gemma's GeGLU); the backward recomputes the GeLU from the saved inputs."""
    k = _triton("activations", gate, up, ok=gate.shape == up.shape and gate.dtype == up.dtype)
    return k.geglu(gate, up) if k else reference.geglu(gate, up)


def bias_gelu(x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """gelu(x + bias), tanh approximation (GPT-2's "gelu_new"); the backward recomputes from the inputs."""
    ok = _is_vector(bias, x.shape[-1]) and (bias is None or bias.dtype == x.dtype)
    k = _triton("activations", x, bias, ok=ok)
    return k.bias_gelu(x, bias) if k else reference.bias_gelu(x, bias)


def cross_entropy(logits_shard: torch.Tensor, target: torch.Tensor, ignore_index: int = -100,
                  label_smoothing: float = 0.0, vocab_size: int | None = None, group=None,
                  inplace_backward: bool = False, z_loss: float = 0.0) -> torch.Tensor:
    """Per-token loss (target's shape, 0 where ignored) over tensor-parallel vocab shards: the semantics of
    tpzoo.parallel.vocab_parallel_cross_entropy (same two all-reduces over the TP group, padded entries past
    `vocab_size` excluded, label smoothing over the real full vocabulary, z_loss * logZ^2 added per trained
    token when z_loss > 0).

    Triton path: one streaming pass over the logits in the forward (saving only the logits reference and one
    fp32 per row), one in the backward writing the gradient in the logits' dtype; with
    `inplace_backward=True` the gradient is written into the logits buffer itself (no new logits-sized
    allocation; the logits must not be needed afterwards, and autograd's version counter enforces it).
    """
    check_loss_args(logits_shard.shape[:-1], target.shape, label_smoothing, z_loss)
    k = _triton("vocab_cross_entropy", logits_shard, ok=target.dtype in (torch.int64, torch.int32))
    if k:
        return k.cross_entropy(logits_shard, target, ignore_index, label_smoothing, vocab_size, group,
                               inplace_backward, z_loss)
    return reference.cross_entropy(logits_shard, target, ignore_index, label_smoothing, vocab_size, group, z_loss)


def linear_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, target: torch.Tensor, *,
                         ignore_index: int = -100, label_smoothing: float = 0.0, z_loss: float = 0.0,
                         softcap: float | None = None, vocab_size: int | None = None, group=None,
                         sequence_dim: int | None = None, chunk_rows: int | None = None) -> torch.Tensor:
    """Per-token loss of `cross_entropy(softcap(hidden @ weight.T), target)` with the head's matmul and the loss
    computed together in chunks of tokens, so the logits of all tokens never exist (forward or backward); see
    tpzoo.kernels.fused_linear_cross_entropy for how and why. `weight` is this rank's vocab shard [V'/tp, h];
    `sequence_dim`: under sequence parallelism, the dim of `hidden` that holds this rank's sequence shard (it is
    all-gathered; `target` is the whole sequence's); `chunk_rows`: tokens per chunk (default: chosen from the
    hidden size, see default_chunk_rows()). The per-chunk softmax statistics and gradient run in the Triton
    cross-entropy kernels when the dispatch seam picks Triton, in torch otherwise."""
    from .fused_linear_cross_entropy import linear_cross_entropy as fused

    k = _triton("vocab_cross_entropy", hidden, weight,
                ok=target.dtype in (torch.int64, torch.int32) and hidden.dtype == weight.dtype)
    return fused(hidden, weight, target, ignore_index=ignore_index, label_smoothing=label_smoothing, z_loss=z_loss,
                 softcap=softcap, vocab_size=vocab_size, group=group, sequence_dim=sequence_dim,
                 chunk_rows=chunk_rows, kernels=k)
