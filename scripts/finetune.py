#!/usr/bin/env python
"""Thin entry point: `python scripts/finetune.py --base CKPT_OR_HF_DIR --data sft.jsonl [...]` == `tpzoo finetune ...`
(also under torchrun). See docs/training.md."""
import sys

from tpzoo.cli import main

if __name__ == "__main__":
    sys.exit(main(["finetune", *sys.argv[1:]]))
