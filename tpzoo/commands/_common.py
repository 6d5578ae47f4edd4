"""Small helpers shared by the commands: tokenizer loading, encoding and decoding, text tables. (Errors:
tpzoo.errors.)"""
from __future__ import annotations


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


def aligned(rows: list[list[str]], right: set[int] = frozenset(), indent: str = "", gap: str = " ") -> list[str]:
    """Lines of a text table whose every column is as wide as its widest cell (a long model or tensor name
    widens its column instead of pushing the rest of its row out of line); columns in `right` are right-aligned,
    the last one is not padded."""
    widths = [max(len(r[c]) for r in rows) for c in range(len(rows[0]))] if rows else []
    last = len(widths) - 1
    return [indent + gap.join(cell.rjust(widths[c]) if c in right else cell if c == last else cell.ljust(widths[c])
                              for c, cell in enumerate(row)) for row in rows]
