"""Hugging Face PEFT adapters in and out: a LoRA checkpoint as `adapter_config.json` + `adapter_model.safetensors`
(what `peft.PeftModel.from_pretrained(base, DIR)` loads), and a PEFT adapter as the starting adapters of a run at
any (tp, pp, ep).

Names and layout are tpzoo.models.lora_peft's: linear layers' adapters as `base_model.model.<HF module>.lora_A.weight`
/ `.lora_B.weight`, the routed experts' in PEFT's target_parameters form. Every tensor is converted whole to
tpzoo's full layout, so a rank reads only its shard (its tp slice, its experts) from the dict, as from any
checkpoint. Before an adapter is written, PEFT is asked whether it loads it as written (peft_check.py); what it
would drop is refused in one line.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

from .format import CheckpointError

ADAPTER_CONFIG, ADAPTER_WEIGHTS = "adapter_config.json", "adapter_model.safetensors"
_UNSUPPORTED = {"use_dora": "DoRA", "use_rslora": "rank-stabilized scaling (rsLoRA)",
                "modules_to_save": "modules_to_save", "rank_pattern": "per-module ranks (rank_pattern)",
                "alpha_pattern": "per-module alphas (alpha_pattern)", "layers_to_transform": "layers_to_transform"}


class TensorDictSource:
    """Full tensors by tpzoo name, read through the checkpoint-source interface (fill_params / check_source)."""

    kind = "dict"

    def __init__(self, tensors: dict, where: str):
        self.tensors, self.where = tensors, where

    def check(self, names) -> None:
        missing = sorted(n for n in names if n not in self.tensors)
        if missing:
            raise CheckpointError(f"{self.where} has no adapter for {missing[:4]} ({len(missing)} in all)")

    def full_shape(self, name: str) -> tuple:
        return tuple(self.tensors[name].shape)

    def check_shape(self, name: str, full_shape: tuple) -> None:
        if self.full_shape(name) != tuple(full_shape):
            raise CheckpointError(f"{self.where}: adapter {name} has shape {list(self.full_shape(name))}, the base "
                                  f"model needs {list(full_shape)} (an adapter of another model?)")

    def dtype(self, name: str) -> torch.dtype:
        return self.tensors[name].dtype

    def read_box(self, name: str, box) -> torch.Tensor:
        return self.tensors[name][tuple(slice(s, s + n) for s, n in box)].clone()

    def close(self) -> None:
        self.tensors = {}


def read_peft_config(peft_dir):
    """The LoRAConfig of a PEFT adapter directory; features tpzoo does not implement are refused by name."""
    from tpzoo.errors import ConfigError
    from tpzoo.models.lora_peft import config_from_peft

    path = Path(peft_dir) / ADAPTER_CONFIG
    if not path.is_file():
        raise CheckpointError(f"{peft_dir} is not a PEFT adapter directory (no {ADAPTER_CONFIG})")
    c = json.loads(path.read_text())
    if c.get("peft_type", "LORA") != "LORA":
        raise CheckpointError(f"{path}: peft_type {c.get('peft_type')!r} is not LORA")
    for key, what in _UNSUPPORTED.items():
        if c.get(key):
            raise CheckpointError(f"{path}: {key} ({what}) is not supported by tpzoo's LoRA")
    if c.get("bias", "none") != "none":
        raise CheckpointError(f"{path}: bias {c['bias']!r} is not supported (only 'none')")
    try:
        return config_from_peft(c, str(path))
    except ConfigError as exc:
        raise CheckpointError(str(exc)) from None


def _read_peft_tensors(peft_dir) -> dict:
    from safetensors.torch import load_file

    weights = Path(peft_dir) / ADAPTER_WEIGHTS
    if not weights.is_file():
        raise CheckpointError(f"{peft_dir} has no {ADAPTER_WEIGHTS}")
    # PEFT saves the adapter name in the key only when it is not "default": accept both spellings
    return {k.replace(".default.weight", ".weight"): v for k, v in load_file(str(weights), device="cpu").items()}


def load_peft_adapters(chunks, peft_dir) -> None:
    """Fill the adapters of this rank's chunks (already added with the adapter's config) from a PEFT directory:
    each tensor from PEFT's layout to tpzoo's full one (models/lora_peft.py), then this rank's shard of it."""
    from tpzoo.models.lora_peft import peft_tensors
    from tpzoo.parallel.lora import is_lora_param

    from .layout import param_infos
    from .sources import check_source, fill_params

    peft = _read_peft_tensors(peft_dir)
    for chunk in chunks:
        infos = param_infos(chunk, chunk.cfg, chunk.dims.tp, is_lora_param)
        full = {info.name: info.full_shape for info in infos}
        tensors = {}
        for t in peft_tensors(chunk):
            if t.key not in peft:
                continue  # (check_source names what is missing)
            want = tuple(t.to_peft(torch.empty(full[t.ours], device="meta")).shape)
            if tuple(peft[t.key].shape) != want:
                raise CheckpointError(f"{peft_dir}: adapter {t.key} has shape {list(peft[t.key].shape)}, the base "
                                      f"model needs {list(want)} (an adapter of another model, or of another rank?)")
            tensors[t.ours] = t.from_peft(peft[t.key])
        source = TensorDictSource(tensors, str(peft_dir))
        check_source(source, infos)
        with torch.no_grad():
            fill_params(chunk, source, infos, chunk.dims.tp_rank, chunk.dims.tp)


def unused_peft_keys(model, peft_dir) -> list[str]:
    """The LoRA keys of a PEFT adapter that the whole `model` (its adapters added) would not read: adapters on
    modules tpzoo does not adapt, which a run would silently drop."""
    from tpzoo.models.lora_peft import peft_tensors

    ours = {t.key for t in peft_tensors(model)}
    return sorted(k for k in _read_peft_tensors(peft_dir) if ".lora_" in k and k not in ours)


def export_peft(ckpt, dst, force: bool = False) -> Path:
    """Write the adapters of the LoRA checkpoint `ckpt` as a PEFT adapter directory `dst` (atomically)."""
    from safetensors.torch import save_file

    from tpzoo.models import ModelLayout, Transformer
    from tpzoo.models.lora import add_lora
    from tpzoo.models.lora_peft import peft_targets, peft_tensors
    from tpzoo.models.registry import get_family
    from tpzoo.parallel.dims import ParallelDims

    from .atomic import atomic_dir
    from .lora_io import lora_config_of, lora_info
    from .sources import open_source

    info = lora_info(ckpt)
    if info is None:
        raise CheckpointError(f"{ckpt} is not a LoRA checkpoint")
    lcfg = lora_config_of(info)
    source = open_source(ckpt)
    try:
        full = Transformer(source.cfg, ModelLayout(ParallelDims.for_rank(tp=1), device="meta"))
        add_lora([full], lcfg)
        modules, params = peft_targets(full)
        tensors = {t.key: t.to_peft(source.read_box(t.ours, [(0, n) for n in source.full_shape(t.ours)])).contiguous()
                   for t in peft_tensors(full)}
        mtp_keys = {t.key for t in peft_tensors(full) if t.ours.startswith("mtp.")}
    finally:
        source.close()
    base = info["base"]["path"]
    config = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": lcfg.rank, "lora_alpha": lcfg.alpha,
              "lora_dropout": lcfg.dropout, "target_modules": modules, "bias": "none",
              "fan_in_fan_out": get_family(source.cfg.family).hf_conv1d,  # Conv1D weights are [in, out]
              "base_model_name_or_path": base, "inference_mode": True, "use_rslora": False, "use_dora": False,
              "init_lora_weights": True, "modules_to_save": None}
    if params:  # the routed experts, and MLPs PEFT would read as them (models/lora_peft.py)
        config["target_parameters"] = params
        if lcfg.dropout:  # (refused before training since; a run from before trained with it)
            raise CheckpointError(f"{source.cfg.family}: PEFT takes {', '.join(params)} as parameters "
                                  f"(target_parameters), which take no dropout, and this run trained with "
                                  f"--lora-dropout {lcfg.dropout:g}; export the model with the adapters merged "
                                  f"(convert to-hf --merge)")
    # multi-token prediction's adapters (models/mtp.py) go out under their HF names beside the others; transformers'
    # model has no MTP layers (it drops their weights), so PEFT is asked about the main model's keys only
    check_peft_loads(source.cfg, config, {key: t.shape for key, t in tensors.items() if key not in mtp_keys})
    dst = Path(dst)
    with atomic_dir(dst, force=force) as tmp:
        save_file(tensors, str(tmp / ADAPTER_WEIGHTS), metadata={"format": "pt"})
        (tmp / ADAPTER_CONFIG).write_text(json.dumps(config, indent=2) + "\n")
    return dst


def check_peft_loads(cfg, config: dict, shapes: dict) -> None:
    """Refuse (CheckpointError, one line) an adapter that PEFT would not load as written (checkpoint/peft_check.py);
    without peft installed, say that it went unchecked."""
    from .peft_check import peft_refusal

    try:
        refusal = peft_refusal(cfg, config, shapes)
    except ImportError:
        print("note: peft is not installed here: not checked that PEFT loads this adapter onto transformers' "
              f"{cfg.family} model", file=sys.stderr)
        return
    if refusal:
        raise CheckpointError(refusal)


def merge_adapters(model) -> None:
    """Fold every adapter of a whole (tp=1, ep=1) model into its weight, W += (alpha/r) B A, and drop the
    adapters (the routed experts' too: each expert's own)."""
    from tpzoo.models.kinds.expert_lora import expert_loras
    from tpzoo.parallel.lora import LoRA

    with torch.no_grad():
        for name, lora in expert_loras(model):
            moe = model.get_submodule(name)
            for weight in lora.names:
                w = getattr(moe, weight)
                w += lora.delta(weight).to(w.dtype)
            moe.lora = None
        for layer in [m for m in model.modules() if isinstance(getattr(m, "lora", None), LoRA)]:
            lora, w, row = layer.lora, layer.weight, 0
            if not lora.column:
                (name,) = lora.names
                w += (lora.scale * lora.B[name].float() @ lora.A[name].float()).to(w.dtype)
            else:
                for name, rows in zip(lora.parts, lora.local_rows):
                    if name is not None:
                        delta = lora.scale * lora.B[name].float() @ lora.A[name].float()
                        w[row:row + rows] += delta.to(w.dtype)
                    row += rows
            layer.lora = None


def export_merged(ckpt, dst, **to_hf_kw) -> list:
    """A LoRA checkpoint as a full Hugging Face model with the adapters merged in. Holds the whole model in
    memory once (as PEFT's merge_and_unload does), then streams it out through the ordinary to-hf conversion."""
    import tempfile

    from tpzoo.parallel.dims import ParallelDims

    from .convert import convert_to_hf
    from .model_io import load_model, save_model_shards

    from tpzoo.quant.modules import dequantize_model, merge_dtype

    dtype = merge_dtype(ckpt)  # a kept-quantized base: dequantized to the run's dtype, then merged
    model = load_model(ckpt, ParallelDims.for_rank(tp=1), device="cpu", dtype=dtype)
    if dtype is not None:
        dequantize_model(model, dtype)
    merge_adapters(model)
    with tempfile.TemporaryDirectory(prefix=".tpzoo-merge-", dir=Path(dst).resolve().parent) as tmp:
        save_model_shards(model, tmp, model.cfg, tokenizer=ckpt)
        return convert_to_hf(tmp, dst, **to_hf_kw)
