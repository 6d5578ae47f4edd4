"""The run's tokenizer, model config and datasets: a corpus tokenized once into a cached token store (pretrain) or
an SFT JSONL file (fine-tuning), each with a held-out split, and the resumable data-parallel loaders over them."""
from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import torch.distributed as dist

from tpzoo.data import (PackedDataset, ResumableLoader, TokenStore, build_sft_datasets, default_corpus, iter_documents,
                        load_tokenizer, preprocess)
from tpzoo.errors import ConfigError


def resolve_tokenizer(cfg):
    """--tokenizer, else the base checkpoint's / HF dir's tokenizer, else the byte tokenizer."""
    if cfg.tokenizer:
        return load_tokenizer(cfg.tokenizer)
    if cfg.base:
        try:
            return load_tokenizer(cfg.base)
        except FileNotFoundError:
            pass  # a base without a saved tokenizer: fall through to the byte tokenizer
    return load_tokenizer("byte")


class Window:
    """Samples [start, stop) of a map-style dataset (the train / held-out split of a packed corpus)."""

    def __init__(self, dataset, start: int, stop: int):
        self.dataset, self.start, self.stop = dataset, start, stop

    def __len__(self) -> int:
        return self.stop - self.start

    def __getitem__(self, i: int):
        if not 0 <= i < len(self):
            raise IndexError(i)
        return self.dataset[self.start + i]


def _barrier() -> None:
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()


def token_store_for(sources: list[str], tokenizer, cache_dir: str, text_field: str = "text") -> TokenStore:
    """The token store of `sources` (default: the stdlib corpus) under `cache_dir`, built by global rank 0 on
    first use (other ranks wait; the directory must be visible to every rank, e.g. a shared file system).
    A single source that already is a token store is used as is."""
    if len(sources) == 1 and (Path(sources[0]) / "index.json").is_file():
        return TokenStore(sources[0])
    name = "stdlib" if not sources else Path(sources[0]).stem or "data"
    files = [str(p) for p in default_corpus()] if not sources else list(sources)
    key = json.dumps({"sources": [os.path.abspath(s) if os.path.exists(s) else s for s in files],
                      "tokenizer": str(tokenizer.spec), "vocab": tokenizer.vocab_size, "field": text_field})
    out = Path(cache_dir) / f"{name}-{hashlib.sha1(key.encode()).hexdigest()[:12]}"
    rank = dist.get_rank() if dist.is_initialized() else 0
    if rank == 0 and not (out / "index.json").is_file():
        preprocess(iter_documents(files, text_field=text_field), tokenizer, out, force=True,
                   sources=sources or ["<stdlib>"])
    _barrier()
    return TokenStore(out)


def build_datasets(cfg, tokenizer):
    """(train dataset, held-out dataset or None, description) for cfg.task."""
    if cfg.task == "sft":
        if len(cfg.data) != 1:
            raise ConfigError("fine-tuning needs exactly one SFT JSONL file: --data PATH.jsonl")
        sets = build_sft_datasets(cfg.data[0], tokenizer, cfg.seq_len, packing=cfg.packing,
                                  eval_fraction=cfg.eval_fraction, seed=cfg.seed, template=cfg.template)
        return sets.train, sets.eval, f"SFT {cfg.data[0]} ({'packed' if cfg.packing else 'padded'})"
    store = token_store_for(cfg.data, tokenizer, cfg.data_cache, cfg.text_field)
    packed = PackedDataset(store, cfg.seq_len, respect_doc_boundaries=True, document_masking=cfg.document_masking)
    n = len(packed)
    n_eval = int(n * cfg.eval_fraction)
    train = Window(packed, 0, n - n_eval)
    held = Window(packed, n - n_eval, n) if n_eval else None
    masked = ", document masking" if cfg.document_masking else ""
    return train, held, f"{store.path} ({store.num_tokens:,} tokens, {store.num_docs} docs{masked})"


def make_loader(dataset, cfg, dp_rank: int, dp_size: int, *, pin_memory: bool = False) -> ResumableLoader:
    """Training batches: shuffled (seeded), endless, prefetched (the held-out ones: tpzoo.train.heldout).
    pin_memory: host batches in page-locked memory (when the run computes on a GPU)."""
    return ResumableLoader(dataset, cfg.micro_batch_size, dp_rank=dp_rank, dp_size=dp_size, seed=cfg.seed,
                           shuffle=True, prefetch=cfg.prefetch, pin_memory=pin_memory)
