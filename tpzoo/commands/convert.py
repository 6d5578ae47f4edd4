"""`tpzoo convert from-hf SRC DST --tp N --pp M` and `tpzoo convert to-hf SRC DST` (docs/checkpoint-format.md);
`from-megatron` / `to-megatron` (Megatron-LM checkpoints) live in convert_megatron.py.

Streaming (bounded memory, progress bar on stderr), atomic (a temporary directory renamed into place when
complete; an existing DST is refused unless --force, and replaced only once the new one is complete; what a killed
conversion into DST left is removed first, with a message). The source's structure (manifest, headers) is checked
before anything is written (docs/checkpoint-format.md, "Verification and safety").
"""
from __future__ import annotations

import argparse
import json
import sys
import time


def add_arguments(p: argparse.ArgumentParser) -> None:
    from . import convert_megatron

    sub = p.add_subparsers(dest="direction", metavar="{from-hf,to-hf,from-megatron,to-megatron}", required=True)
    a = sub.add_parser("from-hf", help="Hugging Face checkpoint -> tpzoo sharded checkpoint")
    a.add_argument("src", help="HF model directory, a weights file in one, or a hub id (tried only if not a path)")
    add_tpzoo_output(a)
    a.add_argument("--keep-quantized", action="store_true",
                   help="a block-FP8 or int4 source: store its quantized weights and their scales as they are "
                        "(sharded along whole blocks), for LoRA on the quantized base and a byte-identical export")
    b = sub.add_parser("to-hf", help="tpzoo checkpoint (any layout) -> directory transformers loads")
    b.add_argument("src", help="tpzoo checkpoint directory")
    b.add_argument("dst", help="output HF model directory")
    b.add_argument("--dtype", default="auto", choices=["auto", "fp32", "bf16", "fp16"])
    b.add_argument("--quantize", choices=["fp8-block"],
                   help="write the weights of the linear layers in DeepSeek's block FP8 (e4m3, 128x128 blocks; "
                        "embeddings, head, norms, routers, biases as --dtype)")
    b.add_argument("--max-shard-size", default="5GB", help="split model.safetensors above this (default 5GB)")
    b.add_argument("--no-verify", action="store_true",
                   help="skip the shard files' checksums (the header checks always run)")
    b.add_argument("--force", action="store_true", help="replace DST if it exists")
    b.add_argument("--quiet", action="store_true", help="no progress bar")
    b.add_argument("--merge", action="store_true",
                   help="a LoRA checkpoint: write the base with the adapters merged in (default: a PEFT adapter "
                        "directory)")
    convert_megatron.add_parsers(sub)


def add_tpzoo_output(a: argparse.ArgumentParser) -> None:
    """DST and the options of a conversion that writes a tpzoo checkpoint (from-hf, from-megatron)."""
    a.add_argument("dst", help="output checkpoint directory")
    a.add_argument("--tp", type=int, default=1, help="tensor-parallel size of the output (default 1)")
    a.add_argument("--pp", type=int, default=1, help="pipeline-parallel size of the output (default 1)")
    a.add_argument("--virtual-stages", type=int, default=1, help="model chunks per pipeline rank (default 1)")
    a.add_argument("--dtype", default="auto", choices=["auto", "fp32", "bf16", "fp16"],
                   help="weights dtype (auto: keep the source's)")
    a.add_argument("--vocab-multiple", type=int, default=1,
                   help="pad the vocabulary to a multiple of tp * this (default 1)")
    a.add_argument("--checksum", default="crc32", choices=["crc32", "sha256"], help="shard file checksum")
    a.add_argument("--force", action="store_true", help="replace DST if it exists")
    a.add_argument("--quiet", action="store_true", help="no progress bar")


def run(args) -> int:
    from tpzoo.checkpoint import convert_from_hf, convert_to_hf
    from tpzoo.errors import ConfigError

    from . import convert_megatron

    start = time.time()
    if args.direction in convert_megatron.DIRECTIONS:
        summary = convert_megatron.run(args)
    elif args.direction == "from-hf":
        m = convert_from_hf(args.src, args.dst, tp=args.tp, pp=args.pp, dtype=args.dtype, force=args.force,
                            vocab_padding_multiple=args.vocab_multiple, virtual_stages=args.virtual_stages,
                            progress=not args.quiet, checksum=args.checksum, keep_quantized=args.keep_quantized)
        summary = {"dst": args.dst, "tp": m["tp"], "pp": m["pp"], "dtype": m["dtype"],
                   "files": len(m["files"]), "bytes": sum(f["bytes"] for f in m["files"])}
        for note in m["metadata"].get("notes", []):  # what the import left out or changed, one line each
            print(f"note: {note}", file=sys.stderr)
    else:
        from tpzoo.checkpoint.lora_io import lora_info
        from tpzoo.checkpoint.peft import export_merged, export_peft

        kw = dict(force=args.force, max_shard_size=args.max_shard_size, dtype=args.dtype, verify=not args.no_verify,
                  progress=not args.quiet, quantize=args.quantize)
        if lora_info(args.src) is None:
            files = convert_to_hf(args.src, args.dst, **kw)
        elif args.merge:
            files = export_merged(args.src, args.dst, **kw)
        else:  # the adapters as PEFT writes them
            if args.quantize:
                raise ConfigError("--quantize applies to full weights: a LoRA checkpoint exports them with --merge")
            files = [str(p) for p in sorted(export_peft(args.src, args.dst, force=args.force).iterdir())]
        summary = {"dst": args.dst, "files": files}
    print(json.dumps({**summary, "seconds": round(time.time() - start, 3)}))
    return 0
