"""Checking config values: types, ranges, "did you mean", and TOML files read with the line of every key.

Each helper raises tpzoo.errors.ConfigError with a message that names the field, the value and what was expected;
the caller (tpzoo.train.config) prefixes where the value came from (`run.toml:7`, `--lr`). Kept apart from the
field definitions so that config.py reads as the list of fields.

A field's metadata may carry a range: `ge`, `gt`, `le`, `lt` (>=, >, <=, < a bound), checked after the value
has its type; a list field's range applies to each item. `nonempty=True` refuses "" for a string.
"""
from __future__ import annotations

import difflib
import math
import re
from pathlib import Path
from typing import Any

import tomllib

from tpzoo.errors import ConfigError

_TYPE_NAMES = {int: "an integer", float: "a number (float)", bool: "a boolean (true or false)", str: "a string"}
_TRUE, _FALSE = ("1", "true", "yes", "on"), ("0", "false", "no", "off")

# Names other trainers use for our fields (HF TrainingArguments, Megatron, nanoGPT): difflib cannot see that
# learning_rate means lr, so these are looked up first.
ALIASES = {
    "learning_rate": "lr", "max_lr": "lr", "peak_lr": "lr", "min_learning_rate": "min_lr",
    "max_steps": "steps", "train_steps": "steps", "num_steps": "steps", "train_iters": "steps",
    "max_iters": "steps", "iterations": "steps",
    "warmup": "warmup_steps", "warmup_iters": "warmup_steps", "lr_warmup_steps": "warmup_steps",
    "lr_warmup_iters": "warmup_steps",
    "adam_beta1": "beta1", "adam_beta2": "beta2", "adam_eps": "eps", "adam_epsilon": "eps", "epsilon": "eps",
    "max_grad_norm": "clip_grad", "grad_clip": "clip_grad", "gradient_clipping": "clip_grad",
    "clip_grad_norm": "clip_grad",
    "batch_size": "global_batch_size", "train_batch_size": "global_batch_size",
    "micro_batch": "micro_batch_size", "per_device_train_batch_size": "micro_batch_size",
    "seq_length": "seq_len", "sequence_length": "seq_len", "max_seq_length": "seq_len", "block_size": "seq_len",
    "context_length": "seq_len",
    "tensor_parallel": "tp", "tensor_model_parallel_size": "tp", "tp_size": "tp",
    "pipeline_parallel": "pp", "pipeline_model_parallel_size": "pp", "pp_size": "pp",
    "data_parallel": "dp", "dp_size": "dp", "virtual_pipeline_model_parallel_size": "virtual_stages",
    "model_name": "model", "model_name_or_path": "base", "tokenizer_name": "tokenizer",
    "output_dir": "save", "save_dir": "save", "checkpoint_dir": "save", "save_steps": "save_every",
    "save_interval": "save_every", "eval_steps": "eval_every", "eval_interval": "eval_every",
    "logging_steps": "log_interval", "log_every": "log_interval", "precision": "dtype",
    "datasets": "data", "dataset": "data", "train_data": "data", "data_path": "data",
}


def suggest(name: str, candidates) -> str | None:
    """The candidate `name` most likely meant: an alias, else the closest spelling (difflib), else None."""
    candidates = list(candidates)
    key = name.strip().replace("-", "_").lower()
    if ALIASES.get(key) in candidates:
        return ALIASES[key]
    if key in candidates:
        return key
    # A misspelt alias ("learning_rte") is closer to the alias than to the field it stands for.
    known = candidates + [a for a, field in ALIASES.items() if field in candidates]
    close = difflib.get_close_matches(key, known, n=1, cutoff=0.6)
    return ALIASES.get(close[0], close[0]) if close else None


def _num(x) -> str:
    return f"{x:g}" if isinstance(x, float) else str(x)


def range_text(meta) -> str:
    """The valid range of a field as text ('> 0', '[0, 1)', '>= 1'); '' when unbounded."""
    lo = ("[", meta["ge"]) if "ge" in meta else ("(", meta["gt"]) if "gt" in meta else None
    hi = ("]", meta["le"]) if "le" in meta else (")", meta["lt"]) if "lt" in meta else None
    if lo and hi:
        return f"{lo[0]}{_num(lo[1])}, {_num(hi[1])}{hi[0]}"
    if lo:
        return f"{'>=' if lo[0] == '[' else '>'} {_num(lo[1])}"
    if hi:
        return f"{'<=' if hi[0] == ']' else '<'} {_num(hi[1])}"
    return ""


def _in_range(value, meta) -> bool:
    # Written as "not outside" so that NaN, which compares false with everything, is refused too.
    return (("ge" not in meta or value >= meta["ge"]) and ("gt" not in meta or value > meta["gt"])
            and ("le" not in meta or value <= meta["le"]) and ("lt" not in meta or value < meta["lt"]))


def _typed(name: str, value: Any, t: type) -> Any:
    """value as type t (numeric strings, as from the environment or an old config, are converted), or a
    ConfigError naming the field, the value and the type expected."""
    def wrong() -> ConfigError:
        return ConfigError(f"{name}: expected {_TYPE_NAMES[t]}, got {value!r} ({type(value).__name__})")

    if t is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.strip().lower() in _TRUE + _FALSE:
            return value.strip().lower() in _TRUE
        if isinstance(value, int) and value in (0, 1):
            return bool(value)
        raise wrong()
    if t is str:
        if isinstance(value, str):
            return value
        raise wrong()
    if isinstance(value, bool):  # True is an int to Python, not a number to a user
        raise wrong()
    if t is int:
        if isinstance(value, int):
            return value
        if isinstance(value, str):
            try:
                return int(value.strip())
            except ValueError:
                raise wrong() from None
        raise wrong()
    if isinstance(value, (int, float)):
        value = float(value)
    elif isinstance(value, str):
        try:
            value = float(value.strip())
        except ValueError:
            raise wrong() from None
    else:
        raise wrong()
    if not math.isfinite(value):
        raise ConfigError(f"{name}: expected a finite number, got {value!r}")
    return value


def check_value(name: str, value: Any, t: type, meta) -> Any:
    """One scalar (or list item) of field `name`: typed, then checked against its range, emptiness and choices."""
    value = _typed(name, value, t)
    if t in (int, float) and not _in_range(value, meta):
        raise ConfigError(f"{name} must be {_range_phrase(meta)}, got {value!r}")
    if meta.get("nonempty") and value == "":
        raise ConfigError(f"{name} must not be empty")
    choices = meta.get("choices")
    if choices and value not in choices:
        raise ConfigError(f"{name} must be one of {choices}, got {value!r}")
    return value


def parse_link(text: str, name: str = "emulate_link") -> tuple[float, float] | None:
    """'GBPS[:LATENCY_MS]' (gigabits per second, milliseconds) -> (gbps, latency_ms); '' -> None."""
    text = text.strip()
    if not text:
        return None
    gbps, _, latency = text.partition(":")
    try:
        value = (float(gbps), float(latency) if latency else 0.0)
    except ValueError:
        value = (math.nan, math.nan)
    if not (math.isfinite(value[0]) and value[0] > 0 and math.isfinite(value[1]) and value[1] >= 0):
        raise ConfigError(f"{name}: expected GBPS[:LATENCY_MS] (gigabits per second > 0, milliseconds >= 0; e.g. "
                          f"0.1:5), got {text!r}")
    return value


def check_table(name: str, value: Any) -> dict:
    """A table field: a TOML table {key: value}, or KEY=VALUE strings (the command line); keys are strings,
    values numbers or strings (the field's user checks what they mean)."""
    if isinstance(value, str):
        value = [value]
    if isinstance(value, (list, tuple)):
        table = {}
        for item in value:
            key, eq, val = str(item).rpartition("=")
            if not eq or not key:
                raise ConfigError(f"{name}: expected KEY=VALUE, got {item!r}")
            table[key] = val
        value = table
    if not isinstance(value, dict):
        raise ConfigError(f"{name}: expected a table (KEY = VALUE), got {value!r} ({type(value).__name__})")
    for key, val in value.items():
        if isinstance(val, (dict, list, bool)) or not isinstance(val, (int, float, str)):
            raise ConfigError(f"{name}: the value of {key!r} must be a number, got {val!r}")
    return {str(k): v for k, v in value.items()}


def _range_phrase(meta) -> str:
    text = range_text(meta)
    return f"in {text}" if text[0] in "[(" else text


# -- TOML ------------------------------------------------------------------------------------------------------

_HEADER = re.compile(r"^\s*\[\s*([A-Za-z0-9_.\-\"' ]+?)\s*\]\s*(#.*)?$")
_KEY = re.compile(r"^\s*[\"']?([A-Za-z0-9_\-]+)[\"']?\s*=")


def read_toml(path) -> tuple[dict, dict]:
    """(parsed TOML, {(section or None, key): line}) of a config file; errors name the file (and line)."""
    p = Path(path)
    try:
        raw = p.read_bytes()
    except FileNotFoundError:
        raise ConfigError(f"config file not found: {path}") from None
    except IsADirectoryError:
        raise ConfigError(f"{path}: is a directory, expected a TOML config file") from None
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        line = raw.count(b"\n", 0, e.start) + 1
        raise ConfigError(f"{path}:{line}: not UTF-8 text (invalid byte 0x{raw[e.start]:02x} at byte offset "
                          f"{e.start})") from None
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        msg = str(e)
        at = re.search(r"\s*\(at line (\d+), column (\d+)\)$", msg)
        if at:
            where, msg = f"{path}:{at.group(1)}:{at.group(2)}", msg[:at.start()]
        elif msg.endswith("(at end of document)"):
            where, msg = f"{path}:{text.count(chr(10)) + 1}", msg[:-len("(at end of document)")].rstrip()
        else:
            where = str(path)
        raise ConfigError(f"{where}: invalid TOML: {msg}") from None
    return data, key_lines(text)


def key_lines(text: str) -> dict:
    """{(section or None, key): 1-based line} of the simple `key = value` lines of a TOML text (best effort:
    only used to point at a line in error messages)."""
    lines, section = {}, None
    for n, line in enumerate(text.splitlines(), 1):
        if (m := _HEADER.match(line)) and not line.lstrip().startswith("[["):
            section = m.group(1).strip("\"' ")
            lines.setdefault((None, section), n)  # the header line of a section
        elif m := _KEY.match(line):
            lines.setdefault((section, m.group(1)), n)
    return lines
