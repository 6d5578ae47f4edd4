"""The input pipeline: preprocessing tokens/s at 1..N workers beside `datasets.map(num_proc=N)`, and the loader's
samples/s at a 1B model's batch shape against the step time the plan advisor predicts for H100s.

    python scripts/bench/data.py                                  # prints the markdown section
    python scripts/bench/data.py --write docs/benchmarks.md       # and (re)writes its section there

Corpus: the Python standard library's .py files (`tpzoo.data.default_corpus()`, ~12 MB on 3.11), or --data.
Tokenizer: a byte-level BPE of --vocab ids trained by `train_bpe` on the first --train-docs documents (a Hugging
Face fast tokenizer, as most real ones are), saved once; --tokenizer byte|DIR uses another one.

Preprocessing: `tpzoo.data.preprocess(iter_documents(corpus), tok, out, workers=N)` from the files to a finished
token store, N = 1..--workers, each --repeat times (the best kept); then the usual Hugging Face way with the same
tokenizer: `Dataset.from_generator` over the same documents (timed apart: it reads and writes the text into Arrow),
then `ds.map(tokenize, batched=True, num_proc=N)` (ids written as Arrow lists; no flat token file, no EOS). Both
run with TOKENIZERS_PARALLELISM=false, so that one worker / num_proc=1 is one core and N are N cores.

Loader: a 3-source mixture (0.6 / 0.3 / 0.1 of the store's thirds) and the whole store as one corpus, at the plan's
best layout of --model on --gpus H100s (80 GiB, 989 TFLOP/s bf16) for --seq-len x --global-batch-size: each rank
loads global_batch / dp sequences per step, on one CPU thread (prefetch=0: the raw production rate), packed with
document boundaries as `tpzoo pretrain` does. Need = those sequences / the predicted step time.
"""
from __future__ import annotations

import argparse
import os
import platform
import shutil
import tempfile
import time
from pathlib import Path

os.environ["TOKENIZERS_PARALLELISM"] = "false"  # before any tokenizer is loaded: one core per worker / process

from mdsection import write_section  # noqa: E402 (a sibling script module)


def corpus_docs(args):
    from tpzoo.data import default_corpus, iter_documents

    return list(iter_documents(args.data or [str(p) for p in default_corpus()]))


def tokenizer_for(args, docs, work: Path):
    from tpzoo.data import load_tokenizer, train_bpe

    if args.tokenizer:
        return load_tokenizer(args.tokenizer)
    return train_bpe(docs[:args.train_docs], vocab_size=args.vocab, out_dir=work / "bpe")


def best_of(repeat: int, fn) -> float:
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def bench_preprocess(args, docs, tok, work: Path) -> tuple[list[dict], int]:
    from tpzoo.data import TokenStore, preprocess

    rows, tokens, reference = [], 0, None
    for n in range(1, args.workers + 1):
        out = work / f"store-{n}"

        def run():
            preprocess(iter(docs), tok, out, workers=n, force=True)

        seconds = best_of(args.repeat, run)
        store = TokenStore(out)
        tokens = store.num_tokens
        data = (out / "tokens.bin").read_bytes()
        reference = reference or data
        rows.append({"what": f"`tpzoo preprocess --workers {n}`", "n": n, "seconds": seconds,
                     "same": data == reference})
    hf = tok.hf if hasattr(tok, "hf") else None
    if hf is None:
        return rows, tokens
    import datasets

    datasets.disable_progress_bars()
    cache = work / "hf-cache"

    def tokenize(batch):
        return {"input_ids": hf(batch["text"], add_special_tokens=False)["input_ids"]}

    def load():
        shutil.rmtree(cache, ignore_errors=True)
        return datasets.Dataset.from_generator(lambda: ({"text": d} for d in docs), cache_dir=str(cache))

    load_s = best_of(args.repeat, load)
    ds = load()
    for n in range(1, args.workers + 1):
        seconds = best_of(args.repeat, lambda: ds.map(tokenize, batched=True, num_proc=n if n > 1 else None,
                                                      remove_columns=["text"], load_from_cache_file=False))
        rows.append({"what": f"`datasets.map(num_proc={n})`", "n": n, "seconds": seconds, "same": None,
                     "plus_load": load_s})
    return rows, tokens


def bench_loader(args, store_path: Path) -> dict:
    from tpzoo.data import MixtureLoader, PackedDataset, ResumableLoader, TokenStore, parse_mixture
    from tpzoo.models import get_config
    from tpzoo.plan import ClusterSpec, TrainingSpec, search
    from tpzoo.train.data import Window

    cfg = get_config(args.model)
    best = search(cfg, ClusterSpec(gpus=args.gpus), TrainingSpec(seq_len=args.seq_len,
                                                                 global_batch_size=args.global_batch_size))[0]
    lay = best.layout
    per_rank = args.global_batch_size // lay.dp  # sequences each rank's loader gives per step
    packed = PackedDataset(TokenStore(store_path), args.seq_len, respect_doc_boundaries=True)
    n = len(packed)
    thirds = [Window(packed, i * n // 3, (i + 1) * n // 3) for i in range(3)]
    rank = dict(dp_rank=0, dp_size=lay.dp, prefetch=0, seed=0)  # rank 0 of the layout's data-parallel group
    loaders = {
        "one corpus": ResumableLoader(packed, lay.micro_batch_size, **rank),
        "mixture 0.6/0.3/0.1": MixtureLoader(parse_mixture(["0.6", "a", "0.3", "b", "0.1", "c"]), thirds,
                                             lay.micro_batch_size, **rank),
    }
    rates = {}
    for name, loader in loaders.items():
        batches = max(4, args.loader_samples // lay.micro_batch_size)
        next(loader)
        t0 = time.perf_counter()
        for _ in range(batches):
            next(loader)
        rates[name] = batches * lay.micro_batch_size / (time.perf_counter() - t0)
    return {"layout": lay.label(), "step_s": best.time.total, "per_rank": per_rank, "fits": best.fits,
            "need": per_rank / best.time.total, "rates": rates, "windows": n}


def section(args, pre, tokens, loader, tok, ndocs, nbytes) -> str:
    cmd = "python scripts/bench/data.py" + (f" --workers {args.workers}" if args.workers != 2 else "")
    load, end = args.load_at_start, os.getloadavg()
    out = [f"## Input pipeline: preprocessing and the loader ({platform.processor() or platform.machine()}, "
           f"{os.cpu_count()} cores)", "", f"`{cmd}`", "",
           f"Corpus: {ndocs:,} documents, {nbytes / 1e6:.1f} MB (the stdlib's .py files unless --data), "
           f"{tokens:,} tokens with {tok.spec if args.tokenizer else f'a byte-level BPE of {args.vocab} ids'}. "
           f"Best of {args.repeat}; load average {load[0]:.1f} / {load[1]:.1f} / {load[2]:.1f} (1 / 5 / 15 min) "
           f"when it started, {end[0]:.1f} / {end[1]:.1f} / {end[2]:.1f} when it ended (the machine is shared).", "",
           "| preprocessing | workers | seconds | tokens/s | vs 1 worker | output |", "|---|---|---|---|---|---|"]
    base = {r["what"].split("(")[0].split(" --")[0]: r["seconds"] for r in pre if r["n"] == 1}
    for r in pre:
        key = r["what"].split("(")[0].split(" --")[0]
        extra = (f"same bytes as 1 worker: {'yes' if r['same'] else 'NO'}" if r["same"] is not None
                 else f"Arrow lists; `Dataset.from_generator` first: +{r['plus_load']:.2f} s")
        out.append(f"| {r['what']} | {r['n']} | {r['seconds']:.2f} | {tokens / r['seconds']:,.0f} | "
                   f"{base[key] / r['seconds']:.2f}x | {extra} |")
    out += ["", f"Loader at the plan's best layout of {args.model} on {args.gpus} H100 for {args.seq_len} x "
                f"{args.global_batch_size} ({loader['layout']}{'' if loader['fits'] else ', does not fit'}): "
                f"predicted step {loader['step_s']:.2f} s, each rank loads {loader['per_rank']} sequences per step, "
                f"so it needs {loader['need']:,.1f} sequences/s.", "",
            "| loader (one thread, no prefetch) | sequences/s | x what one GPU consumes |", "|---|---|---|"]
    for name, rate in loader["rates"].items():
        out.append(f"| {name} | {rate:,.0f} | {rate / loader['need']:,.0f}x |")
    return "\n".join(out)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--data", nargs="+", help="corpus files / directories (default: the stdlib's .py files)")
    p.add_argument("--tokenizer", help="byte or a tokenizer directory (default: a BPE trained here)")
    p.add_argument("--vocab", type=int, default=8192, help="vocabulary of the BPE trained here")
    p.add_argument("--train-docs", type=int, default=400, help="documents the BPE is trained on")
    p.add_argument("--workers", type=int, default=2, help="measure 1..N workers / num_proc")
    p.add_argument("--repeat", type=int, default=2)
    p.add_argument("--model", default="llama-3.2-1b")
    p.add_argument("--gpus", type=int, default=8)
    p.add_argument("--seq-len", type=int, default=4096)
    p.add_argument("--global-batch-size", type=int, default=512)
    p.add_argument("--loader-samples", type=int, default=512)
    p.add_argument("--write", help="markdown file whose data section to (re)write")
    args = p.parse_args()
    args.load_at_start = os.getloadavg()
    work = Path(tempfile.mkdtemp(prefix="tpzoo-bench-data-"))
    try:
        docs = corpus_docs(args)
        tok = tokenizer_for(args, docs, work)
        pre, tokens = bench_preprocess(args, docs, tok, work)
        loader = bench_loader(args, work / "store-1")
        text = section(args, pre, tokens, loader, tok, len(docs), sum(len(d.encode()) for d in docs))
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print(text)
    if args.write:
        write_section(args.write, "data-pipeline", text)


if __name__ == "__main__":
    main()
