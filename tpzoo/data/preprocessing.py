"""`preprocess`: a corpus tokenized once, on every core, into a token store (tpzoo's or Megatron's format).

Pipeline. This process reads the documents and cuts them into chunks (``batch_docs`` documents or ``batch_chars``
characters: small, so that the workers finish together); with ``workers > 1`` a pool of that many processes
(forked, so the tokenizer is not loaded again) encodes the chunks, at most ``4 * workers`` in flight, and this process writes their tokens strictly in order:
the output is byte for byte the same at any ``workers``, and memory stays bounded by the chunks in flight whatever
the corpus size. Each worker's tokenizer runs on one thread (a Hugging Face fast tokenizer's own thread pool is
turned off), so N workers use N cores; ``workers=1`` encodes here, on one core too.

Output, atomic and resumable. Everything is written into a hidden sibling directory ``.NAME.partial`` (locked while
a process writes it): the tokens as they come, the document offsets in a scratch file, and every second or so a
``progress.json`` recording how many documents (and bytes) are complete. Only when the corpus is done is the
result moved into place: the directory renamed to ``out_dir`` (tpzoo's format), or ``PREFIX.bin`` and
``PREFIX.idx`` renamed next to it (``format="megatron"``). A run that fails on bad input removes the partial
directory (nothing written); a run that is killed leaves it, and the same command (``resume=True``, what
`tpzoo preprocess` does) truncates it to its last recorded chunk, skips the documents already done (read again,
not tokenized) and continues. A partial directory of other settings (sources, tokenizer, options) is discarded.
"""
from __future__ import annotations

import itertools
import json
import multiprocessing
import os
import shutil
import time
import uuid
from collections import deque
from contextlib import contextmanager
from pathlib import Path
from typing import Callable, Iterable

import numpy as np

from tpzoo.errors import ConfigError, DataError

try:
    import fcntl
except ImportError:  # not on a POSIX system: no lock against a second writer
    fcntl = None

from .megatron import MegatronStore, megatron_dtype, write_index
from .token_store import (FORMAT, INDEX_FILE, OFFSETS_FILE, TOKENIZER_DIR, TOKENS_FILE, VERSION, TokenStore,
                          token_dtype)
from .tokenizer import load_tokenizer

FORMATS = ("tpzoo", "megatron")
PROGRESS_FILE = "progress.json"
_RAW_OFFSETS = "doc_offsets.raw"
_PROGRESS_EVERY_S = 1.0

__all__ = ["preprocess", "default_workers", "FORMATS"]


def default_workers() -> int:
    """The cores this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def preprocess(documents: Iterable[str], tokenizer, out_dir: str | os.PathLike, *, append_eos: bool = True,
               prepend_bos: bool = False, force: bool = False, sources: list[str] | None = None,
               save_tokenizer: bool = True, batch_docs: int = 64, batch_chars: int = 1 << 17,
               on_progress: Callable[[int, int], None] | None = None, workers: int = 1, format: str = "tpzoo",
               resume: bool = False, resume_key: dict | None = None):
    """Tokenize ``documents`` into a new token store at ``out_dir`` and return it opened (a `TokenStore`, or a
    `MegatronStore` for ``format="megatron"``, where ``out_dir`` is the dataset's prefix).

    Each non-empty document becomes ``[bos] + encode(doc) + [eos]`` (bos only with ``prepend_bos``, eos with
    ``append_eos``). An existing output is refused unless ``force=True``, which replaces it only once the new one
    is complete. ``on_progress(docs, tokens)`` is called after every chunk with the chunk's counts (and first
    with what a resumed run already holds). ``workers``: encoding processes (see the module docstring).

    ``resume``: continue a killed run of the same settings from its completed chunks; ``sources`` (recorded in
    index.json for provenance) and ``resume_key`` (anything else that decides the documents, e.g. the text field)
    identify the corpus, so a partial run of another corpus is discarded instead.
    """
    if format not in FORMATS:
        raise ConfigError(f"unknown token store format {format!r}; one of {', '.join(FORMATS)}")
    if workers < 1:
        raise ConfigError(f"workers must be at least 1, got {workers}")
    tok = load_tokenizer(tokenizer)
    out_dir = Path(out_dir).expanduser()
    outputs = _outputs(out_dir, format)
    if any(p.exists() for p in outputs) and not force:
        shown = out_dir if format == "tpzoo" else " / ".join(str(p) for p in outputs if p.exists())
        raise FileExistsError(f"token store output {shown} already exists (pass force=True / --force to replace)")
    if append_eos and tok.eos_id is None:
        raise ConfigError(f"{tok!r} has no eos token; pass append_eos=False")
    if prepend_bos and tok.bos_id is None:
        raise ConfigError(f"{tok!r} has no bos token; pass prepend_bos=False")
    dtype = token_dtype(tok.vocab_size) if format == "tpzoo" else megatron_dtype(tok.vocab_size)
    affixes = ([tok.bos_id] if prepend_bos else [], [tok.eos_id] if append_eos else [])
    key = {"format": format, "dtype": dtype.name, "tokenizer": [str(tok.spec), tok.vocab_size],
           "append_eos": append_eos, "prepend_bos": prepend_bos, "sources": [str(s) for s in sources or []],
           "extra": resume_key or {}}

    out_dir.parent.mkdir(parents=True, exist_ok=True)
    part = out_dir.parent / f".{out_dir.name}.partial"
    with _locked(part):
        done = _resume_point(part, key) if resume else None
        if done is None:
            _clear(part)
            done = {"docs": 0, "tokens": 0}
        elif on_progress is not None:
            on_progress(done["docs"], done["tokens"])
        try:
            num_docs, num_tokens = _write(part, documents, tok, dtype, affixes, key, done, workers, batch_docs,
                                          batch_chars, on_progress)
            if format == "megatron":
                write_index(part / "index.idx", dtype, _offsets(part, num_docs))
                _replace([(part / TOKENS_FILE, outputs[0]), (part / "index.idx", outputs[1])], force)
                shutil.rmtree(part, ignore_errors=True)
                return MegatronStore(out_dir)
            _finish_tpzoo(part, tok, dtype, num_docs, num_tokens, append_eos, prepend_bos, sources,
                          save_tokenizer)
            _replace([(part, out_dir)], force)
        except (KeyboardInterrupt, SystemExit):
            raise  # a kill: the chunks recorded in progress.json stay for the next run to resume from
        except BaseException:
            shutil.rmtree(part, ignore_errors=True)  # bad input or a failure: nothing is left behind
            raise
    return TokenStore(out_dir)


def _outputs(out: Path, format: str) -> list[Path]:
    if format == "tpzoo":
        return [out]
    return [Path(f"{out}.bin"), Path(f"{out}.idx")]


@contextmanager
def _locked(part: Path):
    """Hold an exclusive lock beside the partial directory for the whole run (released by the OS on a kill)."""
    if fcntl is None:
        yield
        return
    lock_path = part.parent / f"{part.name}.lock"
    fd = os.open(lock_path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)  # the holder's lock file stays
        raise FileExistsError(f"another preprocess is writing {part} (its lock {lock_path} is held)") from None
    try:
        yield
    finally:
        lock_path.unlink(missing_ok=True)  # unlinked while still held: no one can lock the old file after us
        os.close(fd)


def _clear(part: Path) -> None:
    shutil.rmtree(part, ignore_errors=True)
    part.mkdir()


def _resume_point(part: Path, key: dict) -> dict | None:
    """What a killed run of the same settings completed ({"docs", "tokens", ...}), files truncated to it; None to
    start over (no partial run, other settings, or files shorter than recorded)."""
    try:
        done = json.loads((part / PROGRESS_FILE).read_text())
        tokens_bytes, offsets_bytes = int(done["tokens_bytes"]), 8 * (int(done["docs"]) + 1)
    except (FileNotFoundError, ValueError, KeyError, TypeError):
        return None
    if done.get("key") != key:
        return None
    files = [(part / TOKENS_FILE, tokens_bytes), (part / _RAW_OFFSETS, offsets_bytes)]
    if any(not p.is_file() or p.stat().st_size < size for p, size in files):
        return None
    for p, size in files:
        os.truncate(p, size)  # drop a chunk that was being written when the run was killed
    return done


def _write(part: Path, documents, tok, dtype, affixes, key, done, workers, batch_docs, batch_chars,
           on_progress) -> tuple[int, int]:
    """Append the encoded chunks after the ``done`` ones; returns (documents, tokens) in total."""
    num_docs, num_tokens = done["docs"], done["tokens"]
    chunks = _chunks(_skip(documents, num_docs), batch_docs, batch_chars)
    last_note = time.monotonic()
    mode = "ab" if num_docs else "wb"
    with (part / TOKENS_FILE).open(mode) as tf, (part / _RAW_OFFSETS).open(mode) as of:
        if not num_docs:
            np.zeros(1, dtype="<i8").tofile(of)
        for flat, lengths in _encoded(chunks, tok, dtype, affixes, workers):
            tf.write(flat.tobytes())
            (num_tokens + np.cumsum(lengths)).astype("<i8").tofile(of)
            num_tokens += int(flat.size)
            num_docs += len(lengths)
            if on_progress is not None:
                on_progress(len(lengths), int(flat.size))
            if time.monotonic() - last_note > _PROGRESS_EVERY_S:
                _note(part, tf, of, key, num_docs, num_tokens)
                last_note = time.monotonic()
    return num_docs, num_tokens


def _note(part: Path, tf, of, key: dict, docs: int, tokens: int) -> None:
    """Record the chunks written so far (files flushed first, so the recorded sizes are on disk)."""
    tf.flush()
    of.flush()
    tmp = part / f"{PROGRESS_FILE}.tmp"
    tmp.write_text(json.dumps({"key": key, "docs": docs, "tokens": tokens, "tokens_bytes": tf.tell()}))
    os.replace(tmp, part / PROGRESS_FILE)


def _skip(documents: Iterable[str], n: int):
    """The documents after the first ``n`` non-empty ones (those a resumed run already holds)."""
    it = iter(documents)
    while n > 0:
        doc = next(it, None)
        if doc is None:
            return
        n -= bool(doc)
    yield from it


def _chunks(documents: Iterable[str], max_docs: int, max_chars: int):
    batch, chars = [], 0
    for doc in documents:
        if not doc:
            continue
        batch.append(doc)
        chars += len(doc)
        if len(batch) >= max_docs or chars >= max_chars:
            yield batch
            batch, chars = [], 0
    if batch:
        yield batch


def encode_chunk(texts: list[str], tok, dtype, affixes) -> tuple[np.ndarray, np.ndarray]:
    """(token ids of the chunk's documents concatenated, as ``dtype``; their lengths) with bos / eos added."""
    head, tail = affixes
    encoded = tok.encode_batch(texts)
    if head or tail:
        encoded = [head + list(ids) + tail for ids in encoded]
    lengths = np.fromiter(map(len, encoded), dtype=np.int64, count=len(encoded))
    flat = np.fromiter(itertools.chain.from_iterable(encoded), dtype=np.int64, count=int(lengths.sum()))
    if flat.size and (flat.min() < 0 or flat.max() >= tok.vocab_size):
        bad = int(flat.max()) if flat.max() >= tok.vocab_size else int(flat.min())
        raise DataError(f"token id {bad} outside the vocabulary of {tok.spec!r} (size {tok.vocab_size})")
    return flat.astype(dtype), lengths


# -- the worker pool ---------------------------------------------------------------------------------------

_WORKER: dict = {}


def _init_worker(tok, dtype, affixes) -> None:
    os.environ["TOKENIZERS_PARALLELISM"] = "false"  # one core per worker: N workers, N cores
    _WORKER.update(tok=tok, dtype=dtype, affixes=affixes)


def _encode_in_worker(texts: list[str]):
    return encode_chunk(texts, _WORKER["tok"], _WORKER["dtype"], _WORKER["affixes"])


@contextmanager
def _one_thread():
    """A Hugging Face fast tokenizer's thread pool off while ``workers=1`` encodes here (it reads the variable
    on every batch), restored after."""
    old = os.environ.get("TOKENIZERS_PARALLELISM")
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    try:
        yield
    finally:
        if old is None:
            os.environ.pop("TOKENIZERS_PARALLELISM", None)
        else:
            os.environ["TOKENIZERS_PARALLELISM"] = old


def _encoded(chunks, tok, dtype, affixes, workers: int):
    """The encoded chunks, in order: here with one worker, else from a pool with a bounded window in flight."""
    if workers == 1:
        with _one_thread():
            for texts in chunks:
                yield encode_chunk(texts, tok, dtype, affixes)
        return
    method = "fork" if "fork" in multiprocessing.get_all_start_methods() else "spawn"
    ctx = multiprocessing.get_context(method)
    with ctx.Pool(workers, initializer=_init_worker, initargs=(tok, dtype, affixes)) as pool:
        pending: deque = deque()
        for texts in chunks:
            pending.append(pool.apply_async(_encode_in_worker, (texts,)))
            if len(pending) >= 4 * workers:
                yield pending.popleft().get()
        while pending:
            yield pending.popleft().get()


# -- finishing ---------------------------------------------------------------------------------------------

def _offsets(part: Path, num_docs: int) -> np.ndarray:
    return np.memmap(part / _RAW_OFFSETS, dtype="<i8", mode="r", shape=(num_docs + 1,))


def _finish_tpzoo(part: Path, tok, dtype, num_docs, num_tokens, append_eos, prepend_bos, sources,
                  save_tokenizer) -> None:
    """Turn the partial directory into a tpzoo token store (docs/data.md)."""
    raw = part / _RAW_OFFSETS
    with (part / OFFSETS_FILE).open("wb") as out, raw.open("rb") as src:  # an .npy header, the bytes streamed
        np.lib.format.write_array_header_1_0(out, {"descr": "<i8", "fortran_order": False,
                                                   "shape": (num_docs + 1,)})
        shutil.copyfileobj(src, out, 1 << 20)
    raw.unlink()
    (part / PROGRESS_FILE).unlink(missing_ok=True)
    tok_meta = {"spec": tok.spec, "vocab_size": tok.vocab_size, "eos_id": tok.eos_id, "bos_id": tok.bos_id,
                "pad_id": tok.pad_id, "dir": None}
    if save_tokenizer:
        tok.save(part / TOKENIZER_DIR)
        tok_meta["dir"] = TOKENIZER_DIR
    index = {"format": FORMAT, "version": VERSION, "dtype": dtype.name, "num_tokens": num_tokens,
             "num_docs": num_docs, "append_eos": append_eos, "prepend_bos": prepend_bos,
             "tokenizer": tok_meta, "sources": [str(s) for s in (sources or [])]}
    (part / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")


def _replace(moves: list[tuple[Path, Path]], force: bool) -> None:
    """Rename each finished file or directory onto its output; with ``force`` an existing one is moved aside
    first and removed after."""
    old = []
    for src, dst in moves:
        if dst.exists():
            if not force:
                raise FileExistsError(f"token store output {dst} appeared while preprocessing; not replaced")
            aside = dst.parent / f".{dst.name}.old-{uuid.uuid4().hex[:8]}"
            os.rename(dst, aside)
            old.append(aside)
        os.rename(src, dst)
    for p in old:
        shutil.rmtree(p, ignore_errors=True) if p.is_dir() else p.unlink()

