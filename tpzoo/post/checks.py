"""The preflight of the post-training objectives (tpzoo.train.preflight calls it before any rank starts): the
data file as the objective reads it, the teacher against the student, K against the vocabulary. Each failure is
the one-line UserError the ranks would raise later, so nothing is written."""
from __future__ import annotations

from pathlib import Path

from tpzoo.errors import ConfigError, DataError


def _data_file(cfg) -> Path:
    path = Path(cfg.data[0])
    if not path.is_file():
        raise FileNotFoundError(f"data file does not exist: {path}" if not path.exists() else f"{path}: not a file")
    return path


def check_dpo(cfg) -> None:
    from .dpo_data import load_pair_records

    path = _data_file(cfg)
    records = load_pair_records(path)  # every pair validated: a missing 'rejected' names its line
    if cfg.template == "raw" and any(not isinstance(r["chosen"], str) for r in records):
        raise DataError(f"{path}: template 'raw' takes prompt/chosen/rejected strings, and this file has "
                        f"conversations (use --template auto or fallback)")


def check_distill(cfg, model_cfg, tp: int, pp: int) -> None:
    """The teacher (a checkpoint, a Hugging Face directory or a cache) against the student's vocabulary and K."""
    from tpzoo.data.sft import load_sft_records
    from tpzoo.train.run_model import model_config_of
    from tpzoo.train.preflight import check_layout

    from .teacher_cache import is_teacher_cache, read_index

    load_sft_records(_data_file(cfg))
    teacher = Path(cfg.teacher)
    if not teacher.exists():
        raise FileNotFoundError(f"--teacher {cfg.teacher}: no such checkpoint, Hugging Face model directory or "
                                f"teacher cache")
    if is_teacher_cache(teacher):
        meta = read_index(teacher)
        vocab, what, k_max = meta["vocab_size"], f"the teacher cache {teacher}", meta["topk"]
    else:
        teacher_cfg = model_config_of(teacher)
        vocab, what, k_max = teacher_cfg.vocab_size, f"teacher {teacher}", teacher_cfg.vocab_size
        check_layout(teacher_cfg, tp, pp, 1, what)
    if vocab != model_cfg.vocab_size:
        raise ConfigError(f"{what} has a vocabulary of {vocab}, the student {model_cfg.vocab_size}: distillation "
                          f"needs a teacher with the student's tokenizer")
    if cfg.distill_topk > vocab:
        raise ConfigError(f"--distill-topk {cfg.distill_topk} is larger than the vocabulary ({vocab})")
    if cfg.distill_topk > k_max:
        raise ConfigError(f"--distill-topk {cfg.distill_topk}: {what} holds the top {k_max}")


def check_objective(cfg, model_cfg) -> None:
    """A DPO / distillation run's data and teacher (the next-token objective's data: tpzoo.train.preflight)."""
    if cfg.objective == "dpo":
        check_dpo(cfg)
    elif cfg.objective == "distill":
        check_distill(cfg, model_cfg, cfg.tp, cfg.pp)


def check_dpo_eval(args) -> None:
    """`tpzoo eval --objective dpo`: the pairs file, the settings, and a reference (--reference, or a LoRA
    checkpoint's base)."""
    from types import SimpleNamespace

    from tpzoo.checkpoint.lora_io import lora_info

    from .dpo import DPOSettings

    if not args.data:
        raise ConfigError("--objective dpo needs --data PAIRS.jsonl (preference pairs)")
    try:
        DPOSettings(args.dpo_beta, args.dpo_loss, args.dpo_label_smoothing)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    check_dpo(SimpleNamespace(data=[args.data], template=args.template))
    if args.reference:
        if not Path(args.reference).exists():
            raise FileNotFoundError(f"--reference {args.reference}: no such checkpoint or Hugging Face directory")
    elif not Path(args.ckpt).exists() or lora_info(args.ckpt) is None:
        raise ConfigError(f"--objective dpo: {args.ckpt} is not a LoRA checkpoint, so its reference must be given "
                          f"(--reference, the model DPO started from)")
