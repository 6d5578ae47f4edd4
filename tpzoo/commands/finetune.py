"""`tpzoo finetune --base CKPT_OR_HF_DIR --data sft.jsonl [CONFIG.toml] [--key value ...]`: supervised fine-tuning.

The same trainer as `tpzoo pretrain` with task "sft": JSONL records ({"prompt", "response"} or {"messages"}),
loss only on the response tokens, packed (default) or padded, a held-out split evaluated at the end (and every
--eval-every steps). The base is a tpzoo checkpoint or a Hugging Face model directory; its tokenizer is used
unless --tokenizer. Export the result with `tpzoo convert to-hf`.
"""
from __future__ import annotations

import argparse

from . import pretrain

DEFAULTS = {"task": "sft", "steps": 100, "lr": 1e-4, "warmup_steps": 10, "weight_decay": 0.0,
            "save": "runs/finetune", "eval_fraction": 0.1, "sample_prompt": ""}


def add_arguments(p: argparse.ArgumentParser) -> None:
    pretrain.add_arguments(p, DEFAULTS)


def run(args) -> int:
    from tpzoo.errors import ConfigError
    from tpzoo.train.config import config_from_args

    cfg = config_from_args(args, DEFAULTS)
    if not cfg.base and not cfg.resume and not args.print_config:
        raise ConfigError("--base PATH (a tpzoo checkpoint or a Hugging Face model directory) is required "
                          "(or --resume)")
    return pretrain.run(args, DEFAULTS)
