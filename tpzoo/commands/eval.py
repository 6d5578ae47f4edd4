"""`tpzoo eval CKPT --text-file F`: next-token loss and perplexity of a text under the model, as one JSON line.

    tpzoo eval ckpt/ --text-file valid.txt --seq-len 512 --tp 2 --pp 2      # spawns 4 local CPU ranks
    torchrun --nproc-per-node 4 -m tpzoo eval ckpt/ --text-file valid.txt --tp 2 --pp 2
    tpzoo eval runs/dpo/step_00000100 --objective dpo --data prefs.jsonl    # DPO: accuracy and margins (JSON)

`--objective dpo` evaluates preference pairs instead (tpzoo.post.dpo_eval): the DPO loss, rewards/accuracies,
rewards/margins, rewards/chosen|rejected and logps/chosen|rejected (TRL's names, means over the pairs), against the
reference: a LoRA checkpoint's base with its adapters off, or --reference (the model DPO started from).

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
    p.add_argument("--text-file", help="UTF-8 text to evaluate on (the lm objective)")
    p.add_argument("--objective", default="lm", choices=["lm", "dpo"],
                   help="lm: loss and perplexity of --text-file (default); dpo: preference pairs of --data")
    p.add_argument("--data", help="--objective dpo: preference pairs JSONL ({prompt, chosen, rejected} or chat "
                   "conversations chosen / rejected)")
    p.add_argument("--reference", help="--objective dpo: the reference model (default for a LoRA checkpoint: its "
                   "base without the adapters)")
    p.add_argument("--dpo-beta", type=float, default=0.1, help="--objective dpo: beta (default 0.1)")
    p.add_argument("--dpo-loss", default="sigmoid", choices=["sigmoid", "ipo"], help="--objective dpo: the loss")
    p.add_argument("--dpo-label-smoothing", type=float, default=0.0,
                   help="--objective dpo: conservative DPO's label smoothing (default 0)")
    p.add_argument("--template", default="auto", choices=["auto", "fallback", "raw"],
                   help="--objective dpo: how the pairs are rendered (as the fine-tune's --template)")
    p.add_argument("--tokenizer", help="tokenizer spec: a directory, 'byte', ... (default: the checkpoint's)")
    p.add_argument("--seq-len", type=int, help="tokens per window (default: min(1024, max positions))")
    p.add_argument("--batch-size", type=int, default=1, help="windows (DPO: pairs) per forward (default 1)")
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
        if args.objective == "dpo":
            return _dpo(args, model, tokenizer, dims)
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


def _dpo(args, model, tokenizer, dims) -> None:
    from types import SimpleNamespace

    from tpzoo.pipeline import as_chunks
    from tpzoo.post.dpo import DPOSettings
    from tpzoo.post.dpo_eval import evaluate_pairs, reference_for

    chunks = as_chunks(model)
    layout = SimpleNamespace(sequence_parallel=args.sequence_parallel, cp_mode=args.cp_mode, dtype=args.dtype)
    reference = reference_for(args.ckpt, chunks, args.reference, dims, layout)
    seq_len = args.seq_len or min(1024, chunks[0].cfg.max_position_embeddings)
    settings = DPOSettings(args.dpo_beta, args.dpo_loss, args.dpo_label_smoothing)
    result = evaluate_pairs(chunks, args.data, tokenizer, dims, settings, reference, seq_len=seq_len,
                            batch_size=args.batch_size, template=args.template,
                            sequence_parallel=args.sequence_parallel)
    if dims.rank == 0:
        print(json.dumps({**result, "beta": args.dpo_beta, "loss_type": args.dpo_loss, "reference": reference.what,
                          "seq_len": seq_len, "tp": args.tp, "cp": args.cp, "pp": args.pp, "dp": dims.dp,
                          "checkpoint": str(args.ckpt)}), flush=True)


def run(args) -> int:
    """Preflight (tpzoo.train.preflight: sizes, the checkpoint's config against the layout, the text file),
    then the ranks: here before spawning them, or first thing on each rank under torchrun."""
    from tpzoo.train.preflight import check_eval, in_rank

    from .launch import run_multirank, under_torchrun

    if under_torchrun():
        return run_multirank(in_rank(check_eval, _worker), args, 1, "eval")
    check_eval(args)
    return run_multirank(_worker, args, args.tp * args.cp * args.pp * args.ep, "eval")
