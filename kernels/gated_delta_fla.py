"""`gated_delta_rule`: the gated delta rule through one dispatch seam, flash-linear-attention's Triton kernels
(`pip install tpzoo[fla]`, CUDA only) or the torch reference of kernels/gated_delta.py. Its two forms: a decay per
value head (Gated DeltaNet: fla.ops.gated_delta_rule, kernel name "gated_delta_rule") and a decay per key channel
(Kimi Delta Attention, g [b, s, value heads, d_k]: fla.ops.kda's chunk_kda / fused_recurrent_kda, kernel name
"kimi_delta_rule"); the same arguments, documents and states for both.

Which one runs (the form's kernel name for TPZOO_KERNELS / use_backend):
  torch   the reference, always.
  auto    CUDA tensors with `fla` importable: whichever measured faster for the call's shape class (autotune.decide,
          forward + backward on stand-ins, kept on disk like the other kernels); otherwise the reference.
  triton  fla on CUDA tensors (an error naming the extra when fla does not import); CPU tensors take the
          reference: fla's kernels do not run under Triton's interpreter (they autotune, which needs a GPU
          driver, and loop with tl.range indices the interpreter hands over as Python ints).
The forms: chunked (training, prefill) and, for single-token calls, the fused recurrent kernel / recurrent loop.

Documents become fla's varlen call: the rows flattened to one sequence of b*s tokens cut at every row and
document start (cu_seqlens), the initial state given to each row's first document (zeros to the others), the
final state read from each row's last document; fla's chunks never cross a sequence boundary, as the reference's
document layout. tests/test_gated_delta.py checks this call site on CPU against a stand-in `fla` module that
implements fla's documented semantics independently.
"""
from __future__ import annotations

import importlib

import torch

from . import autotune, dispatch
from . import gated_delta as ref

# per form (decay per channel?): the dispatch's kernel name, fla's module, its chunked and recurrent functions
FORMS = {False: ("gated_delta_rule", "fla.ops.gated_delta_rule", "chunk_gated_delta_rule",
                 "fused_recurrent_gated_delta_rule"),
         True: ("kimi_delta_rule", "fla.ops.kda", "chunk_kda", "fused_recurrent_kda")}
_fla: dict = {}  # module name -> the imported module, False when it does not import


def fla_module(name: str = FORMS[False][1]):
    """fla's module `name`, or None when flash-linear-attention is not installed (tried once)."""
    if name not in _fla:
        try:
            import fla.ops  # noqa: F401 - the optional dependency (the 'fla' extra); then its kernels' module by name
            _fla[name] = importlib.import_module(name)
        except Exception:  # noqa: BLE001 - ImportError, or an fla that does not match this Triton
            _fla[name] = False
    return _fla[name] or None


def forget_fla() -> None:
    """Import fla again on next use (tests that install or remove a stand-in)."""
    _fla.clear()


def _fla_device(t: torch.Tensor) -> bool:
    """fla's kernels can run on this tensor's device (CUDA; the CPU tests replace this)."""
    return t.is_cuda


def use_fla(v: torch.Tensor, trial, per_channel: bool = False) -> bool:
    """Whether this call takes fla (module docstring); `trial()` gives (run fla, run torch) closures to time."""
    kernel, module = FORMS[per_channel][:2]
    backend = dispatch.get_backend(kernel)
    if backend == "torch" or not _fla_device(v):
        return False
    if fla_module(module) is None:
        if backend == "triton":
            raise RuntimeError(f"kernel backend 'triton' was forced for {kernel} but flash-linear-attention "
                               "does not import; pip install 'tpzoo[fla]' or use the 'torch' backend")
        return False
    if backend == "triton":
        return True
    key = autotune.shape_class(kernel, v)
    if dispatch._not_measurable():
        return autotune.decided(key) != "torch"
    return autotune.decide(key, trial) == "triton"


def _fla_call(q, k, v, g, beta, scale, initial_state, output_final_state, qk_l2norm, starts, recurrent):
    """The fla call with the reference's arguments and results (module docstring: documents as varlen)."""
    _, module, chunked, one_by_one = FORMS[g.dim() == v.dim()]
    fn = getattr(fla_module(module), one_by_one if recurrent else chunked)
    kw = dict(scale=scale, output_final_state=output_final_state, use_qk_l2norm_in_kernel=qk_l2norm)
    if starts is None or not bool(starts.any()):
        return fn(q, k, v, g=g, beta=beta, initial_state=initial_state, **kw)
    b, s = starts.shape
    first = starts.clone()
    first[:, 0] = True
    flat = first.flatten()
    cu = torch.cat([flat.nonzero().flatten(), flat.new_tensor([b * s], dtype=torch.long)])
    row_first = torch.cat([first.new_zeros(1, dtype=torch.long), first.sum(1).cumsum(0)])  # [b + 1]
    n = cu.numel() - 1
    h0 = None
    if initial_state is not None:
        h0 = initial_state.new_zeros(n, *initial_state.shape[1:]).index_copy(0, row_first[:-1], initial_state)
    one = lambda t: t.reshape(1, b * s, *t.shape[2:])  # noqa: E731
    o, final = fn(one(q), one(k), one(v), g=one(g), beta=one(beta), initial_state=h0, cu_seqlens=cu, **kw)
    o = o.reshape(b, s, *o.shape[2:])
    return o, None if final is None else final.index_select(0, row_first[1:] - 1)


def gated_delta_rule(q, k, v, g, beta, *, scale: float | None = None, initial_state=None,
                     output_final_state: bool = False, qk_l2norm: bool = False, starts=None, recurrent=None,
                     chunk_size: int = ref.CHUNK):
    """The gated delta rule (kernels/gated_delta.py: shapes, documents), g per value head [b, s, h] or per key
    channel [b, s, h, d_k] (KDA); `recurrent` None: the recurrent form for one token, the chunked form otherwise.
    Returns (o [b, s, value heads, d_v], final state or None)."""
    recurrent = v.shape[1] == 1 if recurrent is None else recurrent
    scale = k.shape[-1] ** -0.5 if scale is None else scale
    args = (q, k, v, g, beta)

    def trial():
        # stand-ins in the rule's domain (decays <= 0, write strengths in (0, 1)); autotune times forward+backward
        sq, sk, sv = autotune.trial_inputs([q, k, v], cut=())
        sg = -torch.rand_like(g).requires_grad_(g.requires_grad)
        sb = torch.rand_like(beta).requires_grad_(beta.requires_grad)
        run = lambda f: autotune.fwd_bwd(lambda *a: f(*a)[0], [sq, sk, sv, sg, sb])  # noqa: E731
        return (run(lambda *a: _fla_call(*a, scale, None, False, qk_l2norm, None, recurrent)),
                run(lambda *a: _torch_call(*a, scale, None, False, qk_l2norm, None, recurrent, chunk_size)))

    if use_fla(v, trial, g.dim() == v.dim()):
        return _fla_call(*args, scale, initial_state, output_final_state, qk_l2norm, starts, recurrent)
    return _torch_call(*args, scale, initial_state, output_final_state, qk_l2norm, starts, recurrent, chunk_size)


def _torch_call(q, k, v, g, beta, scale, initial_state, output_final_state, qk_l2norm, starts, recurrent,
                chunk_size):
    kw = dict(scale=scale, initial_state=initial_state, output_final_state=output_final_state,
              qk_l2norm=qk_l2norm, starts=starts)
    if recurrent:
        return ref.recurrent_gated_delta_rule(q, k, v, g, beta, **kw)
    return ref.chunk_gated_delta_rule(q, k, v, g, beta, chunk_size=chunk_size, **kw)
