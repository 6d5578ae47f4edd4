"""Plain torch references of every kernel: the definition of what each computes, the path taken off-GPU, and
the oracle the Triton kernels are tested against (with autograd of these very expressions)."""
from __future__ import annotations

import torch
import torch.nn.functional as F


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x / sqrt(mean(x^2) + eps) * weight, statistics in fp32, result in x's dtype."""
    xf = x.float()
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * y.to(x.dtype)


def layer_norm(x: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None, eps: float) -> torch.Tensor:
    return F.layer_norm(x, (x.shape[-1],), weight, bias, eps)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate `x` [b, s, heads, head_dim] by position (half-split "rotate_half" convention, as in HF Llama).

    cos, sin: [s, head_dim // 2] or [b, s, head_dim // 2] (fp32), for the positions of x's tokens.
    """
    half = x.shape[-1] // 2
    c, s = cos.unsqueeze(-2), sin.unsqueeze(-2)  # broadcast over heads
    x1, x2 = x[..., :half].float(), x[..., half:].float()
    return torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], dim=-1).to(x.dtype)


def swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return F.silu(gate) * up


def geglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """gelu_tanh(gate) * up (Gemma's GeGLU, HF "gelu_pytorch_tanh")."""
    return F.gelu(gate, approximate="tanh") * up


def bias_gelu(x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """gelu(x + bias), tanh approximation (GPT-2's "gelu_new")."""
    return F.gelu(x + bias if bias is not None else x, approximate="tanh")


def cross_entropy(logits_shard: torch.Tensor, target: torch.Tensor, ignore_index: int = -100,
                  label_smoothing: float = 0.0, vocab_size: int | None = None, group=None,
                  z_loss: float = 0.0) -> torch.Tensor:
    """Per-token loss over tensor-parallel vocab shards (see tpzoo.parallel.vocab_parallel_cross_entropy)."""
    from tpzoo.parallel import vocab_parallel_cross_entropy

    return vocab_parallel_cross_entropy(logits_shard, target, ignore_index, label_smoothing, vocab_size, group,
                                        z_loss)
