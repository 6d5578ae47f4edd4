"""A LoRA run: which adapters, on which base, and how they start (fresh, from a PEFT adapter, or resumed).

The base is frozen in the model dtype and read straight into its shards (a tpzoo checkpoint at any layout or a
Hugging Face directory); the adapters start as PEFT's do (A drawn layout-independently, B = 0), or from
--lora-from, or from the checkpoint being resumed, whose manifest also names the base (checked unchanged).
"""
from __future__ import annotations

from tpzoo.errors import ConfigError


def lora_of_run(cfg, resume_dir) -> tuple:
    """(LoRAConfig, base directory), or (None, None) for a run that trains every weight."""
    from tpzoo.checkpoint.lora_io import lora_config_of, lora_info, resolve_base
    from tpzoo.checkpoint.peft import read_peft_config
    from tpzoo.models.lora import LoRAConfig

    if resume_dir is not None:
        info = lora_info(resume_dir)
        if info is None:
            if cfg.lora_rank or cfg.lora_from:
                raise ConfigError(f"--lora-rank/--lora-from: the checkpoint to resume, {resume_dir}, is a full "
                                  f"model, not a LoRA run")
            return None, None
        lcfg = lora_config_of(info)
        if cfg.lora_rank and cfg.lora_rank != lcfg.rank:
            raise ConfigError(f"--lora-rank {cfg.lora_rank}: the run being resumed trains rank {lcfg.rank}")
        if cfg.lora_experts and not lcfg.experts:
            raise ConfigError(f"--lora-experts: the run being resumed, {resume_dir}, trains no expert adapters")
        return lcfg, resolve_base(info, resume_dir)
    if cfg.lora_from:
        lcfg = read_peft_config(cfg.lora_from)
        if cfg.lora_rank and cfg.lora_rank != lcfg.rank:
            raise ConfigError(f"--lora-rank {cfg.lora_rank} contradicts the rank {lcfg.rank} of --lora-from "
                              f"{cfg.lora_from}")
        if cfg.lora_experts and not lcfg.experts:
            raise ConfigError(f"--lora-experts: the PEFT adapter {cfg.lora_from} has no expert adapters (no "
                              f"mlp.experts.gate_up_proj / down_proj in its target_parameters)")
        return lcfg, cfg.base
    if not cfg.lora_rank:
        return None, None
    return LoRAConfig(cfg.lora_rank, cfg.lora_alpha, cfg.lora_dropout, list(cfg.lora_targets),
                      cfg.lora_experts), cfg.base


def build(chunks, device, cfg, lcfg, base, resume_dir) -> None:
    """Attach the adapters to the meta chunks, allocate on `device`, fill the base, start the adapters."""
    from tpzoo.checkpoint import load_weights_into
    from tpzoo.checkpoint.lora_io import is_base_param, is_lora_param
    from tpzoo.checkpoint.peft import load_peft_adapters
    from tpzoo.models.lora import add_lora, init_lora
    from tpzoo.pipeline import materialize_chunks

    add_lora(chunks, lcfg)
    materialize_chunks(chunks, device, init=False)
    load_weights_into(chunks, str(base), select=is_base_param)
    if resume_dir is not None:
        load_weights_into(chunks, str(resume_dir), select=is_lora_param)
    elif cfg.lora_from:
        load_peft_adapters(chunks, cfg.lora_from)
    else:
        init_lora(chunks, cfg.seed)
