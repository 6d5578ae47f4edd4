"""`tpzoo preprocess`: tokenize a corpus once into a memory-mapped token store (see docs/data.md).

    tpzoo preprocess --data corpus/ more.jsonl --tokenizer byte --out data/store
    tpzoo preprocess --tokenizer path/to/hf_tokenizer --out data/stdlib     # no --data: the stdlib corpus
    tpzoo preprocess --data web/ --tokenizer tok/ --format megatron --out data/web_text_document   # .bin + .idx

Tokenizes on --workers processes (default: every core), writing in order (the same bytes at any --workers).
Killed, the same command resumes from the last completed chunks. Shows a progress bar (tokens/s) on stderr and
ends with one summary line on stdout (docs, tokens, bytes, seconds).
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
    p.add_argument("--out", required=True, help="output token-store directory, or with --format megatron the dataset "
                   "prefix (PREFIX.bin + PREFIX.idx); must not exist unless --force")
    p.add_argument("--format", default="tpzoo", choices=["tpzoo", "megatron"],
                   help="tpzoo: a token-store directory; megatron: Megatron-LM's indexed dataset (MMIDIDX), which "
                        "Megatron-Core's IndexedDataset reads (default: tpzoo)")
    p.add_argument("--workers", type=int, help="tokenizing processes (default: the cores this process may use)")
    p.add_argument("--force", action="store_true", help="replace an existing output directory")
    p.add_argument("--text-field", default="text", help="JSONL field / Parquet column holding the text")
    p.add_argument("--no-eos", action="store_true", help="do not append EOS after each document")
    p.add_argument("--bos", action="store_true", help="prepend BOS to each document")
    p.add_argument("--quiet", action="store_true", help="no progress bar")


def run(args) -> int:
    from tpzoo.data import default_corpus, default_workers, iter_documents, load_tokenizer, preprocess
    from tpzoo.errors import ConfigError
    from tpzoo.progress import progress_bar

    outputs = [args.out] if args.format == "tpzoo" else [f"{args.out}.bin", f"{args.out}.idx"]
    for out in outputs:
        if Path(out).exists() and not args.force:
            raise FileExistsError(f"output {out} already exists (pass --force to replace it)")
    workers = default_workers() if args.workers is None else args.workers
    if workers < 1:
        raise ConfigError(f"--workers must be at least 1, got {workers}")
    sources = args.data if args.data else [str(p) for p in default_corpus()]
    if not args.data:
        print(f"preprocess: no --data given; using the standard library corpus ({len(sources)} files)",
              file=sys.stderr)
    t0 = time.perf_counter()
    tokenizer = load_tokenizer(args.tokenizer)
    # The bar counts tokens (its rate is tokens/s); documents go in the postfix.
    bar = progress_bar(not args.quiet, unit="tok", unit_scale=True,
                       desc=f"preprocess ({workers} worker{'s' * (workers > 1)})", file=sys.stderr,
                       dynamic_ncols=True)
    totals = {"docs": 0}

    def on_progress(docs: int, tokens: int) -> None:
        totals["docs"] += docs
        bar.update(tokens)
        bar.set_postfix(docs=totals["docs"], refresh=False)

    try:
        store = preprocess(iter_documents(sources, text_field=args.text_field), tokenizer, args.out,
                           append_eos=not args.no_eos, prepend_bos=args.bos, force=args.force,
                           sources=args.data or ["<stdlib>"], on_progress=on_progress, workers=workers,
                           format=args.format, resume=True, resume_key={"text_field": args.text_field})
    finally:
        bar.close()
    seconds = time.perf_counter() - t0
    nbytes = store.num_tokens * store.dtype.itemsize
    print(f"preprocess: {store.num_docs} docs, {store.num_tokens} tokens, {nbytes} bytes ({store.dtype.name}), "
          f"{seconds:.2f} s -> {store.path}{' (.bin + .idx)' if args.format == 'megatron' else ''}")
    return 0
