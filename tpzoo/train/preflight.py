"""Preflight: check a run against its model, its layout and its files before any rank starts.

A multi-rank command that fails inside its ranks has already paid for starting them (a minute for eight ranks on
a small machine) and may fail on one rank after the others have built models. Everything that can be known from
the command line, the config and a few small files is therefore checked first, in the launching process (or,
under torchrun, on every rank before the process groups exist: the first rank's error is the job's one line):

  - the config's field combinations (TrainConfig.validate: batch divisibility, min_lr <= lr, schedule,
    sequence parallelism against seq_len, the world size under torchrun);
  - the model config, parsed only (never the weights): the named config, the --base / --resume checkpoint's
    manifest, or a Hugging Face config.json; a corrupt one is named;
  - the layout against the model: tp divides the heads and the FFN, kv heads divide by tp or tp by them,
    pp * virtual_stages <= layers, Streaming DiLoCo's fragments <= layers; learned positions cover seq_len; the tokenizer fits the vocabulary (when its
    size can be read without loading it);
  - the files: data paths exist, named files are not empty, an SFT file parses and validates record by record
    (file:line), eval's text file is UTF-8 (file and byte offset), the checkpoint to resume parses.

Each check raises the UserError that the ranks would raise later, so a run that passes preflight fails inside
its ranks only for what cannot be known before (a corrupt tensor, a dead rank, a full disk). It takes about a
second for a tiny config (docs/reliability.md).
"""
from __future__ import annotations

from pathlib import Path

from tpzoo.errors import ConfigError, DataError

from . import optimizers

__all__ = ["check_train", "check_eval", "check_generate", "check_layout"]


# -- shared checks -----------------------------------------------------------------------------------------------

def check_layout(model_cfg, tp: int, pp: int, virtual_stages: int = 1, what: str = "the model",
                 ep: int = 1, boundaries: list | None = None) -> None:
    """The model splits over tp (each layer kind's own check: heads, kv heads, hidden units...), pp *
    virtual_stages stages and ep (experts); errors name `what` and are the types the ranks would raise
    (ParallelLayoutError, PartitionError). The layout against the world size is tpzoo.parallel.dims.check_layout's
    (TrainConfig.data_parallel_size, _check_checkpoint)."""
    from tpzoo.pipeline import partition_layers
    from tpzoo.quant import check_split
    from tpzoo.pipeline.partition import PartitionError

    check_experts(model_cfg, ep, what)
    check_kinds(model_cfg, tp, 1, ep, what)
    check_split(model_cfg, tp)  # a kept-quantized model: along whole blocks
    try:
        partition_layers(model_cfg, pp, boundaries or None, virtual_stages=virtual_stages)
    except PartitionError as e:
        raise PartitionError(f"{what}: {e}") from None


def check_kinds(model_cfg, tp: int, cp: int, ep: int, what: str) -> None:
    """Each layer kind of the model splits at (tp, cp, ep): the kind's own check (models/kinds check_parallel),
    the one its build on the ranks runs, asked here before any rank starts."""
    from tpzoo.models.registry import distinct_kinds
    from tpzoo.parallel.dims import ParallelLayoutError

    for i, kind in distinct_kinds(model_cfg):
        try:
            kind.check_parallel(model_cfg, i, tp, cp, ep)
        except ParallelLayoutError as e:
            raise ParallelLayoutError(f"{what}: {e}") from None


def check_context(model_cfg, tp: int, cp: int, mode: str, what: str = "the model") -> None:
    """Context parallelism against the model: all-to-all splits each TP rank's heads over cp; the ring's blockwise
    attention has no softcapping; each kind's own split over cp (Gated DeltaNet's key heads)."""
    from tpzoo.parallel.dims import ParallelLayoutError

    if cp == 1:
        return
    if mode == "a2a" and (model_cfg.num_heads // tp) % cp:
        raise ParallelLayoutError(f"{what}: --cp-mode a2a needs the {model_cfg.num_heads // tp} heads per TP rank "
                                  f"(num_heads {model_cfg.num_heads} / tp {tp}) divisible by cp={cp}; use "
                                  f"--cp-mode ring")
    if mode == "ring" and model_cfg.attn_softcap is not None:
        raise ParallelLayoutError(f"{what}: attention softcapping runs with --cp-mode a2a, not ring")
    check_kinds(model_cfg, tp, cp, 1, what)


def check_experts(model_cfg, ep: int, what: str) -> None:
    """Expert parallelism against the model: ep is a positive integer, and > 1 only on a mixture of experts (the
    MoE kind's own check says whether it divides the experts; ep against the data x context parallel ranks is the
    world size's check, tpzoo.parallel.dims.check_layout)."""
    from tpzoo.parallel.dims import ParallelLayoutError

    if not isinstance(ep, int) or ep < 1:
        raise ParallelLayoutError(f"--ep must be a positive integer, got {ep!r}")
    if ep > 1 and not model_cfg.num_experts:
        raise ParallelLayoutError(f"{what}: ep={ep} needs a mixture-of-experts model (this one has no experts)")


def check_device(name: str) -> None:
    """The device string parses, and CUDA exists when asked for: the runtime's own choice, made here early (the
    ranks choose again, each with its LOCAL_RANK)."""
    from tpzoo.parallel.device import resolve_device

    resolve_device(name)


def check_positions(model_cfg, seq_len: int, what: str) -> None:
    if model_cfg.position == "learned" and seq_len > model_cfg.max_position_embeddings:
        raise ConfigError(f"{what}: seq_len {seq_len} exceeds the model's max_position_embeddings "
                          f"{model_cfg.max_position_embeddings} (learned positions)")


def _written_as_path(spec: str) -> bool:
    """A spec written as a path; "owner/name" may be a cached hub tokenizer, which only loading can tell."""
    return spec.startswith(("/", "./", "../", "~"))


def check_tokenizer(spec: str, model_vocab: int | None, what: str) -> None:
    """A tokenizer spec that names a local directory has a tokenizer in it; its size (when readable cheaply)
    fits the model's vocabulary."""
    from tpzoo.data.tokenizer import has_tokenizer, peek_vocab_size

    path = Path(spec).expanduser()
    if spec != "byte" and not path.exists() and _written_as_path(spec):
        raise FileNotFoundError(f"tokenizer {spec}: no such directory")
    if path.is_dir() and not has_tokenizer(path):
        raise FileNotFoundError(f"no tokenizer in directory {path}")
    size = peek_vocab_size(spec)
    if size is not None and model_vocab is not None and size > model_vocab:
        raise ConfigError(f"tokenizer {spec} has {size} tokens but {what} has a vocabulary of {model_vocab}")


def check_text_file(path: str, what: str = "text file") -> None:
    """Exists, is not empty, and is UTF-8 (the error names the byte offset and line of the first bad byte)."""
    from tpzoo.data.sources import utf8_error

    p = Path(path)
    if not p.is_file():
        raise FileNotFoundError(f"{what} does not exist: {path}" if not p.exists() else f"{path}: not a file")
    raw = p.read_bytes()
    if not raw:
        raise DataError(f"{path}: empty file")
    try:
        raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise DataError(utf8_error(path, raw, e)) from None


# -- training ----------------------------------------------------------------------------------------------------

def _check_pretrain_data(cfg) -> None:
    """The --data paths (or each source of a weighted mixture, which is one corpus each): token stores and
    Megatron datasets open (a missing .idx, a truncated .bin ... named), text sources exist and are not empty."""
    from tpzoo.data.mixture import parse_mixture

    mixture = parse_mixture(cfg.data, cfg.mix)  # malformed weights / pairs: one line (also TrainConfig.validate)
    corpora = [[s.path] for s in mixture] if mixture else [cfg.data] if cfg.data else []
    for specs in corpora:  # no data: the stdlib corpus
        _check_corpus(specs)


def _check_corpus(specs: list[str]) -> None:
    from tpzoo.data.sources import SUPPORTED_SUFFIXES, expand_paths, is_local_spec
    from tpzoo.data.token_store import is_token_store, open_store

    if len(specs) == 1 and is_token_store(specs[0]):
        open_store(specs[0])  # a tpzoo store or a Megatron dataset, as the ranks will open it
        return
    stores = [s for s in specs if is_token_store(s)]
    if stores:
        raise DataError(f"{stores[0]} is already tokenized and cannot be concatenated with other data: give each "
                        f"corpus a weight (--data WEIGHT PATH ...)")
    files = []
    for spec in specs:
        if spec.startswith("hf:") or not is_local_spec(spec):
            continue  # a hub dataset: only the ranks can reach it
        found = expand_paths([spec])  # FileNotFoundError naming a missing path
        if not found:
            idx = sorted(Path(spec).glob("*.idx")) if Path(spec).is_dir() else []
            hint = f"; it holds Megatron datasets: give their prefixes, e.g. {str(idx[0])[:-4]}" if idx else ""
            raise DataError(f"{spec}: no data files under it (looked for {', '.join(SUPPORTED_SUFFIXES)}){hint}")
        if Path(spec).is_file() and found[0].stat().st_size == 0:
            raise DataError(f"{spec}: empty file")
        files += found
    if files and all(f.stat().st_size == 0 for f in files):
        raise DataError(f"no text to train on: every data file is empty ({len(files)} files under {specs})")


def _check_sft_data(cfg) -> None:
    from tpzoo.data.sft import load_sft_records

    path = Path(cfg.data[0])
    if not path.is_file():
        raise FileNotFoundError(f"SFT data file does not exist: {path}" if not path.exists()
                                else f"{path}: not a file (SFT data is one JSONL file)")
    records = load_sft_records(path)  # every record parsed and validated: errors name file:line
    if cfg.template == "raw" and any("messages" in r for r in records):
        raise DataError(f"{path}: template 'raw' takes prompt/response records, and this file has 'messages' "
                        f"records (use --template auto or fallback)")


def check_train(cfg, world_size: int | None = None):
    """Everything about a training run that can be checked before its ranks start; returns the model config.
    world_size: the job's size under torchrun (None when this process will spawn the ranks)."""
    cfg.validate(world_size)
    check_device(cfg.device)
    from .run_model import resolve_run_model

    run = resolve_run_model(cfg, load_tokenizer=False)  # the trainer's rules, from files only (run_model.py)
    model_cfg, label = run.config, run.label
    check_layout(model_cfg, cfg.tp, cfg.pp, cfg.virtual_stages, label, ep=cfg.ep, boundaries=cfg.pp_boundaries)
    check_context(model_cfg, cfg.tp, cfg.cp, cfg.cp_mode, label)
    check_positions(model_cfg, cfg.seq_len, label)
    if cfg.sync_fragments > model_cfg.num_layers:  # Streaming DiLoCo's fragments are groups of layers
        raise ConfigError(f"sync_fragments={cfg.sync_fragments} is more than the {model_cfg.num_layers} layers of "
                          f"{label}")
    check_tokenizer(run.tokenizer_spec, model_cfg.vocab_size if run.fixed_vocab else None, label)
    check_lora(cfg, model_cfg, run.lora, resumed=run.resume is not None)
    optimizers.check(cfg, model_cfg, label)  # --optimizer muon, --qk-clip
    if cfg.objective != "lm":  # DPO's pairs, a distillation teacher (tpzoo.post)
        from tpzoo.post.checks import check_objective

        check_objective(cfg, model_cfg)
    elif cfg.task == "sft":
        _check_sft_data(cfg)
    else:
        _check_pretrain_data(cfg)
    return model_cfg


def check_lora(cfg, model_cfg, lcfg, resumed: bool = False) -> None:
    """LoRA settings against the model (`lcfg`: the run's adapter config, None without LoRA: run_model.py, which
    also found its base): a full run of a kept-quantized base is refused, the adapters' targets must exist (the
    routed experts too, with --lora-experts), PEFT must be able to hold them as configured (models/lora_peft.py:
    dropout on an MLP that PEFT reads as the experts is refused now, not at the export), and a --lora-from adapter
    must hold nothing the run would drop. A resumed run keeps what it was started with."""
    from tpzoo.checkpoint.peft import unused_peft_keys
    from tpzoo.models import ModelLayout, Transformer
    from tpzoo.models.lora import add_lora
    from tpzoo.models.lora_peft import check_exportable
    from tpzoo.parallel import ParallelDims
    from tpzoo.quant import refuse_full_training

    if lcfg is None:
        refuse_full_training(model_cfg, f"--base {cfg.base}" if cfg.base else "the model")
        return
    model = Transformer(model_cfg, ModelLayout(ParallelDims.for_rank(), device="meta"))
    add_lora([model], lcfg)  # (checks the targets)
    if resumed:
        return
    check_exportable(model, lcfg)
    if cfg.lora_from:
        unused = unused_peft_keys(model, cfg.lora_from)
        if unused:
            raise ConfigError(f"--lora-from {cfg.lora_from}: {len(unused)} adapter tensors would not be read (e.g. "
                              f"{unused[0]}): tpzoo adapts no such module of {model_cfg.name or model_cfg.family}")


# -- eval and generate -------------------------------------------------------------------------------------------

def _positive(args, *names: str, allow_zero: tuple = ()) -> None:
    for name in names:
        value = getattr(args, name, None)
        low = 0 if name in allow_zero else 1
        if value is not None and value < low:
            raise ConfigError(f"--{name.replace('_', '-')} must be >= {low}, got {value}")


def _check_checkpoint(args, world_size: int | None):
    """The parts eval and generate share: sizes, device, the checkpoint's config and the layout against it."""
    from tpzoo.checkpoint import open_source
    from tpzoo.parallel.dims import check_layout as check_world

    _positive(args, "tp", "pp", "cp", "ep")
    cp = getattr(args, "cp", 1)  # eval has --cp; generate runs at cp=1
    if not args.dist_timeout > 0:
        raise ConfigError(f"--dist-timeout must be > 0 seconds, got {args.dist_timeout}")
    if world_size is not None:  # (self-spawned: tp*cp*pp*ep ranks, dp = ep, which always fits)
        check_world(world_size, tp=args.tp, pp=args.pp, cp=cp, ep=args.ep)  # what init_parallel will check
    check_device(args.device)
    source = open_source(args.ckpt, verify=False)  # the manifest or config.json, and the weight headers
    try:
        model_cfg = source.cfg
    finally:
        source.close()
    what = f"checkpoint {args.ckpt}"
    check_layout(model_cfg, args.tp, args.pp, 1, what, ep=args.ep)
    check_context(model_cfg, args.tp, cp, getattr(args, "cp_mode", "ring"), what)
    if args.tokenizer:
        check_tokenizer(args.tokenizer, model_cfg.vocab_size, what)
    return model_cfg, what


def check_eval(args, world_size: int | None = None) -> None:
    _positive(args, "batch_size", "seq_len", "max_tokens")
    if getattr(args, "objective", "lm") == "dpo":  # preference pairs (tpzoo.post.checks)
        from tpzoo.post.checks import check_dpo_eval

        check_dpo_eval(args)
    elif not args.text_file:
        raise ConfigError("--text-file is required (or --objective dpo --data PAIRS.jsonl)")
    else:
        check_text_file(args.text_file, "--text-file")  # before the checkpoint: it is the cheaper of the two
    model_cfg, what = _check_checkpoint(args, world_size)
    if args.seq_len:
        check_positions(model_cfg, args.seq_len, what)


def check_generate(args, world_size: int | None = None) -> None:
    model_cfg, what = _check_checkpoint(args, world_size)
    if getattr(args, "draft", "none") == "mtp":
        if model_cfg.mtp is None:
            raise ConfigError(f"--draft mtp: the {what} has no multi-token-prediction layers to draft with")
        if args.sequence_parallel:
            raise ConfigError("--draft mtp decodes with caches: drop --sequence-parallel")
    _positive(args, "max_new_tokens", "top_k", allow_zero=("max_new_tokens", "top_k"))
    if not 0 < args.top_p <= 1:
        raise ConfigError(f"--top-p must be in (0, 1], got {args.top_p}")
    if args.temperature is not None and not args.temperature > 0:
        raise ConfigError(f"--temperature must be > 0, got {args.temperature} (for argmax decoding use --greedy)")


def in_rank(check, fn):
    """fn preceded by check(args, world_size), for a rank under torchrun: the check runs before the process
    groups exist, and its error is reported once for the job like any rank's."""
    def checked(args):
        from tpzoo.parallel.state import job_world_size

        check(args, job_world_size())  # torchrun's WORLD_SIZE: the world init_parallel will join
        return fn(args)

    return checked
