"""A teacher's top-K, written once: `tpzoo distill-cache` stores, for every trained (response) position of an SFT
file, the teacher's K most likely token ids and their log-probabilities, memory-mapped; `tpzoo finetune --objective
distill --teacher DIR` reads them with the batches instead of running the teacher (which then never loads beside
the student: it ran on its own, at its own layout).

    DIR/index.json       format, K, vocabulary, seq_len, template, tokenizer, teacher, data, records, positions
    DIR/ids.npy          int32 [positions, K]   the teacher's top-K ids per trained position, most likely first
    DIR/logprobs.npy     fp32 [positions, K]    their log-probabilities (T = 1, over the whole vocabulary)
    DIR/offsets.npy      int64 [records + 1]    record r's positions are rows offsets[r]:offsets[r + 1]
    DIR/hashes.npy       uint64 [records]       a hash of each record's token ids (as encoded, up to seq_len + 1)

Positions are those SFT trains (tpzoo.data.sft: labels that are not ignored), record by record in file order, each
record encoded and truncated to seq_len + 1 tokens as SFT does; 8 K bytes per position (64 at K = 8). A run reads
the rows of its own examples (any split, packing, micro-batch), checking each record's hash (another tokenizer,
template or file is one line) and that the cache covers its positions (a run's seq_len up to the cache's); a K up
to the cache's takes the first K columns. Written atomically (a temporary directory renamed into place).
"""
from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import numpy as np

from tpzoo.data import IGNORE_INDEX
from tpzoo.data.sft import (PackedSFTDataset, PaddedSFTDataset, encode_sft_example, load_sft_records,
                            split_records)
from tpzoo.errors import ConfigError, DataError

FORMAT = "tpzoo-teacher-cache"
INDEX = "index.json"


def is_teacher_cache(path) -> bool:
    return bool(path) and (Path(path) / INDEX).is_file()


def read_index(path) -> dict:
    try:
        meta = json.loads((Path(path) / INDEX).read_text())
    except (OSError, ValueError) as e:
        raise DataError(f"{Path(path) / INDEX}: not readable ({e})") from None
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        raise DataError(f"{Path(path) / INDEX}: not a tpzoo teacher cache")
    return meta


def record_hash(ids) -> int:
    return int.from_bytes(hashlib.blake2b(np.asarray(ids, dtype=np.int64).tobytes(), digest_size=8).digest(),
                          "little")


def encoded_records(records: list, tokenizer, seq_len: int, template: str) -> list[tuple[np.ndarray, np.ndarray]]:
    """Each record as SFT encodes it, truncated to seq_len + 1 tokens: (ids, trained mask) arrays."""
    out = []
    for r in records:
        ids, mask = encode_sft_example(r, tokenizer, template=template)
        out.append((np.asarray(ids[:seq_len + 1], dtype=np.int64), np.asarray(mask[:seq_len + 1], dtype=bool)))
    return out


class TeacherCache:
    """A cache directory, memory-mapped (see the module docstring)."""

    def __init__(self, path):
        self.path = Path(path)
        self.meta = read_index(path)
        self.topk, self.vocab_size, self.seq_len = self.meta["topk"], self.meta["vocab_size"], self.meta["seq_len"]
        self.ids = np.load(self.path / "ids.npy", mmap_mode="r")
        self.logprobs = np.load(self.path / "logprobs.npy", mmap_mode="r")
        self.offsets = np.load(self.path / "offsets.npy")
        self.hashes = np.load(self.path / "hashes.npy")
        if self.ids.shape != self.logprobs.shape or self.ids.shape[0] != self.offsets[-1]:
            raise DataError(f"{self.path}: ids {self.ids.shape}, logprobs {self.logprobs.shape} and offsets "
                            f"(ending at {self.offsets[-1]}) disagree")

    def check(self, vocab_size: int, k: int) -> None:
        if self.vocab_size != vocab_size:
            raise ConfigError(f"teacher cache {self.path} was written by a teacher with a vocabulary of "
                              f"{self.vocab_size}, the student has {vocab_size}")
        if k > self.topk:
            raise ConfigError(f"--distill-topk {k}: the teacher cache {self.path} holds the top {self.topk}")

    def rows(self, record: int, n: int) -> tuple[np.ndarray, np.ndarray]:
        start = int(self.offsets[record])
        if n > self.offsets[record + 1] - start:
            raise DataError(f"the teacher cache {self.path} holds {self.offsets[record + 1] - start} positions of "
                            f"record {record + 1}, the run trains {n} (a longer --seq-len than the cache's "
                            f"{self.seq_len}?)")
        return self.ids[start:start + n], self.logprobs[start:start + n]


class CachedTeacherDataset:
    """An SFT dataset whose samples also carry the teacher's top K per position: ``teacher_ids`` int64 and
    ``teacher_logprobs`` fp32 [seq_len, K] (zeros where nothing is trained)."""

    def __init__(self, base, records: list[int], cache: TeacherCache, k: int):
        self.base, self.records, self.cache, self.k = base, records, cache, k
        self.examples = base.examples

    def __len__(self) -> int:
        return len(self.base)

    def __getitem__(self, i: int) -> dict:
        sample = self.base[i]
        s = len(sample["labels"])
        ids, logprobs = np.zeros((s, self.k), dtype=np.int64), np.zeros((s, self.k), dtype=np.float32)
        pos = 0
        for j in self.base.rows[i] if hasattr(self.base, "rows") else [i]:
            n = len(self.base.examples[j][0]) - 1
            where = pos + np.nonzero(sample["labels"][pos:pos + n] != IGNORE_INDEX)[0]
            t_ids, t_lp = self.cache.rows(self.records[j], len(where))
            ids[where], logprobs[where] = t_ids[:, :self.k], t_lp[:, :self.k]
            pos += n
        return {**sample, "teacher_ids": ids, "teacher_logprobs": logprobs}


def _dataset(records: list, indices: list[int], cache: TeacherCache, tok, cfg):
    """The SFT dataset of the records `indices` (file order) with their cached top K."""
    kept, which = [], []
    for r in indices:
        ids, mask = encode_sft_example(records[r], tok, template=cfg.template)
        if record_hash(ids[:cache.seq_len + 1]) != int(cache.hashes[r]):
            raise DataError(f"{cfg.data[0]}: record {r + 1} encodes differently than when the teacher cache "
                            f"{cache.path} was written (another data file, tokenizer or --template?)")
        if any(mask[1:cfg.seq_len + 1]):  # SFT drops an example with nothing to train within seq_len + 1
            kept.append((ids, mask))
            which.append(r)
    if indices and not kept:
        raise DataError(f"none of the SFT examples has a trained token within seq_len + 1 = {cfg.seq_len + 1}")
    cls = PackedSFTDataset if cfg.packing else PaddedSFTDataset
    return CachedTeacherDataset(cls(kept, cfg.seq_len, tok.pad_id), which, cache, cfg.distill_topk)


def cached_sft_datasets(cfg, tokenizer, cache: TeacherCache):
    """(train, held-out or None, description): the run's SFT split (as tpzoo.data.sft.split_records makes it)
    with the cached teacher's top K."""
    records = load_sft_records(cfg.data[0])
    if len(records) != cache.meta["records"]:
        raise DataError(f"{cfg.data[0]} has {len(records)} records, the teacher cache {cache.path} "
                        f"{cache.meta['records']} (written for {cache.meta.get('data')})")
    train, held = split_records(list(range(len(records))), cfg.eval_fraction, cfg.seed)
    train_ds = _dataset(records, train, cache, tokenizer, cfg)
    held_ds = _dataset(records, held, cache, tokenizer, cfg) if held else None
    desc = (f"SFT {cfg.data[0]} ({'packed' if cfg.packing else 'padded'}), teacher top {cfg.distill_topk} from "
            f"{cache.path}")
    return train_ds, held_ds, desc


def cache_bytes_per_position(k: int) -> int:
    return k * (np.dtype(np.int32).itemsize + np.dtype(np.float32).itemsize)


def index_of(out_dir, **meta) -> None:
    (Path(out_dir) / INDEX).write_text(json.dumps({"format": FORMAT, "version": 1, **meta}, indent=1) + "\n")


def check_out_dir(out) -> None:
    """The cache's destination: not an existing non-empty directory or a file (one line, nothing written)."""
    p = Path(out)
    if p.exists() and (not p.is_dir() or any(p.iterdir())):
        raise ConfigError(f"--out {out} already exists; give a new directory")


def abspath(p) -> str:
    return os.path.abspath(p) if os.path.exists(p) else str(p)
