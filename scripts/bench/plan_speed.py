"""Benchmark: how long the README's `tpzoo plan` examples take (the goal of issue 48: each under 10 s).

    python scripts/bench/plan_speed.py                                  # this checkout
    python scripts/bench/plan_speed.py --before /path/to/other/python   # also another checkout's, side by side
    python scripts/bench/plan_speed.py --before ... --write docs/benchmarks.md

Reads the `tpzoo plan` lines of README.md's examples block, runs each as `python -m tpzoo plan ...` in a
subprocess (process start included) and reports its wall time, its CPU time (user + system of the child: the
number that a shared machine's load disturbs least), its status and the header's layout counts. `--before`: the
same commands under another interpreter (an older checkout's venv), alternating with this one; an example that
checkout cannot run as written (it had no default --seq-len / --global-batch-size) is given `--seq-len 4096
--global-batch-size 1024`, the defaults, and so marked.
"""
from __future__ import annotations

import argparse
import os
import re
import shlex
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
KEY = "plan-speed"


def readme_examples() -> list[list[str]]:
    """The `tpzoo plan ...` commands of README.md (comments dropped), as argument lists after `tpzoo`."""
    out = []
    for line in (ROOT / "README.md").read_text().splitlines():
        if line.startswith("tpzoo plan "):
            out.append(shlex.split(line.split("#")[0])[1:])
    return out


def checkout_of(python: str) -> Path:
    """The checkout whose venv holds `python` (CHECKOUT/.venv/bin/python): `python -m` imports from the working
    directory first, so each command runs there."""
    return Path(python).absolute().parents[2]


def run(python: str, args: list[str], timeout: float) -> dict:
    """One command: wall and CPU seconds, exit status, the header's 'N layouts, M fit'."""
    start = time.perf_counter()
    proc = subprocess.Popen([python, "-m", "tpzoo", *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, cwd=checkout_of(python), env={**os.environ, "TQDM_DISABLE": "1"})
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, err = proc.communicate()
    wall = time.perf_counter() - start
    found = re.search(r"(\d+) layouts, (\d+) fit", out)
    return {"wall": wall, "rc": proc.returncode, "layouts": found.group(0) if found else (err.strip() or "-")[-90:]}


def cpu_seconds(python: str, args: list[str], timeout: float) -> tuple[float, dict]:
    """run() with the child's CPU time measured by the resource counters of this process's children."""
    import resource

    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    r = run(python, args, timeout)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime), r


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--before", help="another checkout's python (CHECKOUT/.venv/bin/python), run side by side")
    p.add_argument("--before-label", default="main", help="what --before is, for the table")
    p.add_argument("--timeout", type=float, default=1800.0)
    p.add_argument("--write", help="put the table in this markdown file (section plan-speed)")
    args = p.parse_args(argv)
    rows = []
    for example in readme_examples():
        line = {"command": "tpzoo " + " ".join(example)}
        if args.before:
            old = list(example)
            if "--seq-len" not in old:
                old += ["--seq-len", "4096", "--global-batch-size", "1024"]
            cpu, r = cpu_seconds(args.before, old, args.timeout)
            line["before"] = {**r, "cpu": cpu, "defaults_given": old != example}
        cpu, r = cpu_seconds(str(ROOT / ".venv" / "bin" / "python"), example, args.timeout)
        line["after"] = {**r, "cpu": cpu}
        rows.append(line)
        print(line, flush=True)
    lines = ["## `tpzoo plan`: the README's examples (issue 48)", "",
             f"Command: `python scripts/bench/plan_speed.py{' --before PYTHON' if args.before else ''}` (one process "
             f"per example, start included; CPU = user + system seconds of the process, wall on a shared machine "
             f"whose load varies; before: {args.before_label}, given `--seq-len 4096 --global-batch-size 1024` "
             f"where the example relies on the defaults it lacked).", "",
             "| example | " + ("before: CPU s (wall s) | " if args.before else "") + "after: CPU s (wall s) | layouts |",
             "|---|" + ("---|" if args.before else "") + "---|---|"]
    for r in rows:
        before = ""
        if args.before:
            b = r["before"]
            before = f"{b['cpu']:.1f} ({b['wall']:.1f}){' *' if b['defaults_given'] else ''} | "
        a = r["after"]
        lines.append(f"| `{r['command']}` | {before}{a['cpu']:.1f} ({a['wall']:.1f}) | {a['layouts']} |")
    text = "\n".join(lines)
    print(text)
    if args.write:
        sys.path.insert(0, str(ROOT / "scripts" / "bench"))
        from mdsection import write_section

        write_section(args.write, KEY, text)


if __name__ == "__main__":
    main()
