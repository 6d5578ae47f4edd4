"""Fused kernels with a torch reference each and one dispatch seam (installed as tpzoo.kernels)."""
