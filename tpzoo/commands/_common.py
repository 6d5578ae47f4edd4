"""Small helpers shared by the checkpoint commands: one error style, tokenizer loading."""
from __future__ import annotations

import sys

# The errors a user can cause (bad path, bad layout, corrupt checkpoint): reported in one line, exit code 2.
USER_ERRORS = (FileExistsError, FileNotFoundError, KeyError, ValueError, OSError)


def fail(command: str, err: BaseException) -> int:
    msg = err.args[0] if isinstance(err, KeyError) and err.args else str(err)
    print(f"tpzoo {command}: error: {msg}", file=sys.stderr)
    return 2


def load_tokenizer(spec):
    """tpzoo.data's loader when present (it also knows the byte tokenizer), else transformers' AutoTokenizer."""
    try:
        from tpzoo.data.tokenizer import load_tokenizer as load
    except ImportError:
        load = None
    if load is not None:
        return load(spec)
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(spec), local_files_only=True)


def encode(tokenizer, text: str, special_tokens: bool = False) -> list[int]:
    """Token ids of `text`; special_tokens=True adds what the HF tokenizer adds by default (e.g. BOS)."""
    hf = getattr(tokenizer, "hf", None)
    if hf is not None and special_tokens:
        return list(hf(text)["input_ids"])
    if hasattr(tokenizer, "encode") and hf is None and not hasattr(tokenizer, "eos_id"):
        return list(tokenizer.encode(text, add_special_tokens=special_tokens))  # a bare transformers tokenizer
    return list(tokenizer.encode(text))


def decode(tokenizer, ids) -> str:
    return tokenizer.decode([int(i) for i in ids])
