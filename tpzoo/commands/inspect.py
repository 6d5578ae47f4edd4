"""`tpzoo inspect CKPT [--verify]`: a checkpoint's layout, config, files and tensors, then its structural check
(tpzoo/checkpoint/structure.py: the manifest against its shard specs, the model config and every shard file's
size and header); --verify adds every file's checksum. Each problem is one line naming the tensor or file, and
the exit status is 1 when there is any. A manifest that cannot be read at all is a user error (status 2).
A Megatron-LM checkpoint directory shows its format, arguments, layout and tensors (checkpoint/megatron)."""
from __future__ import annotations

import argparse
import json
import sys


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("ckpt", help="tpzoo checkpoint directory (or a Megatron-LM checkpoint directory)")
    p.add_argument("--verify", action="store_true",
                   help="also check every shard file's checksum (reads every byte; the header checks always run)")
    p.add_argument("--no-tensors", action="store_true", help="do not list the tensors")
    p.add_argument("--json", action="store_true", help="print the manifest (without per-file tensor lists)")


def _size(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return str(n)


def run(args) -> int:
    from tpzoo.checkpoint import is_checkpoint, read_manifest
    from tpzoo.checkpoint.megatron import describe, is_megatron_checkpoint
    from tpzoo.models.config import ModelConfig
    from tpzoo.quant import quantization_line, stored_names

    if not is_checkpoint(args.ckpt) and is_megatron_checkpoint(args.ckpt):
        print("\n".join(describe(args.ckpt, tensors=not args.no_tensors)))
        return 0
    m = read_manifest(args.ckpt)
    cfg = ModelConfig.from_dict(m["model_config"])
    if args.json:
        print(json.dumps({**m, "files": [{k: v for k, v in f.items() if k != "tensors"} for f in m["files"]]},
                         indent=1))
    else:
        v = m["vocab"]
        print(f"checkpoint {args.ckpt} ({m['format']} v{m.get('format_version', 1)})")
        print(f"model: {cfg.family} {cfg.name or ''} layers={cfg.num_layers} hidden={cfg.hidden_size} "
              f"heads={cfg.num_heads} kv_heads={cfg.num_kv_heads} ffn={cfg.ffn_hidden_size} vocab={v['size']} "
              f"(padded {v['padded']}) parameters={cfg.num_parameters():,} dtype={m.get('dtype')}")
        if quantization_line(cfg):  # a kept-quantized checkpoint (convert from-hf --keep-quantized)
            print(quantization_line(cfg))
        print(f"layout: tp={m['tp']} pp={m['pp']} virtual_stages={m.get('virtual_stages', 1)}")
        for st in m["stages"]:
            ends = [n for n, flag in (("embedding", st["pre_process"]), ("head", st["post_process"])) if flag]
            print(f"  pp rank {st['pp_rank']}: layers [{st['layers'][0]}, {st['layers'][1]})"
                  f"{' + ' + ' + '.join(ends) if ends else ''}")
        total = sum(f["bytes"] for f in m["files"])
        print(f"files: {len(m['files'])}, {_size(total)}")
        for f in m["files"]:
            print(f"  {f['path']}  tp={f['tp_rank']} pp={f['pp_rank']}  {_size(f['bytes'])}  "
                  f"{len(f['tensors'])} tensors  {f['checksum'][:23]}")
        if m.get("aux_files"):
            print("aux files: " + ", ".join(m["aux_files"]))
        if not args.no_tensors:
            print(f"tensors: {len(m['tensors'])}")
            from ._common import aligned

            kept = stored_names(cfg)
            rows = [[name, str(tuple(t["shape"])), t["dtype"], "replicated" if t["split"] is None
                     else f"split dim {t['split']['dim']}", f"pp {t['pp_rank']}"
                     + (f"  {cfg.quantization['format']}" if name in kept else "")] for name, t in m["tensors"].items()]
            for line in aligned(rows, indent="  "):
                print(line)
    return _check(args.ckpt, m, checksum=args.verify, out=sys.stderr if args.json else sys.stdout)


def _check(ckpt, m: dict, checksum: bool, out) -> int:
    """Print every structural problem (and with checksum, every file's verdict); 1 if any, else 0."""
    from tpzoo.checkpoint import CheckpointError, verify_file
    from tpzoo.checkpoint.structure import manifest_problems, missing_aux_files, unlisted_shard_files

    word = "verify" if checksum else "check"
    problems = manifest_problems(ckpt, m)
    problems += [f"{p}: a shard file the manifest does not list (readers ignore it; two layouts mixed?)"
                 for p in unlisted_shard_files(ckpt, m)]
    problems += missing_aux_files(ckpt, m)
    for p in problems:
        print(f"{word} FAILED: {p}", file=out)
    bad = 0
    for f in m["files"]:
        try:
            verify_file(ckpt, f, checksum=checksum)
            if checksum:
                print(f"verified {f['path']}: ok", file=out)
        except (CheckpointError, OSError) as e:
            bad += 1
            print(f"{word} FAILED: {e}", file=out)
    what = "size, header and checksum" if checksum else "size and header; --verify adds the checksums"
    print(f"{word}: {len(m['files']) - bad} of {len(m['files'])} files ok ({what}), "
          f"{len(problems)} manifest problem(s)", file=out)
    return 1 if bad or problems else 0
