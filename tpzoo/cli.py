"""`tpzoo <command>`: one entry point; every multi-rank command also runs under `torchrun -m tpzoo`.

Commands register here by name -> (module, one-line help). A command module defines
`add_arguments(parser)` and `run(args) -> int | None`; it is imported only when its command runs, so
`tpzoo --help` stays fast and a command's heavy imports never slow the others.
"""
from __future__ import annotations

import argparse
import importlib
import sys

COMMANDS: dict[str, tuple[str, str]] = {
    "demo": ("tpzoo.commands.demo", "TP demo on CPU: parallel layers against their dense twins"),
    "preprocess": ("tpzoo.commands.preprocess", "tokenize a corpus once into a memory-mapped token store"),
}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(prog="tpzoo", description="Tensor-parallel transformer model zoo")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    wanted = argv[0] if argv else None
    for name, (module, help_text) in COMMANDS.items():
        p = sub.add_parser(name, help=help_text, description=help_text)
        p.set_defaults(_module=module)
        if name == wanted:  # only the chosen command's module is imported
            importlib.import_module(module).add_arguments(p)
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 1
    rc = importlib.import_module(args._module).run(args)
    return int(rc or 0)


if __name__ == "__main__":
    sys.exit(main())
