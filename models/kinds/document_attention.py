"""Document masking: attention over packed sequences that never crosses a document boundary (the documents
themselves, `Documents`, are models/documents.py's data type).

Attention sinks (gpt-oss, `sinks` [heads]) join every row's softmax in both: the exact path through
models/sinks.py's sink_attention with the document mask, flex through its log-sum-exp (out * sigmoid(lse - sink),
differentiable on CUDA).

Two implementations of the masked attention, same semantics (tests/test_documents.py checks them against each
other and against per-document attention):
  exact  a block-diagonal causal mask into SDPA (additive, in the activations' dtype, built once per forward:
         every layer saves the same tensor), or into the soft-capped attention of Gemma 2. CPU, and CUDA under
         the kernels backend "torch" (TPZOO_KERNELS=torch).
  flex   FlexAttention (compiled) with a document BlockMask: blocks of 128 x 128 tokens whose documents do not
         meet are skipped, so a row of short documents costs less than one causal row; the sliding window is part
         of the mask, soft-capping a score_mod, grouped-query heads native, the [b, heads, s, d] layout kept (no
         unpadding to a varlen layout, no device-to-host sync for the longest document). CUDA by default.
         (torch's flash varlen op would need the flattened layout and a max length on the host, cuDNN's ragged
         layout the same, and neither takes a soft-cap: docs/design.md.) FlexAttention has no backward on CPU:
         there its forward is tested against the exact path.

FlexAttention compiles a Triton kernel per head dim and dtype, and some do not fit every GPU (its backward at
head dim > 128 needs more shared memory than an RTX 4090 / L40S / sm_12x board has: pytorch/pytorch#198224).
SFT packing is on by default, so such a failure would stop every fine-tune of a Gemma (head dim 256) there. The
first call of each kind (device, dtype, heads, head dim, window, soft-cap, grad mode) therefore runs the flex
path once on stand-in inputs of the call's shapes (forward, and backward under grad mode: the compiled graphs are
the ones the real calls reuse); if that raises, the kind takes the exact path from then on, with one warning.
"""
from __future__ import annotations

import warnings

import torch
import torch.nn.functional as F

from tpzoo import kernels
from tpzoo.errors import brief

from ..documents import Documents
from ..sinks import sink_attention
from .attention_extras import softcapped_attention

_FLEX: dict = {}  # lazily: compiled (CUDA) -> flex_attention, compiled or eager
_FLEX_WORKS: dict = {}  # a call's kind (see _flex_works) -> whether the flex path ran for it


def flex_available(q: torch.Tensor) -> bool:
    """The fused path applies: a CUDA tensor, the kernels backend not forced to "torch", FlexAttention present."""
    if q.device.type != "cuda":
        return False
    if kernels.get_backend() == "torch":
        return False
    try:
        import torch.nn.attention.flex_attention  # noqa: F401
    except ImportError:
        return False
    return True


def document_attention(q, k, v, docs: Documents, *, scale: float | None = None, window: int | None = None,
                       softcap: float | None = None, impl: str | None = None,
                       sinks: torch.Tensor | None = None) -> torch.Tensor:
    """Causal attention within documents: q [b, heads, S, d], k/v [b, kv_heads, S, d] (natural order) ->
    [b, heads, S, d]. impl: "exact", "flex" or None (flex where flex_available, else exact). sinks [heads]:
    attention sinks (module docstring)."""
    if q.shape[2] != docs.ids.shape[1] or q.shape[0] != docs.ids.shape[0]:
        raise ValueError(f"doc_ids {tuple(docs.ids.shape)} do not cover the attention's [batch, seq] "
                         f"({q.shape[0]}, {q.shape[2]})")
    gqa = q.shape[1] != k.shape[1]
    if sinks is not None and softcap is not None:
        raise ValueError("document attention: attention sinks with soft-capped scores are not supported")
    if impl is None:
        impl = ("flex" if flex_available(q) and _flex_works(q, k, v, docs, scale, window, softcap, gqa, sinks)
                else "exact")
    if impl == "flex":
        return _flex_attention(q, k, v, docs, scale, window, softcap, gqa, sinks)
    if impl != "exact":
        raise ValueError(f"document attention impl must be 'exact' or 'flex', got {impl!r}")
    if sinks is not None:
        return sink_attention(q, k, v, sinks, scale=scale, mask=docs.visible(window))
    if softcap is not None:
        return softcapped_attention(q, k, v, docs.visible(window), scale, softcap)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=docs.additive(window, q.dtype), enable_gqa=gqa,
                                          scale=scale)


def _flex_works(q, k, v, docs: Documents, scale, window, softcap, gqa: bool, sinks=None) -> bool:
    """Whether the flex path runs for calls of this kind: tried once on stand-ins of the call's shapes (module
    docstring), the outcome remembered for the process."""
    grad = torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad)
    kind = (str(q.device), q.dtype, q.shape[1], k.shape[1], q.shape[-1], v.shape[-1], window, softcap, grad,
            sinks is not None)
    if kind not in _FLEX_WORKS:
        try:
            # identity hooks: activation checkpointing's (if this forward runs under it) must not see the trial
            with torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t), torch.set_grad_enabled(grad):
                trial = [torch.randn_like(t).requires_grad_(grad) for t in (q, k, v)]
                trial_sinks = None if sinks is None else torch.randn_like(sinks).requires_grad_(grad)
                out = _flex_attention(*trial, docs, scale, window, softcap, gqa, trial_sinks)
                if grad:
                    torch.autograd.grad(out.float().sum(), trial)
            _FLEX_WORKS[kind] = True
        except Exception as exc:  # noqa: BLE001 - any failure of the fused kernel: the exact path instead
            warnings.warn(f"tpzoo: FlexAttention cannot run document masking here ({q.dtype}, head dim "
                          f"{q.shape[-1]}, {'training' if grad else 'inference'}: {brief(exc)}); "
                          f"using the exact masked attention instead (an [S, S] mask per micro-batch)")
            _FLEX_WORKS[kind] = False
    return _FLEX_WORKS[kind]


def _flex_attention(q, k, v, docs: Documents, scale, window, softcap, gqa: bool, sinks=None) -> torch.Tensor:
    # Compiled on CUDA (eager FlexAttention is a slow reference); eager elsewhere (CPU: forward only, for tests).
    compiled = q.device.type == "cuda"
    if compiled not in _FLEX:
        from torch.nn.attention.flex_attention import flex_attention

        _FLEX[compiled] = torch.compile(flex_attention, dynamic=False) if compiled else flex_attention
    score_mod = None if softcap is None else _softcap_mod(softcap)
    mask = docs.block_mask(window, compiled)
    if sinks is None:
        return _FLEX[compiled](q, k, v, score_mod=score_mod, block_mask=mask, scale=scale, enable_gqa=gqa)
    from torch.nn.attention.flex_attention import AuxRequest

    # the sink as one more logit of each row: out * exp(lse) / (exp(lse) + exp(sink)) = out * sigmoid(lse - sink)
    out, aux = _FLEX[compiled](q, k, v, score_mod=score_mod, block_mask=mask, scale=scale, enable_gqa=gqa,
                               return_aux=AuxRequest(lse=True))
    keep = torch.sigmoid(aux.lse.float() - sinks.float().view(1, -1, 1))
    return (out.float() * keep.unsqueeze(-1)).to(out.dtype)


_SOFTCAP_MODS: dict = {}


def _softcap_mod(cap: float):
    """Gemma 2's cap * tanh(score / cap) on the scaled score, before the mask: one function object per cap, so
    the compiled kernel is reused rather than recompiled for a new closure every forward."""
    if cap not in _SOFTCAP_MODS:
        def score_mod(score, b, h, q_idx, kv_idx):
            return torch.tanh(score / cap) * cap
        _SOFTCAP_MODS[cap] = score_mod
    return _SOFTCAP_MODS[cap]
