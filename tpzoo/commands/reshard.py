"""`tpzoo reshard SRC DST --tp N --pp M`: a tpzoo checkpoint at another layout, streamed, reading only the
slices each new shard needs."""
from __future__ import annotations

import argparse
import json
import time


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("src", help="tpzoo checkpoint directory")
    p.add_argument("dst", help="output checkpoint directory")
    p.add_argument("--tp", type=int, required=True, help="tensor-parallel size of the output")
    p.add_argument("--pp", type=int, default=1, help="pipeline-parallel size of the output (default 1)")
    p.add_argument("--virtual-stages", type=int, default=1, help="model chunks per pipeline rank (default 1)")
    p.add_argument("--dtype", default="auto", choices=["auto", "fp32", "bf16", "fp16"])
    p.add_argument("--vocab-multiple", type=int, default=None,
                   help="vocabulary padding multiple of the output (default: the source's)")
    p.add_argument("--no-verify", action="store_true",
                   help="skip the source files' checksums (the header checks always run)")
    p.add_argument("--checksum", default="crc32", choices=["crc32", "sha256"], help="shard file checksum")
    p.add_argument("--force", action="store_true", help="replace DST if it exists")
    p.add_argument("--quiet", action="store_true", help="no progress bar")


def run(args) -> int:
    from tpzoo.checkpoint import reshard

    start = time.time()
    m = reshard(args.src, args.dst, tp=args.tp, pp=args.pp, dtype=args.dtype, force=args.force,
                virtual_stages=args.virtual_stages, vocab_padding_multiple=args.vocab_multiple,
                verify=not args.no_verify, progress=not args.quiet, checksum=args.checksum)
    print(json.dumps({"dst": args.dst, "tp": m["tp"], "pp": m["pp"], "files": len(m["files"]),
                      "bytes": sum(f["bytes"] for f in m["files"]), "seconds": round(time.time() - start, 3)}))
    return 0
