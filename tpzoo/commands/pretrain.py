"""`tpzoo pretrain [CONFIG.toml] [--key value ...]`: train a model from scratch (or continue from --base).

With no arguments: a tiny GPT on the Python standard library's source files with the byte-level tokenizer, at
tp=2 on 2 CPU ranks, in about two minutes; it prints the first and last losses, saves a checkpoint under
runs/pretrain and ends with a sample. Under `torchrun --nproc-per-node N -m tpzoo pretrain ...` the ranks are
torchrun's; without torchrun the command spawns tp*pp*dp ranks itself. Every config field is a flag
(`--help`); docs/training.md has the reference.
"""
from __future__ import annotations

import argparse

DEFAULTS: dict = {}


def add_arguments(p: argparse.ArgumentParser, defaults: dict | None = None) -> None:
    from tpzoo.train.config import add_config_arguments

    add_config_arguments(p, DEFAULTS if defaults is None else defaults)


def _rank_main(cfg) -> None:
    """One rank: size its thread pool to its share of the cores, train, and fail the process on divergence."""
    import os
    import sys

    import torch

    from tpzoo.train import train

    if "OMP_NUM_THREADS" not in os.environ:  # torchrun sets it; self-spawned ranks share the cores evenly
        local = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // local))
    result = train(cfg)
    if result["status"] != "ok":
        sys.exit(1)


def run_config(cfg, command: str = "pretrain") -> int:
    """Preflight (tpzoo.train.preflight: the config against the model, the layout and the files), then the ranks.
    Without torchrun the check runs here, before any rank is spawned; under torchrun each rank runs it first."""
    from tpzoo.train.preflight import check_train, in_rank

    from .launch import run_multirank, under_torchrun

    if under_torchrun():
        fn, nproc = in_rank(check_train, _rank_main), 1
    else:
        check_train(cfg)
        fn, nproc = _rank_main, cfg.spawn_world_size()
    try:
        return run_multirank(fn, cfg, nproc, command)
    except SystemExit as e:  # one rank in this process: its exit status (1: diverged, 2: a user error)
        return int(e.code or 0)


def run(args, defaults: dict | None = None) -> int:
    from tpzoo.train.config import config_from_args

    cfg = config_from_args(args, DEFAULTS if defaults is None else defaults)
    if args.print_config:
        print(cfg.to_toml())
        return 0
    return run_config(cfg, getattr(args, "command", None) or "pretrain")
