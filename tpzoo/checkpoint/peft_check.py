"""Whether Hugging Face PEFT loads an exported adapter as written: asked of PEFT itself, on transformers' model.

PEFT does not load an adapter's keys one for one. With transformers 5 it first rewrites the adapter config for the
model type (peft.utils.transformers_weight_conversion): for the Qwen2-MoE-style and Mixtral-style model types
(Qwen3-MoE, Qwen3-Next, OLMoE, DeepSeek-V3, GLM-4.5, ...) the MLP projection names (`gate_proj`, `up_proj`,
`down_proj`, Mixtral's `w1`/`w3`/`w2`) become the fused routed experts' parameters, so an adapter on a dense or
shared MLP of that name is left out, with only a warning, and the model runs on the base weights there. Which model
types, and which names, is PEFT's and transformers' business and changes with their versions; so rather than a
list per family, the export builds transformers' model for the checkpoint's config on the meta device (no memory),
lets PEFT add the adapter to it and load the exported keys (as meta tensors of their shapes), and refuses, before
anything is written, an adapter whose keys PEFT would not all load, or that PEFT would extend with adapters the file
does not hold.
"""
from __future__ import annotations

import contextlib
import io
import logging
import warnings

import torch


def _meta_hf_model(cfg):
    """transformers' causal LM for `cfg` (to_hf_config's config.json), built on the meta device."""
    import transformers

    from tpzoo.models import to_hf_config

    hf = dict(to_hf_config(cfg))
    architectures = hf.pop("architectures", None) or []
    config = transformers.AutoConfig.for_model(hf.pop("model_type"), **hf)
    with torch.device("meta"):
        try:
            return transformers.AutoModelForCausalLM.from_config(config)
        except ValueError:  # a causal LM outside the auto mapping (Mistral Small 4's): the class config.json names
            cls = getattr(transformers, architectures[0], None) if architectures else None
            if cls is None:
                raise
            return cls._from_config(config)


def _quietly():
    """PEFT and transformers warn on stdout/stderr and through logging while they build and load: the export
    reports in its own words."""
    stack = contextlib.ExitStack()
    stack.enter_context(warnings.catch_warnings())
    warnings.simplefilter("ignore")
    stack.enter_context(contextlib.redirect_stdout(io.StringIO()))
    stack.enter_context(contextlib.redirect_stderr(io.StringIO()))
    previous = logging.root.manager.disable
    logging.disable(logging.WARNING)
    stack.callback(logging.disable, previous)
    return stack


def _projection(key: str) -> str:
    """The module name an adapter key belongs to (`q_proj`; `experts` for the routed experts' parameters)."""
    return key.replace(".base_layer", "").split(".lora_")[0].rsplit(".", 1)[-1]


def peft_refusal(cfg, adapter_config: dict, shapes: dict) -> str | None:
    """None when PEFT, on transformers' model for `cfg`, loads exactly the adapter keys `shapes` ({PEFT key: shape})
    with `adapter_config`; else why not, in one line. Raises ImportError when peft is not installed."""
    import peft
    import transformers
    from peft.utils.save_and_load import set_peft_model_state_dict

    family = cfg.family
    ours = sorted({_projection(k) for k in shapes})  # the projection names of the adapter
    fields = {k: v for k, v in adapter_config.items() if k not in ("peft_type", "base_model_name_or_path")}
    lora = peft.LoraConfig(**fields)
    with _quietly():
        model = _meta_hf_model(cfg)
        try:
            wrapped = peft.PeftModel(model, lora, low_cpu_mem_usage=True)
        except ValueError as exc:  # PEFT finds none of the targets
            return (f"{family}: PEFT {peft.__version__} finds no module for {', '.join(ours)} in transformers' "
                    f"model ({str(exc).splitlines()[0]})")
        converted = wrapped.peft_config["default"]
        tensors = {k: torch.empty(s, device="meta") for k, s in shapes.items()}
        try:
            result = set_peft_model_state_dict(wrapped, tensors, low_cpu_mem_usage=True)
        except RuntimeError as exc:  # a shape transformers' modules do not have
            return f"{family}: PEFT cannot load the adapter onto transformers' model: {str(exc).splitlines()[-1]}"
    dropped = sorted({_projection(k) for k in result.unexpected_keys if ".lora_" in k})
    added = sorted({k for k in result.missing_keys if ".lora_" in k})
    if not dropped and not added:
        return None
    dropped = dropped or [n for n in ours if n not in (converted.target_modules or ())] or ours
    moved = sorted(converted.target_parameters or ())
    why = (f"PEFT {peft.__version__} with transformers {transformers.__version__} reads those names of a "
           f"{cfg.family} adapter as the fused routed experts ({', '.join(moved)}), and would run the base weights "
           f"there" if moved else f"PEFT {peft.__version__} would not load them onto transformers' model")
    kept = [n for n in ours if n not in dropped]
    instead = (f", or train with --lora-targets {','.join(kept)}" if kept else "")
    return (f"{family}: PEFT cannot load this adapter's {', '.join(dropped)}: {why}; export the model with the "
            f"adapters merged (convert to-hf --merge){instead}")
