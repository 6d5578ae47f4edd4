"""Quantized weights out to Hugging Face (`tpzoo convert to-hf`, tpzoo/checkpoint/convert.py calls these).

A kept-quantized checkpoint exports its stored bytes as they are: each quantized weight and its scales under the
source's HF names (tpzoo.quant.maps), the int4 `weight_shape` tensors rebuilt, config.json the source's own with
its quantization_config: every tensor byte-identical to the source.

`--quantize fp8-block` on any other checkpoint writes DeepSeek's format: the weights of the linear layers of the
blocks (attention and MLP projections, the experts; not the embeddings, the head, the norms, the routers and the
shared-expert gates, nor any bias) become e4m3 values with a float32 scale_inv = block amax / 448 per 128 x 128
block of each HF tensor (a fused tpzoo tensor is quantized part by part, as HF stores it), and config.json gets
{"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [128, 128], "activation_scheme": "dynamic",
"modules_to_not_convert": [the 2-d linear weights left unquantized]}, which transformers' FineGrainedFP8 loader
reads. It is done by presenting the source as if it had been kept quantized (`QuantizingSource`), so both paths
share one writer. A stacked tensor (a layer's experts) is quantized whole, one at a time, as the unquantized
export assembles it.
"""
from __future__ import annotations

import torch

from .formats import Fp8Block, QuantError, format_of
from .maps import kept_maps


def quantizable(cfg) -> list[str]:
    """The tpzoo tensors `--quantize` quantizes (modules.quantizable_tensors), found on a meta build of the model."""
    from tpzoo.checkpoint.layout import build_chunk
    from tpzoo.parallel.dims import ParallelDims

    from .modules import quantizable_tensors

    stage = {"pp_rank": 0, "layers": [0, cfg.num_layers], "pre_process": True, "post_process": True}
    return quantizable_tensors(build_chunk(cfg, stage, ParallelDims.for_rank(tp=1)))


def _full_logical(source, name: str) -> tuple:
    shape = list(source.full_shape(name))
    fmt = format_of(source.cfg.quantization)
    shape[-1] *= fmt.pack
    return tuple(shape)


def export_maps(source, maps: list) -> list:
    """The maps convert_to_hf writes: the family's, with a kept-quantized model's stored names and scales (and an
    int4 model's `weight_shape` tensors, which QuantizingSource serves)."""
    record = source.cfg.quantization
    if not record:
        return maps
    fmt = format_of(record)
    quantized = set(record["tensors"])
    logical = {}
    for m in maps:
        if m.name in quantized:
            for h, t in zip(m.hf, m.to_hf(torch.empty(_full_logical(source, m.name), device="meta"))):
                logical[h] = tuple(t.shape)
    out = kept_maps(fmt, maps, quantized, logical.__getitem__)
    if fmt.pack > 1:  # int4: each module's `weight_shape` [out, in] (int64), as compressed-tensors writes it
        from tpzoo.models.hf_mapping import TensorMap

        def unstack(x, n):
            if x.device.type == "meta":
                return [torch.empty(x.shape[1:], dtype=x.dtype, device="meta")] * n
            return [t.clone() for t in x.unbind(0)]

        for m in maps:
            if m.name in quantized:
                shapes = [logical[h] for h in m.hf]
                out.append(TensorMap(m.name + "_shape", tuple(fmt.hf_shape(h) for h in m.hf),
                                     lambda ts: torch.stack(ts), lambda x, n=len(shapes): unstack(x, n)))
                source.shapes[m.name + "_shape"] = torch.tensor(shapes, dtype=torch.int64)
    return out


def quantization_config(cfg) -> dict | None:
    record = getattr(cfg, "quantization", None)
    return dict(record["hf"]) if record else None


class QuantizingSource:
    """A checkpoint source seen as kept-quantized: its `fmt` tensors computed on the fly (export only), the rest
    (and every other method) its own. Also serves the int4 `weight_shape` tensors of a kept int4 model."""

    def __init__(self, source, quantize: str | None):
        self.source, self.shapes, self._cache = source, {}, None
        self.cfg, self.fmt = source.cfg, None
        if quantize is None:
            return
        if source.cfg.quantization:
            if format_of(source.cfg.quantization).name == "fp8_block" and quantize == "fp8-block":
                return  # a kept fp8 model: exported as stored
            raise QuantError(f"--quantize {quantize}: the checkpoint is kept in {source.cfg.quantization['format']}; "
                             f"export it as stored (no --quantize)")
        self.fmt = Fp8Block()
        names = quantizable(source.cfg)
        self.maps = {m.name: m for m in _family_maps(source.cfg)}
        skipped = sorted({h[: -len(".weight")] for m in self.maps.values() if m.export and m.name not in names
                          and m.vocab_dim is None for h in m.hf
                          if h.endswith(".weight") and len(_hf_shape(m, source, h)) == 2})
        hf = {**self.fmt.hf_config(), "modules_to_not_convert": ["lm_head", *skipped]}
        self.cfg = source.cfg.replace(quantization={"format": self.fmt.name, "block": list(self.fmt.block),
                                                    "tensors": names, "hf": hf})
        self.quantized = set(names)

    def __getattr__(self, key):  # everything else: the source's
        return getattr(self.source, key)

    def _own(self, name: str) -> str | None:
        """The quantized tensor `name` is (or is the scales of), when this source computes it."""
        if self.fmt is None:
            return None
        if name in self.quantized:
            return name
        base = name[: -len(self.fmt.scale_suffix)]
        return base if name.endswith(self.fmt.scale_suffix) and base in self.quantized else None

    def check(self, names) -> None:
        self.source.check([self._own(n) or n for n in names if n not in self.shapes])

    def full_shape(self, name: str) -> tuple:
        if name in self.shapes:
            return tuple(self.shapes[name].shape)
        own = self._own(name)
        if own is None or own == name:
            return self.source.full_shape(own or name)
        return _scale_shape(self.maps[own], self.fmt, self.source)

    def dtype(self, name: str) -> torch.dtype:
        if name in self.shapes:
            return torch.int64
        own = self._own(name)
        if own is None:
            return self.source.dtype(name)
        return self.fmt.weight_dtype if own == name else self.fmt.scale_dtype

    def byte_runs(self, name: str, box):
        if name in self.shapes or self._own(name) is not None:
            return None  # computed here, not bytes of a file
        return self.source.byte_runs(name, box) if hasattr(self.source, "byte_runs") else None

    def read_box(self, name: str, box) -> torch.Tensor:
        if name in self.shapes:
            full = self.shapes[name]
        else:
            own = self._own(name)
            if own is None:
                return self.source.read_box(name, box)
            full = self._quantized(own)[0 if own == name else 1]
        return full[tuple(slice(s, s + n) for s, n in box)]

    def _quantized(self, name: str) -> tuple[torch.Tensor, torch.Tensor]:
        """(values, scales) of tpzoo tensor `name` in tpzoo's layout: each HF part quantized on its own."""
        if self._cache is None or self._cache[0] != name:
            self._cache = None
            m = self.maps[name]
            dense = self.source.read_box(name, [(0, n) for n in self.source.full_shape(name)])
            parts = [self.fmt.quantize(p) for p in m.to_hf(dense)]
            del dense
            self._cache = (name, m.to_tpzoo([q for q, _ in parts]).contiguous(),
                           m.to_tpzoo([s for _, s in parts]).contiguous())
        return self._cache[1], self._cache[2]


def _family_maps(cfg) -> list:
    from tpzoo.models.registry import get_family

    return get_family(cfg.family).hf_tensor_map(cfg)


def _hf_shape(m, source, h: str) -> tuple:
    full = source.full_shape(m.name)
    return tuple(dict(zip(m.hf, m.to_hf(torch.empty(full, device="meta"))))[h].shape)


def _scale_shape(m, fmt, source) -> tuple:
    """The tpzoo-layout shape of the scales of tpzoo tensor m (its HF parts' scales put together by its own
    mapping, run on small stand-ins: never on meta, whose concatenation would import torch._dynamo)."""
    full = source.full_shape(m.name)
    parts = [fmt.scale_shape(t.shape) for t in m.to_hf(torch.empty(full, device="meta"))]
    return tuple(m.to_tpzoo([torch.zeros(s, dtype=torch.int8) for s in parts]).shape)
