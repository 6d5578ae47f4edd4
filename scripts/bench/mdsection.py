"""Shared by the bench scripts: replace one script's marked section of a markdown file, or append it."""
from __future__ import annotations

import pathlib


def write_section(path, key: str, body: str) -> None:
    """Replace the text between `<!-- key:begin -->` and `<!-- key:end -->` (others' sections stay as they are)."""
    path = pathlib.Path(path)
    begin, end = f"<!-- {key}:begin -->", f"<!-- {key}:end -->"
    text = path.read_text() if path.exists() else "# Benchmarks\n"
    block = f"{begin}\n{body.rstrip()}\n{end}"
    if begin in text and end in text:
        text = text[: text.index(begin)] + block + text[text.index(end) + len(end):]
    else:
        text = text.rstrip() + "\n\n" + block + "\n"
    path.write_text(text)
