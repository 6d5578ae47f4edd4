"""`tpzoo preprocess`: tokenize a corpus once into a memory-mapped token store (see docs/data.md).

    tpzoo preprocess --data corpus/ more.jsonl --tokenizer byte --out data/store
    tpzoo preprocess --tokenizer path/to/hf_tokenizer --out data/stdlib     # no --data: the stdlib corpus

Shows a progress bar on stderr and ends with one summary line on stdout (docs, tokens, bytes, seconds).
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--data", nargs="+", metavar="PATH",
                   help="text/.jsonl/.parquet files, directories of them, or a hub dataset name "
                        "(default: the Python standard library's .py files)")
    p.add_argument("--tokenizer", required=True, help="'byte', or a Hugging Face tokenizer / checkpoint directory")
    p.add_argument("--out", required=True, help="output token-store directory (must not exist unless --force)")
    p.add_argument("--force", action="store_true", help="replace an existing output directory")
    p.add_argument("--text-field", default="text", help="JSONL field / Parquet column holding the text")
    p.add_argument("--no-eos", action="store_true", help="do not append EOS after each document")
    p.add_argument("--bos", action="store_true", help="prepend BOS to each document")
    p.add_argument("--quiet", action="store_true", help="no progress bar")


def run(args) -> int:
    from tpzoo.data import default_corpus, iter_documents, load_tokenizer, preprocess
    from tpzoo.progress import progress_bar

    if Path(args.out).exists() and not args.force:
        raise FileExistsError(f"output {args.out} already exists (pass --force to replace it)")
    sources = args.data if args.data else [str(p) for p in default_corpus()]
    if not args.data:
        print(f"preprocess: no --data given; using the standard library corpus ({len(sources)} files)",
              file=sys.stderr)
    t0 = time.perf_counter()
    tokenizer = load_tokenizer(args.tokenizer)
    bar = progress_bar(not args.quiet, unit="doc", desc="preprocess", file=sys.stderr, dynamic_ncols=True)
    totals = {"tokens": 0}

    def on_progress(docs: int, tokens: int) -> None:
        totals["tokens"] += tokens
        bar.update(docs)
        bar.set_postfix(tokens=totals["tokens"], refresh=False)

    try:
        store = preprocess(iter_documents(sources, text_field=args.text_field), tokenizer, args.out,
                           append_eos=not args.no_eos, prepend_bos=args.bos, force=args.force,
                           sources=args.data or ["<stdlib>"], on_progress=on_progress)
    finally:
        bar.close()
    seconds = time.perf_counter() - t0
    nbytes = store.num_tokens * store.dtype.itemsize
    print(f"preprocess: {store.num_docs} docs, {store.num_tokens} tokens, {nbytes} bytes ({store.dtype.name}), "
          f"{seconds:.2f} s -> {store.path}")
    return 0
