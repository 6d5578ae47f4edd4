"""A run's model, resolved once, by one function that the preflight and the trainer both call.

What a training or fine-tuning run trains: the checkpoint it resumes (if any), the model config (the resumed
checkpoint's, --base's, or the named config with its vocabulary set), its tokenizer, and what messages call it.
The rules, in order:

  - resumed (`--resume`): the checkpoint's train state (its step within --steps, the settings a resumed run keeps:
    checkpointing.check_resumable), its model config and its tokenizer;
  - `--base DIR` (a tpzoo checkpoint or a Hugging Face directory): its config; the tokenizer is --tokenizer, else
    the one saved in DIR, else the byte tokenizer;
  - a named config (`--model`): its vocabulary is --vocab-size, else the tokenizer's size;
  - whether it trains LoRA adapters, and on which base (lora_setup.lora_of_run: the flags, --lora-from, or the
    resumed run's);
  - then every registered layer kind sets the run's settings it takes (models/kinds: `run_settings`, e.g. the
    sigmoid router's --router-bias-update-rate and --router-aux-loss-coef, frozen under LoRA), or refuses one the
    model cannot take.

The preflight runs before any rank starts and does not load the tokenizer (`load_tokenizer=False`): a named config
then keeps its own vocabulary unless --vocab-size sets it (the tokenizer's size is not known without loading it,
and nothing needs comparing: the trainer sets the vocabulary to it).
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from tpzoo.checkpoint.format import is_checkpoint, read_manifest
from tpzoo.data.tokenizer import has_tokenizer, load_tokenizer as load
from tpzoo.errors import ConfigError
from tpzoo.models import ModelConfig, from_hf_config, get_config
from tpzoo.models.registry import CHANNEL_MIXERS, TOKEN_MIXERS

from . import checkpointing as ckpt
from . import lora_setup

FIND = "find"  # resolve_run_model's default: find the checkpoint to resume from the run's settings


@dataclass
class RunModel:
    config: ModelConfig
    tokenizer_spec: str             # the resumed checkpoint, --tokenizer, --base's directory, or "byte"
    label: str                      # what the run's messages call the model
    resume: Path | None = None      # the checkpoint resumed (None: a fresh run)
    state: dict | None = None       # its train_state.json
    tokenizer: object = None        # the tokenizer itself, when resolve_run_model loaded it
    fixed_vocab: bool = True        # the vocabulary is set apart from the tokenizer (which must then fit it)
    lora: object = None             # the LoRAConfig of a run that trains adapters (tpzoo/train/lora_setup.py), else None
    lora_base: str | None = None    # and the base it trains them on


def model_config_of(path) -> ModelConfig:
    """The ModelConfig of a tpzoo checkpoint or a Hugging Face model directory."""
    if is_checkpoint(path):
        return ModelConfig.from_dict(read_manifest(path)["model_config"])
    return from_hf_config(path)


def model_label(cfg, model_cfg: ModelConfig, resume=None) -> str:
    """What a run's messages call its model (the header, the preflight's errors): the named config, else the model
    of --base or of the checkpoint resumed, by its name or family, with the path it comes from."""
    kind = model_cfg.name or model_cfg.family
    if resume is not None:
        return f"model {kind} from checkpoint {resume}"
    if cfg.base:
        return f"model {kind} from --base {cfg.base}"
    return f"model {cfg.model}"


def resolve_run_model(cfg, resume=FIND, load_tokenizer: bool = True, say=None) -> RunModel:
    """The model of the run `cfg` (a TrainConfig) by the rules above. `resume`: the checkpoint to resume, as the
    run directory decided it (tpzoo.train.rundir.claim), or None; by default it is found from cfg.resume (skipped
    checkpoints reported through `say`, else not at all)."""
    if resume == FIND:
        resume = ckpt.resolve_resume(cfg, say=say or (lambda _msg: None)) if cfg.resume else None
    state = None
    if resume is not None:
        state = ckpt.read_train_state(resume)
        step = state.get("step")
        if isinstance(step, int) and step > cfg.steps:
            raise ConfigError(f"checkpoint {resume} is at step {step}, past --steps {cfg.steps}")
        ckpt.check_resumable(cfg, state, resume)
        model_cfg, spec = model_config_of(resume), str(resume)
    elif cfg.base:
        base = Path(cfg.base)
        if not base.exists():
            raise FileNotFoundError(f"--base {cfg.base}: no such checkpoint or Hugging Face model directory")
        model_cfg = model_config_of(base)
        spec = cfg.tokenizer or (cfg.base if base.is_dir() and has_tokenizer(base) else "byte")
    else:
        model_cfg, spec = get_config(cfg.model), cfg.tokenizer or "byte"
    tokenizer = load(spec) if load_tokenizer else None
    named = resume is None and not cfg.base
    fixed_vocab = not named or bool(cfg.vocab_size)
    if named and (cfg.vocab_size or tokenizer is not None):
        model_cfg = model_cfg.replace(vocab_size=cfg.vocab_size or tokenizer.vocab_size)
    lora, lora_base = lora_setup.lora_of_run(cfg, resume)
    for kind in {**TOKEN_MIXERS, **CHANNEL_MIXERS}.values():  # each kind sets (or refuses) the run's settings it takes
        if hasattr(kind, "run_settings"):
            model_cfg = kind.run_settings(model_cfg, cfg, lora=lora is not None)
    if tokenizer is not None and tokenizer.vocab_size > model_cfg.vocab_size:
        raise ConfigError(f"tokenizer has {tokenizer.vocab_size} tokens but the model's vocabulary is "
                          f"{model_cfg.vocab_size}")
    return RunModel(model_cfg, spec, model_label(cfg, model_cfg, resume), resume, state, tokenizer, fixed_vocab, lora,
                    lora_base)
