"""`tpzoo eval CKPT --text-file F`: next-token loss and perplexity of a text under the model, as one JSON line.

    tpzoo eval ckpt/ --text-file valid.txt --seq-len 512 --tp 2 --pp 2      # spawns 4 local CPU ranks
    torchrun --nproc-per-node 4 -m tpzoo eval ckpt/ --text-file valid.txt --tp 2 --pp 2

CKPT is a tpzoo checkpoint (any stored layout: it is resharded on load) or a Hugging Face model directory. The
tokenizer defaults to the one that travels with the checkpoint. Extra ranks under torchrun are data parallel.
A mixture of experts' loss is the language model's alone; its router losses come as router_aux_loss / router_z_loss.
"""
from __future__ import annotations

import argparse
import datetime
import json


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("ckpt", help="tpzoo checkpoint or HF model directory")
    p.add_argument("--text-file", required=True, help="UTF-8 text to evaluate on")
    p.add_argument("--tokenizer", help="tokenizer spec: a directory, 'byte', ... (default: the checkpoint's)")
    p.add_argument("--seq-len", type=int, help="tokens per window (default: min(1024, max positions))")
    p.add_argument("--batch-size", type=int, default=1, help="windows per forward (default 1)")
    p.add_argument("--max-tokens", type=int, help="evaluate only the first N tokens")
    p.add_argument("--bos", action="store_true", help="add the tokenizer's special tokens (e.g. BOS) in front")
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel size (default 1)")
    p.add_argument("--pp", type=int, default=1, help="pipeline-parallel size (default 1)")
    p.add_argument("--cp", type=int, default=1, help="context-parallel size: each rank holds 2 of the 2*cp "
                   "load-balanced chunks of every window (default 1)")
    p.add_argument("--cp-mode", default="ring", choices=["ring", "a2a"],
                   help="context-parallel attention: ring (default) or a2a (all-to-all over heads)")
    p.add_argument("--ep", type=int, default=1,
                   help="expert-parallel size of a mixture-of-experts model (default 1; spawns tp*pp*ep ranks, the "
                        "experts split over ep data-parallel replicas)")
    p.add_argument("--dtype", default="auto", choices=["auto", "fp32", "bf16", "fp16"])
    p.add_argument("--device", default="auto", help="auto (cuda:LOCAL_RANK with CUDA, else cpu), cpu, cuda, cuda:N")
    p.add_argument("--dist-timeout", type=float, default=600.0,
                   help="seconds a rank may wait on another before the job fails naming it (default 600)")
    p.add_argument("--sequence-parallel", action="store_true",
                   help="shard activations along the sequence over the TP ranks")


def _worker(args) -> None:
    import tpzoo
    from tpzoo.checkpoint import load_model, parse_dtype
    from tpzoo.evaluation import evaluate
    from tpzoo.models import ModelLayout

    from ._common import encode, load_tokenizer

    dims = tpzoo.init_parallel(tp=args.tp, pp=args.pp, cp=args.cp, ep=args.ep, device=args.device,
                               timeout=datetime.timedelta(seconds=args.dist_timeout))
    try:
        layout = ModelLayout(dims, sequence_parallel=args.sequence_parallel, cp_mode=args.cp_mode,
                             dtype=parse_dtype(args.dtype))
        model = load_model(args.ckpt, layout, virtual_stages=1).eval()
        tokenizer = load_tokenizer(args.tokenizer or args.ckpt)
        with open(args.text_file, encoding="utf-8") as f:
            ids = encode(tokenizer, f.read(), special_tokens=args.bos)
        if args.max_tokens:
            ids = ids[: args.max_tokens]
        seq_len = args.seq_len or min(1024, model.cfg.max_position_embeddings)
        result = evaluate(model, ids, seq_len, args.batch_size, dims)
        if dims.rank == 0:
            print(json.dumps({**result, "seq_len": seq_len, "tp": args.tp, "cp": args.cp, "pp": args.pp, "dp": dims.dp,
                              "ep": dims.ep, "checkpoint": str(args.ckpt)}), flush=True)
    finally:
        tpzoo.destroy_parallel()


def run(args) -> int:
    """Preflight (tpzoo.train.preflight: sizes, the checkpoint's config against the layout, the text file),
    then the ranks: here before spawning them, or first thing on each rank under torchrun."""
    from tpzoo.train.preflight import check_eval, in_rank

    from .launch import run_multirank, under_torchrun

    if under_torchrun():
        return run_multirank(in_rank(check_eval, _worker), args, 1, "eval")
    check_eval(args)
    return run_multirank(_worker, args, args.tp * args.cp * args.pp * args.ep, "eval")
