"""Hugging Face names of an "mlp" layer (models/kinds/mlp.py) and of any gated MLP inside another kind (the shared
experts of models/kinds/moe.py).

tpzoo's tensors (full; `ours` e.g. "layers.3.mlp"): fc_in.weight [2 ffn, hidden] gate | up (a gated activation) or
[ffn, hidden], fc_in.bias, fc_out.weight [hidden, ffn], fc_out.bias.
Layouts (`theirs` is the HF layer, e.g. "model.layers.3."):
    "separate"  (the default) mlp.gate_proj | mlp.up_proj concatenated, mlp.down_proj (+ their biases)
    "fused"     (Phi-3) mlp.gate_up_proj already gate|up, mlp.down_proj
    "conv1d"    (GPT-2) mlp.c_fc / mlp.c_proj, Conv1D weights stored [in, out], with biases
"""
from __future__ import annotations

from ..config import ModelConfig
from ..hf_mapping import concatenated, same, transposed

STYLES = ("separate", "fused", "conv1d")


def gated_mlp_maps(ours: str, theirs: str, ffn: int, bias: bool = False, layer: int | None = None) -> list:
    """A gated MLP: `theirs`.gate_proj | up_proj fused into `ours`.fc_in, down_proj as fc_out."""
    kw = {"layer": layer}
    parts = tuple(f"{theirs}.{n}_proj" for n in ("gate", "up"))
    maps = [concatenated(f"{ours}.fc_in.weight", tuple(n + ".weight" for n in parts), (ffn, ffn), **kw),
            same(f"{ours}.fc_out.weight", f"{theirs}.down_proj.weight", **kw)]
    if bias:
        maps += [concatenated(f"{ours}.fc_in.bias", tuple(n + ".bias" for n in parts), (ffn, ffn), **kw),
                 same(f"{ours}.fc_out.bias", f"{theirs}.down_proj.bias", **kw)]
    return maps


def hf_tensor_maps(cfg: ModelConfig, layer: int, ours: str, theirs: str, style: str | None = None) -> list:
    """The TensorMaps of layer `layer`'s MLP: tpzoo names under `ours`, HF names in the HF layer `theirs`."""
    style, m, kw = style or "separate", cfg.mlp, {"layer": layer}
    q = theirs + "mlp."
    if style == "separate":
        return gated_mlp_maps(ours, q[:-1], m.ffn_hidden_size, m.bias, layer)
    if style == "fused":
        return [same(f"{ours}.fc_in.weight", q + "gate_up_proj.weight", **kw),  # gate|up, as tpzoo's
                same(f"{ours}.fc_out.weight", q + "down_proj.weight", **kw)]
    if style == "conv1d":
        return [transposed(f"{ours}.fc_in.weight", q + "c_fc.weight", **kw),
                same(f"{ours}.fc_in.bias", q + "c_fc.bias", **kw),
                transposed(f"{ours}.fc_out.weight", q + "c_proj.weight", **kw),
                same(f"{ours}.fc_out.bias", q + "c_proj.bias", **kw)]
    raise ValueError(f"unknown MLP HF layout {style!r}; one of {STYLES}")
