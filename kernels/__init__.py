"""Fused kernels (installed as tpzoo.kernels): one dispatch seam that the models call.

Each function (defined in ops.py) runs a Triton kernel (forward and backward, as a torch.autograd.Function) for
CUDA tensors when Triton imports, and its plain torch reference (`tpzoo.kernels.reference`) otherwise. Force
either path with `use_backend("triton" | "torch" | "auto")` (also a context manager) or
TPZOO_KERNELS=auto|triton|torch; see `tpzoo.kernels.dispatch` and docs/kernels.md. Triton is imported lazily, on
the first call that needs it.
"""
if __name__ != "tpzoo.kernels":
    # Run as the top-level `kernels` (Python started in the checkout root): become tpzoo.kernels, or the
    # installed package of that name, instead of a second copy of this one (tpzoo/_toplevel.py).
    from tpzoo._toplevel import redirect

    redirect(__name__)
else:
    from . import dispatch, reference
    from .dispatch import BACKENDS, get_backend, triton_available, use_backend
    from .ops import (apply_rotary, bias_gelu, cross_entropy, fp8_cast, fp8_cast_rows, geglu, geglu_packed,
                      layer_norm, linear_cross_entropy, rms_norm, swiglu, swiglu_packed)
    from .gated_delta_fla import gated_delta_rule

__all__ = ["rms_norm", "layer_norm", "apply_rotary", "swiglu", "geglu", "swiglu_packed", "geglu_packed", "bias_gelu",
           "cross_entropy", "linear_cross_entropy", "fp8_cast", "fp8_cast_rows", "gated_delta_rule", "use_backend",
           "get_backend",
           "triton_available", "BACKENDS", "reference"]
