"""The functions tpzoo.kernels exports: each runs its Triton kernel when the dispatch seam says so (dispatch.py;
under `auto` on CUDA by measurement, autotune.py), its torch reference (reference.py) otherwise."""
from __future__ import annotations

import torch

from tpzoo.parallel.cross_entropy import check_loss_args

from . import autotune, dispatch, launch, reference

_FLOATS = (torch.float32, torch.float16, torch.bfloat16)


def _run(kernel: str, module: str, args: tuple, ok: bool, triton_fn, torch_fn, cut=(0,)):
    """triton_fn(module, *args) or torch_fn(*args), as the dispatch seam decides for `kernel` on these tensor
    arguments (None allowed). `cut`: the positions of the row-shaped arguments a measurement trial may shorten."""
    ts = [t for t in args if t is not None]
    if ok and all(t.dtype in _FLOATS and t.numel() for t in ts):
        def trial():  # the two implementations on stand-in inputs of this call's shapes (autotune.decide)
            inputs = autotune.trial_inputs(list(args), cut)
            return (autotune.fwd_bwd(lambda *a: triton_fn(dispatch.load(module, *ts), *a), inputs),
                    autotune.fwd_bwd(torch_fn, inputs))

        if dispatch.use_triton(*ts, kernel=kernel, trial=trial):
            return triton_fn(dispatch.load(module, *ts), *args)
    return torch_fn(*args)


def _untimed(kernel: str, module: str, tensors: tuple, ok: bool):
    """The Triton module for a call of `kernel` that `auto` does not time (the cross-entropies: a trial would run
    their TP collectives), or None for torch: under `auto`, Triton for CUDA tensors."""
    ts = [t for t in tensors if t is not None]
    if ok and all(t.dtype in _FLOATS and t.numel() for t in ts) and dispatch.use_triton(*ts, kernel=kernel):
        return dispatch.load(module, *ts)
    return None


def _is_vector(t: torch.Tensor | None, n: int) -> bool:
    return t is None or tuple(t.shape) == (n,)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x / sqrt(mean(x^2) + eps) * weight over the last dim; fp32 statistics; the result's dtype is that of
    `weight * x` (x's dtype when they match)."""
    return _run("rms_norm", "rms", (x, weight), _is_vector(weight, x.shape[-1]),
                lambda k, x, w: k.rms_norm(x, w, eps), lambda x, w: reference.rms_norm(x, w, eps))


def layer_norm(x: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None, eps: float) -> torch.Tensor:
    """F.layer_norm over the last dim (fp32 statistics, result in x's dtype)."""
    n = x.shape[-1]
    return _run("layer_norm", "norms", (x, weight, bias), _is_vector(weight, n) and _is_vector(bias, n),
                lambda k, x, w, b: k.layer_norm(x, w, b, eps), lambda x, w, b: reference.layer_norm(x, w, b, eps))


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
    # trials keep the whole batch: a per-sequence cos/sin must match it
    return _run("apply_rotary", "rotary", (x, cos, sin), ok, lambda k, x, c, s: k.apply_rotary(x, c, s),
                reference.apply_rotary, cut=())


def swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up; the backward recomputes silu from the saved inputs."""
    return _run("swiglu", "activations", (gate, up), gate.shape == up.shape and gate.dtype == up.dtype,
                lambda k, g, u: k.swiglu(g, u), reference.swiglu, cut=(0, 1))


def geglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """gelu_tanh(gate) * up (Gemma's GeGLU); the backward recomputes the GeLU from the saved inputs."""
    return _run("geglu", "activations", (gate, up), gate.shape == up.shape and gate.dtype == up.dtype,
                lambda k, g, u: k.geglu(g, u), reference.geglu, cut=(0, 1))


def swiglu_packed(h: torch.Tensor) -> torch.Tensor:
    """swiglu(*h.chunk(2, -1)) for h = gate|up (one column-parallel output): the gradient comes back as one
    tensor like h, so autograd needs no split's backward (a cat of the two halves' gradients)."""
    return _run("swiglu", "activations", (h,), h.shape[-1] % 2 == 0, lambda k, h: k.swiglu_packed(h),
                lambda h: reference.swiglu(*h.chunk(2, dim=-1)))


def geglu_packed(h: torch.Tensor) -> torch.Tensor:
    """geglu(*h.chunk(2, -1)) for h = gate|up, the gradient as one tensor (swiglu_packed)."""
    return _run("geglu", "activations", (h,), h.shape[-1] % 2 == 0, lambda k, h: k.geglu_packed(h),
                lambda h: reference.geglu(*h.chunk(2, dim=-1)))


def bias_gelu(x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """gelu(x + bias), tanh approximation (GPT-2's "gelu_new"); the backward recomputes from the inputs."""
    ok = _is_vector(bias, x.shape[-1]) and (bias is None or bias.dtype == x.dtype)
    return _run("bias_gelu", "activations", (x, bias), ok, lambda k, x, b: k.bias_gelu(x, b), reference.bias_gelu)


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
    Not measured under `auto` (a trial would run the TP collectives): Triton on CUDA.
    """
    check_loss_args(logits_shard.shape[:-1], target.shape, label_smoothing, z_loss)
    k = _untimed("cross_entropy", "vocab_cross_entropy", (logits_shard,), target.dtype in (torch.int64, torch.int32))
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
    cross-entropy kernels when the dispatch seam picks Triton for `cross_entropy` (its setting covers both; not
    timed under `auto`), in torch otherwise."""
    from .fused_linear_cross_entropy import linear_cross_entropy as fused

    k = _untimed("cross_entropy", "vocab_cross_entropy", (hidden, weight),
                 target.dtype in (torch.int64, torch.int32) and hidden.dtype == weight.dtype)
    return fused(hidden, weight, target, ignore_index=ignore_index, label_smoothing=label_smoothing, z_loss=z_loss,
                 softcap=softcap, vocab_size=vocab_size, group=group, sequence_dim=sequence_dim,
                 chunk_rows=chunk_rows, kernels=k)


def fp8_cast(x: torch.Tensor, amax: torch.Tensor, dtype: torch.dtype, mode: str, pow2: bool = False,
             want_q: bool = True, want_t: bool = False, pad: int = 1) -> tuple:
    """x [M, N] cast to fp8 `dtype` with the scale fp8_max / amax (amax: [] for mode "tensor", [M, 1] "rows",
    [1, N] "cols"; pow2: rounded down to a power of two): (q [M, N] or None, its transpose [N, M rounded up to
    `pad`, zero-padded] or None, the dequantization scale 1/s shaped like amax), from one read of x
    (tpzoo.kernels.float8; reference.fp8_cast is the definition). Not timed under `auto`: Triton on CUDA."""
    k = _untimed("fp8_cast", "float8", (x, amax), x.dim() == 2)
    if k:
        return k.cast(x, amax, dtype, mode, pow2, want_q, want_t, pad)
    with launch.as_one_launch("tpzoo::fp8_cast"):
        return reference.fp8_cast(x, amax, dtype, mode, pow2, want_q, want_t, pad)


def fp8_cast_rows(x: torch.Tensor, dtype: torch.dtype, pow2: bool = False) -> tuple:
    """(q, 1/s [M, 1]) for x [M, N] with one scale per row from the row's own amax, amax and cast in one launch
    (the rows' dim is not split across ranks, so no agreement is needed)."""
    k = _untimed("fp8_cast", "float8", (x,), x.dim() == 2)
    if k:
        return k.cast_rows(x, dtype, pow2)
    with launch.as_one_launch("tpzoo::fp8_cast_rows"):
        return reference.fp8_cast_rows(x, dtype, pow2)
