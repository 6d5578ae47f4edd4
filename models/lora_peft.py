"""The Hugging Face PEFT form of a chunk's adapters: their keys in `adapter_model.safetensors`, their layout there,
and the `target_modules` / `target_parameters` of `adapter_config.json` (tpzoo/checkpoint/peft.py writes and reads
the files; tpzoo/checkpoint/peft_check.py asks PEFT whether it loads what is written).

Linear layers' adapters: `base_model.model.<HF module>.lora_A.weight` [r, in] / `.lora_B.weight` [out, r], the HF
module being the one the family's tensor map names for that part of the tpzoo weight; tensors as tpzoo holds
them.

The routed experts' adapters (models/kinds/expert_lora.py) in PEFT 0.21's form for transformers 5's fused expert
parameters (its ParamWrapper): the parameter is named in `target_parameters` (`mlp.experts.gate_up_proj`,
`mlp.experts.down_proj`: transformers 5's in-memory names, the family's tensor map says where: hf_mapping.PeftParam),
and its adapter is keyed by the module that holds it. PEFT wraps one parameter per wrapper, nesting the wrappers
of one module in the order the module registers its parameters, so the first (gate_up_proj) is the inner one:
`mlp.experts.base_layer.lora_A.weight` is gate_up's, `mlp.experts.lora_A.weight` down's. Layout: lora_A
[E*r, in] holds the experts' A one block after the other; lora_B [out, E*r] holds expert e's B in the columns
e, e + E, e + 2E, ... (PEFT reshapes it (out, r, E)); for gpt-oss (transformers keeps its experts transposed, x @ W)
in and out are the same in the semantic sense, and B's rows follow gate_up_proj's interleaved gate|up columns.

Why some linear adapters are parameter targets too. For the Qwen2-MoE- and Mixtral-style model types (Qwen3-MoE,
Qwen3-Next, Qwen3.5-MoE, OLMoE, DeepSeek-V3, GLM-4.5, Mixtral, MiniMax-M2) PEFT 0.21 with transformers 5 rewrites a
config's `target_modules` before adding the adapters (peft.utils.transformers_weight_conversion): every name that
equals, or ends with, one of the routed experts' per-expert names of the checkpoint (`gate_proj`, `up_proj`,
`down_proj`; Mixtral's `w1`, `w3`, `w2`) is moved to `target_parameters` as the fused experts, whatever module it
meant, and a regex is first resolved to such names. So an adapter on a dense MLP (DeepSeek-V3's and GLM-4.5's first
layers, Qwen3-MoE's mlp_only_layers) or on the shared experts (DeepSeek-V3, GLM-4.5, Qwen3-Next, Qwen3.5-MoE) cannot
be named in target_modules in any spelling. PEFT's ParamWrapper also adapts a 2-D weight, with the same keys and
the same arithmetic as its LoRA Linear (W + (alpha / r) B A, without dropout), and target_parameters are left
alone by that rewrite: such adapters are named there, by their weight (`mlp.gate_proj.weight`,
`mlp.shared_experts.down_proj.weight`: the HF path after the layer index, matched as a suffix), so the default
`all-linear` fine-tune of these families exports. What PEFT cannot hold is dropout on them (ParamWrapper refuses
it): `check_exportable` refuses that combination before training.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Callable

import torch

from tpzoo.errors import ConfigError

from .kinds.expert_lora import expert_loras
from .lora import ALL_LINEAR, LoRAConfig, sites
from .registry import get_family

_LAYER = re.compile(r"^.*?\.\d+\.")  # the HF path up to the layer index ("model.layers.3.")
_PER_EXPERT = re.compile(r"\.experts\.\d+\.([^.]+)\.weight$")  # an expert stored on its own: its projection name


def _identity(t: torch.Tensor) -> torch.Tensor:
    return t


@dataclass
class PeftTensor:
    """One adapter tensor: its tpzoo name, its PEFT key, and its full tensor from tpzoo's layout to PEFT's and back."""
    ours: str
    key: str
    to_peft: Callable[[torch.Tensor], torch.Tensor] = _identity
    from_peft: Callable[[torch.Tensor], torch.Tensor] = _identity


def _maps(chunk) -> dict:
    return {m.name: m for m in get_family(chunk.cfg.family).hf_tensor_map(chunk.cfg)}


def expert_module_names(chunk) -> set[str]:
    """The routed experts' per-expert projection names of the checkpoint (`gate_proj`, ...; none for gpt-oss, whose
    experts are stored fused): the names PEFT reads as the fused experts."""
    return {m.group(1) for tm in _maps(chunk).values() for h in tm.hf for m in [_PER_EXPERT.search(h)] if m}


def _suffix(hf_path: str) -> str:
    """A parameter target's name: the HF path after the layer index, matched by PEFT as a suffix."""
    return _LAYER.sub("", hf_path, count=1)


def _linear_adapters(chunk):
    """(site, HF module, short name) of every linear adapter of the chunk."""
    for site in sites(chunk):
        if site.layer.lora is None:
            continue
        by_short = dict(zip(site.short_names, site.hf_modules))
        for name in site.layer.lora.names:
            yield site, by_short[name], name


def peft_targets(chunk) -> tuple[list[str], list[str]]:
    """(target_modules, target_parameters) of the chunk's adapters (see the module docstring)."""
    experts = expert_module_names(chunk)
    modules, params = set(), set()
    for _, hf_module, name in _linear_adapters(chunk):
        if name in experts:
            params.add(_suffix(hf_module) + ".weight")
        else:
            modules.add(name)
    maps = _maps(chunk)
    for moe_name, lora in expert_loras(chunk):
        params.update(_suffix(maps[f"{moe_name}.{n}"].peft.param) for n in lora.names)
    return sorted(modules), sorted(params)


def peft_tensors(chunk) -> list[PeftTensor]:
    """Every adapter tensor of the chunk with its PEFT key and layout."""
    out = []
    for site, hf_module, name in _linear_adapters(chunk):
        for ab in ("A", "B"):
            out.append(PeftTensor(f"{site.module_name}.lora.{ab}.{name}",
                                  f"base_model.model.{hf_module}.lora_{ab}.weight"))
    maps = _maps(chunk)
    for moe_name, lora in expert_loras(chunk):
        pefts = [maps[f"{moe_name}.{n}"].peft for n in lora.names]
        for j, (name, peft) in enumerate(zip(lora.names, pefts)):
            module = peft.param.rsplit(".", 1)[0]
            nested = sum(p.param.rsplit(".", 1)[0] == module for p in pefts[j + 1:])  # wrapped after this one
            prefix = f"base_model.model.{module}" + ".base_layer" * nested
            out.append(PeftTensor(f"{moe_name}.lora.A.{name}", f"{prefix}.lora_A.weight", _a_to_peft, _a_from_peft(
                lora.num_experts)))
            out.append(PeftTensor(f"{moe_name}.lora.B.{name}", f"{prefix}.lora_B.weight", _b_to_peft(peft),
                                  _b_from_peft(peft, lora.num_experts)))
    return out


def _a_to_peft(a: torch.Tensor) -> torch.Tensor:
    return a.reshape(-1, a.shape[-1])  # [E, r, in] -> [E*r, in]: one block per expert


def _a_from_peft(experts: int):
    return lambda a: a.reshape(experts, -1, a.shape[-1])


def _b_to_peft(peft):
    def to_peft(b):  # [E, out, r] -> [out, r*E]: column j = rank (j // E) of expert (j % E)
        b = peft.out_to_hf(b) if peft.out_to_hf else b
        return b.permute(1, 2, 0).reshape(b.shape[1], -1)
    return to_peft


def _b_from_peft(peft, experts: int):
    def from_peft(b):
        b = b.reshape(b.shape[0], -1, experts).permute(2, 0, 1)
        return (peft.out_from_hf(b) if peft.out_from_hf else b).contiguous()
    return from_peft


def check_exportable(chunk, lcfg: LoRAConfig) -> None:
    """ConfigError (one line) for adapters PEFT cannot hold as configured: dropout on an adapter it takes as a
    parameter target (the module docstring: a dense or shared MLP of a mixture of experts named like the experts).
    `chunk` carries the adapters (tpzoo.models.lora.add_lora)."""
    if not lcfg.dropout:
        return
    named = sorted({name for _, _, name in _linear_adapters(chunk) if name in expert_module_names(chunk)})
    if named:
        keep = sorted({name for _, _, name in _linear_adapters(chunk)} - set(named))
        instead = f", or --lora-targets {','.join(keep)}" if keep else ""
        raise ConfigError(f"--lora-dropout {lcfg.dropout:g} with adapters on {chunk.cfg.name or chunk.cfg.family}'s "
                          f"{', '.join(named)}: PEFT reads those names of this model as its routed experts, so the "
                          f"export names their adapters as parameters (target_parameters), which take no dropout in "
                          f"PEFT; pass --lora-dropout 0{instead} (or keep the run and export it merged: convert "
                          f"to-hf --merge)")


def config_from_peft(c: dict, where: str) -> LoRAConfig:
    """The LoRAConfig of a PEFT adapter_config.json dict (its features already checked by the reader): target_modules
    as linear targets; target_parameters as the routed experts (mlp.experts.gate_up_proj and down_proj, both) and
    linear weights (`....<module>.weight`)."""
    targets = c.get("target_modules")
    if isinstance(targets, str):
        targets = [targets] if targets == ALL_LINEAR else None
    targets = list(targets or [])
    experts = set()
    for p in c.get("target_parameters") or []:
        leaf = p.rsplit(".", 1)[-1]
        if p.endswith(("experts.gate_up_proj", "experts.down_proj")):
            experts.add(leaf)
        elif leaf == "weight" and "." in p:
            targets.append(p.rsplit(".", 2)[-2])
        else:
            raise ConfigError(f"{where}: target_parameters {p!r}: tpzoo adapts the routed experts "
                              f"(mlp.experts.gate_up_proj and down_proj) and linear weights (....weight) only")
    if experts and experts != {"gate_up_proj", "down_proj"}:
        raise ConfigError(f"{where}: target_parameters adapt the experts' {', '.join(sorted(experts))} only: "
                          f"tpzoo adapts both gate_up_proj and down_proj (--lora-experts)")
    if not targets and not experts:
        raise ConfigError(f"{where}: target_modules {c.get('target_modules')!r} and target_parameters "
                          f"{c.get('target_parameters')!r}: give a list of module names or parameters")
    return LoRAConfig(c["r"], c["lora_alpha"], c.get("lora_dropout", 0.0), sorted(set(targets)), bool(experts))
