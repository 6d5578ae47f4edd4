"""Shared by the bench scripts: replace one script's marked section of a markdown file, or append it."""
from __future__ import annotations

import pathlib
import re


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


def sections(path) -> dict[str, str]:
    """Every marked section of a markdown file: key -> body."""
    text, out = pathlib.Path(path).read_text(), {}
    for begin in re.finditer(r"<!-- (\S+):begin -->\n", text):
        key = begin.group(1)
        end = text.find(f"<!-- {key}:end -->", begin.end())
        if end >= 0:
            out[key] = text[begin.end():end]
    return out


def main(argv=None) -> None:
    """python scripts/bench/mdsection.py SRC DST: copy every section of SRC into DST (replaced where DST has it,
    appended otherwise): a GPU run's sections (scripts/gpu_measure.sh) into docs/benchmarks.md."""
    import sys

    src, dst = (argv if argv is not None else sys.argv[1:])
    for key, body in sections(src).items():
        write_section(dst, key, body)
        print(f"{dst}: section {key}")


if __name__ == "__main__":
    main()
