"""`tpzoo convert from-megatron SRC DST` and `tpzoo convert to-megatron SRC DST` (docs/checkpoint-format.md,
"Megatron-LM"): Megatron-LM checkpoints (torch_dist or legacy, any tp / pp / ep) to tpzoo's format and back,
streaming and atomic like from-hf / to-hf."""
from __future__ import annotations

import sys

DIRECTIONS = ("from-megatron", "to-megatron")


def add_parsers(sub) -> None:
    from .convert import add_tpzoo_output

    a = sub.add_parser("from-megatron", help="Megatron-LM checkpoint (torch_dist or legacy) -> tpzoo sharded checkpoint")
    a.add_argument("src", help="Megatron-LM save directory (with latest_checkpointed_iteration.txt) or one iter_* "
                               "directory")
    add_tpzoo_output(a)
    a.add_argument("--ep", type=int, default=1, help="check that the experts split over this many expert-parallel "
                   "ranks (a tpzoo checkpoint holds every expert and loads at any ep)")
    a.add_argument("--megatron-args", metavar="FILE", help="JSON or YAML of Megatron-LM argument names (num_layers, "
                   "hidden_size, num_attention_heads, ...): needed when the checkpoint saved none; overrides the saved")
    a.add_argument("--tokenizer", help="tokenizer to save with the weights (a directory, 'byte', ...): Megatron "
                   "checkpoints carry none; its size is the vocabulary when the arguments do not give vocab_size")
    b = sub.add_parser("to-megatron", help="tpzoo (any layout) or HF checkpoint -> Megatron-LM torch_dist checkpoint")
    b.add_argument("src", help="tpzoo checkpoint directory (or a Hugging Face model directory)")
    b.add_argument("dst", help="output directory: Megatron-LM's --load directory")
    b.add_argument("--tp", type=int, default=1, help="tensor-parallel size Megatron-LM will run at (default 1)")
    b.add_argument("--pp", type=int, default=1, help="pipeline-parallel size (default 1)")
    b.add_argument("--ep", type=int, default=1, help="expert-parallel size (default 1)")
    b.add_argument("--iteration", type=int, help="write iter_N and iteration N (default: a release checkpoint, "
                   "which Megatron-LM starts from iteration 0 with a fresh optimizer)")
    b.add_argument("--transformer-impl", default="transformer_engine", choices=["transformer_engine", "local"],
                   help="the layer spec Megatron-LM will use (it names a mixture of experts' pre-MLP norm)")
    b.add_argument("--megatron-core", default="0.19", metavar="VERSION",
                   help="the Megatron-Core version that will load it: from 0.19 the common state (args) is inside "
                        "the .distcp files, before it in common.pt (default 0.19)")
    b.add_argument("--make-vocab-size-divisible-by", type=int,
                   help="Megatron's vocabulary padding (default: the source's when it came from Megatron, else 128)")
    b.add_argument("--dtype", default="auto", choices=["auto", "fp32", "bf16", "fp16"])
    b.add_argument("--no-verify", action="store_true", help="skip the source shard files' checksums")
    b.add_argument("--force", action="store_true", help="replace DST if it exists")
    b.add_argument("--quiet", action="store_true", help="no progress bar")


def run(args) -> dict:
    from tpzoo.checkpoint.megatron import convert_from_megatron, convert_to_megatron

    if args.direction == "from-megatron":
        m = convert_from_megatron(args.src, args.dst, tp=args.tp, pp=args.pp, ep=args.ep,
                                  megatron_args=args.megatron_args, tokenizer=args.tokenizer, dtype=args.dtype,
                                  force=args.force, vocab_padding_multiple=args.vocab_multiple,
                                  virtual_stages=args.virtual_stages, progress=not args.quiet, checksum=args.checksum)
        for note in m["metadata"].get("notes", []):
            print(f"note: {note}", file=sys.stderr)
        return {"dst": args.dst, "family": m["model_config"]["family"], "tp": m["tp"], "pp": m["pp"],
                "dtype": m["dtype"], "files": len(m["files"]), "bytes": sum(f["bytes"] for f in m["files"])}
    margs = convert_to_megatron(args.src, args.dst, tp=args.tp, pp=args.pp, ep=args.ep, iteration=args.iteration,
                                dtype=args.dtype, transformer_impl=args.transformer_impl,
                                megatron_core=args.megatron_core,
                                make_vocab_size_divisible_by=args.make_vocab_size_divisible_by, force=args.force,
                                verify=not args.no_verify, progress=not args.quiet)
    return {"dst": args.dst, "tp": args.tp, "pp": args.pp, "ep": args.ep,
            "padded_vocab_size": margs["padded_vocab_size"], "iteration": args.iteration}

