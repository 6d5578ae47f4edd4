"""Convert a Hugging Face checkpoint to tpzoo's sharded format, or back: a thin entry point for `tpzoo convert`.

    python scripts/convert_hf.py ~/models/Llama-3.2-1B ckpt/llama --tp 2 --pp 2        # = tpzoo convert from-hf
    python scripts/convert_hf.py to-hf ckpt/llama out/llama                           # = tpzoo convert to-hf

Options as `tpzoo convert from-hf --help` / `tpzoo convert to-hf --help`; format: docs/checkpoint-format.md.
"""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tpzoo.cli import main  # noqa: E402

if __name__ == "__main__":
    args = sys.argv[1:]
    if not args or args[0] not in ("from-hf", "to-hf", "-h", "--help"):
        args = ["from-hf", *args]
    sys.exit(main(["convert", *args]))
