"""Training configuration: documented dataclasses, loaded from TOML, every field overridable on the command line.

Precedence (later wins): the dataclass defaults < the command's defaults (`finetune` changes a few) < a TOML file
< `--flag value` on the command line. Field names are unique across sections, so a TOML file may use the
sections below or put any key at the top level, and each field is the flag `--field-name`:

    [parallel]                       # == tp = 2 at the top level == --tp 2
    tp = 2

The help text of every field lives in its metadata, so `--help`, docs/training.md's reference table
(`describe_config()`) and the code cannot disagree.
"""
from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass, field
from typing import Any

import tomllib

from tpzoo.errors import ConfigError


def _f(default, help: str, **kw):
    if isinstance(default, list):
        return field(default_factory=lambda: list(default), metadata={"help": help, **kw})
    return field(default=default, metadata={"help": help, **kw})


@dataclass
class RunSection:
    task: str = _f("pretrain", "'pretrain' (packed text corpus) or 'sft' (JSONL prompt/response or chat messages, "
                               "loss only on response tokens)", choices=("pretrain", "sft"))
    steps: int = _f(150, "total optimizer steps of the run (a resumed run continues to this total; it also sets "
                         "the LR schedule, so a resumed run follows the same curve)")
    seed: int = _f(1234, "seed for the weights (layout independent), the data order and sampling")
    max_skips: int = _f(5, "stop after this many consecutive steps skipped for a NaN/inf loss or grad norm "
                           "(the last good checkpoint is kept)")
    inject_nan_steps: list = _f([], "testing aid: make the loss scale NaN at these steps (1-based)", type=int)


@dataclass
class ModelSection:
    model: str = _f("tiny-gpt", "registered config name (tiny-gpt, tiny-llama, nano-gpt, llama-3-8b, ...); "
                                "ignored when --base gives the weights")
    vocab_size: int = _f(0, "vocabulary of a model trained from scratch; 0 = the tokenizer's vocab size")
    base: str = _f("", "initial weights: a tpzoo checkpoint or a Hugging Face model directory (fine-tuning, "
                       "continued pretraining); the model config and, unless --tokenizer, the tokenizer come "
                       "from it")
    dtype: str = _f("fp32", "'fp32', 'bf16' or 'fp16' (16-bit weights and activations; fp32 master weights, main "
                            "gradients and optimizer state; fp16 adds dynamic loss scaling)",
                    choices=("fp32", "bf16", "fp16"))


@dataclass
class ParallelSection:
    tp: int = _f(2, "tensor-parallel size")
    pp: int = _f(1, "pipeline-parallel size")
    dp: int = _f(0, "data-parallel size; 0 = world size / (tp * pp) under torchrun, 1 when self-spawning")
    sequence_parallel: bool = _f(False, "shard activations along the sequence between TP regions")
    schedule: str = _f("1f1b", "pipeline schedule (tpzoo.pipeline: gpipe, 1f1b, interleaved, ...)")
    virtual_stages: int = _f(1, "model chunks per pipeline rank (interleaved schedule)")
    recompute: str = _f("none", "activation recomputation: none | selective | full",
                        choices=("none", "selective", "full"))
    zero1: bool = _f(False, "ZeRO-1 distributed optimizer: optimizer state sharded over dp, gradients "
                            "reduce-scattered, updated weights all-gathered")
    device: str = _f("auto", "where each rank computes: auto (cuda:LOCAL_RANK when CUDA is available, else cpu), "
                             "cpu, cuda or cuda:N")
    dist_timeout: float = _f(600.0, "seconds a rank may wait on another (a collective, a stalled or dead rank) before "
                                    "the job fails naming the rank")


@dataclass
class DataSection:
    data: list = _f([], "pretrain: text/.jsonl/.parquet files, directories or a token store (default: the "
                        "Python standard library's .py files); sft: one JSONL file", type=str)
    tokenizer: str = _f("", "'byte', or a Hugging Face tokenizer / checkpoint directory; '' = the base's "
                            "tokenizer, else 'byte'")
    seq_len: int = _f(256, "tokens per training sequence")
    global_batch_size: int = _f(16, "sequences per optimizer step, over all data-parallel ranks")
    micro_batch_size: int = _f(8, "sequences per forward/backward; gradient accumulation runs "
                                  "global / (micro * dp) micro-batches per step")
    data_cache: str = _f("runs/data", "where corpora are tokenized once into token stores (reused by later runs)")
    text_field: str = _f("text", "JSONL field / Parquet column with the text (pretrain)")
    eval_fraction: float = _f(0.005, "held-out share: pretrain = the last windows of the corpus, sft = a seeded "
                                     "subset of the records")
    packing: bool = _f(True, "sft: pack examples into full sequences (else one padded example per sequence)")
    template: str = _f("auto", "sft rendering: auto (the tokenizer's chat template, else fallback) | fallback "
                               "| raw", choices=("auto", "fallback", "raw"))
    prefetch: int = _f(2, "batches prepared ahead on a background thread (0 = none)")


@dataclass
class OptimSection:
    lr: float = _f(3e-3, "peak learning rate")
    min_lr: float = _f(3e-4, "learning rate at the end of the cosine decay")
    warmup_steps: int = _f(15, "linear warmup steps")
    weight_decay: float = _f(0.1, "AdamW decoupled weight decay (matrices and embeddings; not norms or biases)")
    beta1: float = _f(0.9, "AdamW beta1")
    beta2: float = _f(0.95, "AdamW beta2")
    eps: float = _f(1e-8, "AdamW epsilon")
    clip_grad: float = _f(1.0, "clip the global gradient norm to this (0 = no clipping)")
    label_smoothing: float = _f(0.0, "cross-entropy label smoothing")


@dataclass
class CheckpointSection:
    save: str = _f("runs/pretrain", "checkpoint directory (step_NNNNNNNN subdirectories); '' = do not save")
    save_every: int = _f(0, "save every N steps (0 = only at the end)")
    keep_last: int = _f(3, "keep the newest K checkpoints (0 = keep all)")
    overwrite: bool = _f(False, "start a fresh run in a --save directory that already holds a run (its checkpoints "
                                "and metrics are moved aside, see docs/reliability.md)")
    resume: str = _f("", "'' = start fresh; 'latest' (or the bare flag) = newest checkpoint under --save; or "
                         "a checkpoint directory", nargs="?", const="latest")


@dataclass
class LogSection:
    log_dir: str = _f("", "write metrics.jsonl (and TensorBoard events if installed) here; '' = --save")
    log_interval: int = _f(10, "print a metrics line every N steps")
    eval_every: int = _f(0, "evaluate on the held-out split every N steps (0 = only at the end)")
    eval_batches: int = _f(4, "micro-batches per data-parallel rank in one evaluation")
    progress: bool = _f(True, "progress bar on rank 0 (when stderr is a terminal)")
    quiet: bool = _f(False, "print nothing (metrics.jsonl is still written)")
    sample_prompt: str = _f("def ", "prompt of the sample printed at the end ('' = no sample)")
    sample_tokens: int = _f(160, "tokens to generate for the sample")
    temperature: float = _f(0.8, "sampling temperature of the sample (0 = greedy)")


SECTIONS = {"run": RunSection, "model": ModelSection, "parallel": ParallelSection, "data": DataSection,
            "optim": OptimSection, "checkpoint": CheckpointSection, "log": LogSection}


class TrainConfig:
    """Every field of the sections above, read and written flat (`cfg.lr`, `cfg.set("lr", 1e-3)`); the
    sections only organize the TOML file and the docs. `cfg.section("optim")` is the OptimSection."""

    def __init__(self):
        object.__setattr__(self, "_sections", {name: cls() for name, cls in SECTIONS.items()})

    def __getattr__(self, name: str) -> Any:
        if name.startswith("_") or name not in _FIELD_SECTION:  # also keeps pickle's probes away
            raise AttributeError(f"TrainConfig has no field {name!r}")
        return getattr(self._sections[_FIELD_SECTION[name]], name)

    def __setattr__(self, name: str, value: Any) -> None:
        self.set(name, value)

    def __eq__(self, other) -> bool:
        return isinstance(other, TrainConfig) and self.to_dict() == other.to_dict()

    def __repr__(self) -> str:
        return f"TrainConfig({self.to_dict()})"

    def __getstate__(self) -> dict:
        return self.to_dict()

    def __setstate__(self, state: dict) -> None:
        object.__setattr__(self, "_sections", {name: cls() for name, cls in SECTIONS.items()})
        self.update(_flatten(state, "state"))

    def section(self, name: str):
        return self._sections[name]

    def set(self, name: str, value: Any) -> None:
        if name not in _FIELD_SECTION:
            raise ConfigError(f"unknown config key {name!r}; known: {', '.join(sorted(_FIELD_SECTION))}")
        setattr(self._sections[_FIELD_SECTION[name]], name, _coerce(name, value))

    def update(self, values: dict) -> "TrainConfig":
        for k, v in values.items():
            self.set(k.replace("-", "_"), v)
        return self

    def to_dict(self) -> dict:
        return {name: dataclasses.asdict(sec) for name, sec in self._sections.items()}

    def to_toml(self) -> str:
        lines = []
        for section, values in self.to_dict().items():
            lines.append(f"[{section}]")
            lines += [f"{k} = {_toml_value(v)}" for k, v in values.items()]
            lines.append("")
        return "\n".join(lines)

    @classmethod
    def from_dict(cls, d: dict) -> "TrainConfig":
        return cls().update(_flatten(d, "config"))


_FIELD_SECTION: dict[str, str] = {}
_FIELDS: dict[str, dataclasses.Field] = {}
for _section, _cls in SECTIONS.items():
    for _fld in dataclasses.fields(_cls):
        assert _fld.name not in _FIELD_SECTION, f"config field {_fld.name} is defined twice"
        _FIELD_SECTION[_fld.name], _FIELDS[_fld.name] = _section, _fld


def _field_type(f: dataclasses.Field) -> type:
    t = f.type if isinstance(f.type, type) else {"int": int, "float": float, "bool": bool, "str": str,
                                                  "list": list}[str(f.type)]
    return t


def _coerce(name: str, value: Any) -> Any:
    f = _FIELDS[name]
    t = _field_type(f)
    if t is list:
        items = value if isinstance(value, (list, tuple)) else [value]
        item_type = f.metadata.get("type", str)
        value = [item_type(v) for v in items]
    elif t is bool:
        if isinstance(value, str):
            if value.lower() not in ("1", "0", "true", "false", "yes", "no", "on", "off"):
                raise ConfigError(f"{name}: expected a boolean, got {value!r}")
            value = value.lower() in ("1", "true", "yes", "on")
        value = bool(value)
    elif t is float and isinstance(value, (int, str)) and not isinstance(value, bool):
        value = float(value)
    elif t is int and isinstance(value, str):
        value = int(value)
    elif not isinstance(value, t) or (t is int and isinstance(value, bool)):
        raise ConfigError(f"{name}: expected {t.__name__}, got {value!r}")
    choices = f.metadata.get("choices")
    if choices and value not in choices:
        raise ConfigError(f"{name} must be one of {choices}, got {value!r}")
    return value


def _flatten(d: dict, where: str) -> dict:
    """{"optim": {"lr": 1}, "seed": 3} -> {"lr": 1, "seed": 3}: sections are optional in TOML."""
    flat = {}
    for k, v in d.items():
        if k in SECTIONS and isinstance(v, dict):
            for kk, vv in v.items():
                if _FIELD_SECTION.get(kk) != k:
                    raise ConfigError(f"{where}: [{k}] has no key {kk!r}")
                flat[kk] = vv
        else:
            flat[k] = v
    return flat


def _toml_value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, str):
        return '"' + v.replace("\\", "\\\\").replace('"', '\\"') + '"'
    if isinstance(v, list):
        return "[" + ", ".join(_toml_value(x) for x in v) + "]"
    return repr(v)


def load_config(path: str | None = None, overrides: dict | None = None, defaults: dict | None = None) -> TrainConfig:
    """Defaults, then the command's `defaults`, then the TOML file at `path`, then `overrides` (flat keys)."""
    cfg = TrainConfig().update(defaults or {})
    if path:
        with open(path, "rb") as f:
            cfg.update(_flatten(tomllib.load(f), path))
    return cfg.update(overrides or {})


# -- command line -------------------------------------------------------------------------------------------

def add_config_arguments(p: argparse.ArgumentParser, defaults: dict | None = None) -> None:
    """`[CONFIG.toml]` plus one `--field-name` per field; only flags actually given end up in the namespace."""
    p.add_argument("config", nargs="?", help="TOML config file (optional); flags override it")
    p.add_argument("--print-config", action="store_true", help="print the effective config as TOML and exit")
    shown = TrainConfig().update(defaults or {})
    for section, cls in SECTIONS.items():
        group = p.add_argument_group(f"[{section}]")
        for f in dataclasses.fields(cls):
            flag = "--" + f.name.replace("_", "-")
            help_text = f"{f.metadata['help']} (default: {getattr(shown, f.name)!r})"
            kw: dict = {"dest": f.name, "default": argparse.SUPPRESS, "help": help_text.replace("%", "%%")}
            t = _field_type(f)
            if t is bool:
                kw["action"] = argparse.BooleanOptionalAction
            elif t is list:
                kw.update(nargs="+", type=f.metadata.get("type", str), metavar="V")
            else:
                kw["type"] = t
                if "nargs" in f.metadata:
                    kw.update(nargs=f.metadata["nargs"], const=f.metadata["const"])
                if "choices" in f.metadata:
                    kw["choices"] = f.metadata["choices"]
            group.add_argument(flag, **kw)


def config_from_args(args: argparse.Namespace, defaults: dict | None = None) -> TrainConfig:
    overrides = {k: v for k, v in vars(args).items() if k in _FIELD_SECTION}
    return load_config(getattr(args, "config", None), overrides, defaults)


def describe_config(defaults: dict | None = None) -> str:
    """A markdown reference of every field (docs/training.md embeds this table)."""
    shown = TrainConfig().update(defaults or {})
    out = ["| section | flag | default | meaning |", "|---|---|---|---|"]
    for section, cls in SECTIONS.items():
        for f in dataclasses.fields(cls):
            default = _toml_value(getattr(shown, f.name))
            out.append(f"| `[{section}]` | `--{f.name.replace('_', '-')}` | `{default}` | "
                       f"{f.metadata['help'].replace('|', '/')} |")
    return "\n".join(out)
