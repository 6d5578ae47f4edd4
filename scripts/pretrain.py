#!/usr/bin/env python
"""Thin entry point: `python scripts/pretrain.py [CONFIG.toml] [--key value ...]` == `tpzoo pretrain ...`
(also `torchrun --nproc-per-node N scripts/pretrain.py ...`). See docs/training.md."""
import sys

from tpzoo.cli import main

if __name__ == "__main__":
    sys.exit(main(["pretrain", *sys.argv[1:]]))
