"""`tpzoo distill-cache --teacher CKPT --data sft.jsonl --out DIR [--distill-topk K]`: a teacher's top K, once.

    tpzoo distill-cache --teacher runs/teacher/step_00001000 --data sft.jsonl --out runs/teacher-top8 --tp 2
    tpzoo finetune --base student/ --data sft.jsonl --objective distill --teacher runs/teacher-top8

Runs the teacher (a tpzoo checkpoint at any layout or a Hugging Face directory) forward over every record of the SFT
file, at its own layout (--tp, --pp; spawns tp*pp ranks, extra torchrun ranks are data parallel), and writes the K
most likely token ids and their log-probabilities of every trained (response) position, memory-mapped
(tpzoo.post.teacher_cache). A fine-tune then reads them instead of holding the teacher beside the student. Give
the --seq-len, --template and tokenizer the fine-tune will use (the cache covers runs up to its seq_len).
"""
from __future__ import annotations

import argparse
import datetime
import json


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--teacher", required=True, help="teacher: a tpzoo checkpoint or a Hugging Face model directory")
    p.add_argument("--data", required=True, help="SFT JSONL file ({prompt, response} or {messages} records)")
    p.add_argument("--out", required=True, help="the cache directory to write (must not exist)")
    p.add_argument("--distill-topk", type=int, default=8, help="token ids kept per position (default 8)")
    p.add_argument("--seq-len", type=int, default=1024,
                   help="tokens per sequence, as the fine-tune's --seq-len or more (default 1024)")
    p.add_argument("--template", default="auto", choices=["auto", "fallback", "raw"],
                   help="SFT rendering, as the fine-tune's --template (default auto)")
    p.add_argument("--tokenizer", help="the student's tokenizer (default: the teacher's)")
    p.add_argument("--micro-batch-size", type=int, default=4, help="sequences per forward (default 4)")
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel size (default 1)")
    p.add_argument("--pp", type=int, default=1, help="pipeline-parallel size (default 1)")
    p.add_argument("--dtype", default="auto", choices=["auto", "fp32", "bf16", "fp16"],
                   help="the teacher's dtype (default: the checkpoint's)")
    p.add_argument("--device", default="auto", help="auto (cuda:LOCAL_RANK with CUDA, else cpu), cpu, cuda, cuda:N")
    p.add_argument("--dist-timeout", type=float, default=600.0,
                   help="seconds a rank may wait on another before the job fails naming it (default 600)")


def check(args, world_size: int | None = None) -> None:
    """Before any rank starts: sizes, the destination, the data file, the teacher's config against the layout and K."""
    from pathlib import Path

    from tpzoo.data.sft import load_sft_records
    from tpzoo.errors import ConfigError
    from tpzoo.post.teacher_cache import check_out_dir
    from tpzoo.train.run_model import model_config_of
    from tpzoo.train.preflight import check_device, check_layout, check_tokenizer

    for name in ("distill_topk", "seq_len", "micro_batch_size", "tp", "pp"):
        if getattr(args, name) < 1:
            raise ConfigError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    check_out_dir(args.out)
    if not Path(args.teacher).exists():
        raise FileNotFoundError(f"--teacher {args.teacher}: no such checkpoint or Hugging Face model directory")
    if world_size is not None and world_size % (args.tp * args.pp):
        raise ConfigError(f"world size {world_size} is not a multiple of tp * pp = {args.tp * args.pp}")
    check_device(args.device)
    load_sft_records(args.data)
    cfg = model_config_of(args.teacher)
    what = f"teacher {args.teacher}"
    check_layout(cfg, args.tp, args.pp, 1, what)
    if args.distill_topk > cfg.vocab_size:
        raise ConfigError(f"--distill-topk {args.distill_topk} is larger than the vocabulary of {what} "
                          f"({cfg.vocab_size})")
    if args.tokenizer:
        check_tokenizer(args.tokenizer, cfg.vocab_size, what)


def _worker(args) -> None:
    import tpzoo
    from tpzoo.checkpoint import parse_dtype
    from tpzoo.post.cache_writer import write_teacher_cache

    dims = tpzoo.init_parallel(tp=args.tp, pp=args.pp, device=args.device,
                               timeout=datetime.timedelta(seconds=args.dist_timeout))
    try:
        meta = write_teacher_cache(args.teacher, args.data, args.out, k=args.distill_topk, seq_len=args.seq_len,
                                   template=args.template, tokenizer=args.tokenizer, dims=dims,
                                   dtype=parse_dtype(args.dtype), micro_batch_size=args.micro_batch_size)
        if dims.rank == 0:
            print(json.dumps({"out": str(args.out), **{k: meta[k] for k in ("records", "positions", "topk",
                                                                             "bytes_per_position")}}), flush=True)
    finally:
        tpzoo.destroy_parallel()


def run(args) -> int:
    from tpzoo.train.preflight import in_rank

    from .launch import run_multirank, under_torchrun

    if under_torchrun():
        return run_multirank(in_rank(check, _worker), args, 1, "distill-cache")
    check(args)
    return run_multirank(_worker, args, args.tp * args.pp, "distill-cache")
