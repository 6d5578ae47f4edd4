"""`tpzoo <command>`: one entry point; every multi-rank command also runs under `torchrun -m tpzoo`.

Commands register here by name -> (module, one-line help). A command module defines
`add_arguments(parser)` and `run(args) -> int | None`; it is imported only when its command runs, so
`tpzoo --help` stays fast and a command's heavy imports never slow the others.

A user error (tpzoo.errors) raised by a command becomes one line `tpzoo <command>: error: ...` and exit status 2
(`--debug` or TPZOO_DEBUG=1 adds the traceback); anything else is a bug and keeps its traceback.
"""
from __future__ import annotations

import argparse
import importlib
import os
import sys

COMMANDS: dict[str, tuple[str, str]] = {
    "demo": ("tpzoo.commands.demo", "TP demo on CPU: parallel layers against their dense twins"),
    "preprocess": ("tpzoo.commands.preprocess", "tokenize a corpus once into a memory-mapped token store"),
    "pretrain": ("tpzoo.commands.pretrain", "train a model (default: a tiny GPT on the stdlib, tp=2, ~2 min on CPU)"),
    "finetune": ("tpzoo.commands.finetune", "supervised fine-tuning on JSONL from a tpzoo checkpoint or HF dir"),
    "distill-cache": ("tpzoo.commands.distill_cache", "write a teacher's top-K log-probabilities of an SFT file once, "
                      "for finetune --objective distill"),
    "plot": ("tpzoo.commands.plot", "plot loss and learning-rate curves of a run (metrics.jsonl) to a PNG"),
    "models": ("tpzoo.commands.models_cmd", "list the named model configs (parameters, HF source)"),
    "convert": ("tpzoo.commands.convert", "convert checkpoints: from-hf / to-hf (Hugging Face), from-megatron / "
                                           "to-megatron (Megatron-LM)"),
    "reshard": ("tpzoo.commands.reshard", "rewrite a tpzoo checkpoint at another (tp, pp) layout"),
    "inspect": ("tpzoo.commands.inspect", "show (and --verify) a tpzoo checkpoint"),
    "eval": ("tpzoo.commands.eval", "loss and perplexity of a text file (tp/pp, torchrun or self-spawned)"),
    "generate": ("tpzoo.commands.generate", "generate text with a KV cache (tp, torchrun or self-spawned)"),
    "plan": ("tpzoo.commands.plan", "rank parallel layouts of a model on a cluster: memory, step time, MFU"),
}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(prog="tpzoo", description="Tensor-parallel transformer model zoo")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    wanted = argv[0] if argv else None
    chosen = parser
    for name, (module, help_text) in COMMANDS.items():
        p = sub.add_parser(name, help=help_text, description=help_text)
        p.set_defaults(_module=module)
        p.add_argument("--debug", action="store_true", help="show the traceback of an error (also TPZOO_DEBUG=1)")
        if name == wanted:  # only the chosen command's module is imported
            importlib.import_module(module).add_arguments(p)
            chosen = p
    args, extras = parser.parse_known_args(argv)
    if args.command is None:
        parser.print_help()
        return 1
    if extras:
        return _unrecognized(chosen, args.command, extras)
    from tpzoo.errors import debug_enabled, is_user_error, report

    if debug_enabled(args):
        os.environ["TPZOO_DEBUG"] = "1"  # ranks spawned from here inherit it
    try:
        rc = importlib.import_module(args._module).run(args)
    except BrokenPipeError:  # `tpzoo plan ... | head`: the reader left, which is no error of ours
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # no second error while flushing at exit
        return 0
    except Exception as e:  # noqa: BLE001 - user errors become one line; bugs propagate with their traceback
        if not is_user_error(e):
            raise
        name = " ".join(filter(None, (args.command, getattr(args, "direction", None))))
        return report(name, e, debug=debug_enabled(args))
    return int(rc or 0)


def _options(p: argparse.ArgumentParser) -> list[str]:
    """Every --flag of a parser and of its sub-commands (convert from-hf / to-hf)."""
    out = []
    for action in p._actions:
        out += [o for o in action.option_strings if o.startswith("--")]
        for sub in (action.choices or {}).values() if isinstance(action, argparse._SubParsersAction) else ():
            out += _options(sub)
    return out


def _unrecognized(p: argparse.ArgumentParser, command: str, extras: list[str]) -> int:
    """One line for flags the command does not know, with the closest known one (learning-rate -> --lr)."""
    from tpzoo.train.config_values import suggest

    flags = {f[2:].replace("-", "_"): f for f in _options(p)}
    unknown = [e for e in extras if e.startswith("-")] or extras
    first = unknown[0]
    hint = suggest(first.lstrip("-").split("=")[0], flags) if first.startswith("-") else None
    more = f" (and {len(unknown) - 1} more: {' '.join(unknown[1:])})" if len(unknown) > 1 else ""
    print(f"tpzoo {command}: error: unrecognized argument {first}"
          + (f"; did you mean {flags[hint]}?" if hint else "") + more, file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
