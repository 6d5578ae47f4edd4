"""The run's tokenizer, model config and datasets: a corpus tokenized once into a cached token store, or a weighted
mixture of such corpora (pretrain), or an SFT JSONL file (fine-tuning), each with a held-out split (per source for
a mixture), and the resumable data-parallel loaders over them; the per-source metrics of a mixture."""
from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import torch.distributed as dist

from tpzoo.data import (MegatronStore, MixtureLoader, PackedDataset, ResumableLoader, build_sft_datasets,
                        default_corpus, is_token_store, iter_documents, open_store, parse_mixture,
                        preprocess)
from tpzoo.errors import ConfigError


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


def token_store_for(sources: list[str], tokenizer, cache_dir: str, text_field: str = "text"):
    """The token store of `sources` (default: the stdlib corpus) under `cache_dir`, built by global rank 0 on
    first use (other ranks wait; the directory must be visible to every rank, e.g. a shared file system).
    A single source that already is a token store (tpzoo's, or a Megatron dataset prefix) is used as is, once its
    tokenizer is known to match the run's (a one-line error naming both otherwise)."""
    if len(sources) == 1 and is_token_store(sources[0]):
        store = open_store(sources[0])
        store.check_tokenizer(tokenizer)  # a tpzoo store: its recorded tokenizer; a Megatron dataset: its ids
        return store
    name = "stdlib" if not sources else Path(sources[0]).stem or "data"
    files = [str(p) for p in default_corpus()] if not sources else list(sources)
    key = json.dumps({"sources": [os.path.abspath(s) if os.path.exists(s) else s for s in files],
                      "tokenizer": str(tokenizer.spec), "vocab": tokenizer.vocab_size, "field": text_field})
    out = Path(cache_dir) / f"{name}-{hashlib.sha1(key.encode()).hexdigest()[:12]}"
    rank = dist.get_rank() if dist.is_initialized() else 0
    if rank == 0 and not (out / "index.json").is_file():
        preprocess(iter_documents(files, text_field=text_field), tokenizer, out, force=True,
                   sources=sources or ["<stdlib>"], resume=True, resume_key={"text_field": text_field})
    _barrier()
    return open_store(out)


class MixtureData:
    """The training windows of each source of a weighted mixture; `make_loader` blends them (MixtureLoader)."""

    def __init__(self, sources, datasets):
        self.sources, self.datasets = sources, datasets

    def __len__(self) -> int:
        return sum(len(d) for d in self.datasets)


def _packed_split(store, cfg, tokenizer):
    """(train windows, held-out windows or None) of one token store: the held-out split is its last windows."""
    check = tokenizer if isinstance(store, MegatronStore) else None  # ids a Megatron dataset holds, checked as read
    packed = PackedDataset(store, cfg.seq_len, respect_doc_boundaries=True, document_masking=cfg.document_masking,
                           check_tokenizer=check)
    n = len(packed)
    n_eval = int(n * cfg.eval_fraction)
    return Window(packed, 0, n - n_eval), (Window(packed, n - n_eval, n) if n_eval else None)


def _mixture_datasets(cfg, tokenizer, mixture):
    stores = [token_store_for([s.path], tokenizer, cfg.data_cache, cfg.text_field) for s in mixture]
    splits = [_packed_split(store, cfg, tokenizer) for store in stores]
    held = {s.name: ev for s, (_, ev) in zip(mixture, splits) if ev is not None}
    desc = ", ".join(f"{s.name} {float(s.weight):.3g} ({store.num_tokens:,} tokens)"
                     for s, store in zip(mixture, stores))
    masked = ", document masking" if cfg.document_masking else ""
    return MixtureData(mixture, [tr for tr, _ in splits]), held or None, f"mixture: {desc}{masked}"


def build_datasets(cfg, tokenizer):
    """(train dataset, held-out dataset or None, description) for cfg.task. A weighted mixture gives a
    `MixtureData` and a held-out dataset per source ({name: dataset})."""
    if cfg.task == "sft":
        if len(cfg.data) != 1:
            raise ConfigError("fine-tuning needs exactly one SFT JSONL file: --data PATH.jsonl")
        sets = build_sft_datasets(cfg.data[0], tokenizer, cfg.seq_len, packing=cfg.packing,
                                  eval_fraction=cfg.eval_fraction, seed=cfg.seed, template=cfg.template)
        return sets.train, sets.eval, f"SFT {cfg.data[0]} ({'packed' if cfg.packing else 'padded'})"
    mixture = parse_mixture(cfg.data, cfg.mix)
    if mixture is not None and len(mixture) > 1:
        return _mixture_datasets(cfg, tokenizer, mixture)
    store = token_store_for([mixture[0].path] if mixture else cfg.data, tokenizer, cfg.data_cache, cfg.text_field)
    train, held = _packed_split(store, cfg, tokenizer)
    masked = ", document masking" if cfg.document_masking else ""
    return train, held, f"{store.path} ({store.num_tokens:,} tokens, {store.num_docs} docs{masked})"


def make_loader(dataset, cfg, dp_rank: int, dp_size: int, *, pin_memory: bool = False) -> ResumableLoader:
    """Training batches: shuffled (seeded), endless, prefetched (the held-out ones: tpzoo.train.heldout).
    pin_memory: host batches in page-locked memory (when the run computes on a GPU)."""
    if isinstance(dataset, MixtureData):
        return MixtureLoader(dataset.sources, dataset.datasets, cfg.micro_batch_size, dp_rank=dp_rank,
                             dp_size=dp_size, seed=cfg.seed, prefetch=cfg.prefetch, pin_memory=pin_memory)
    return ResumableLoader(dataset, cfg.micro_batch_size, dp_rank=dp_rank, dp_size=dp_size, seed=cfg.seed,
                           shuffle=True, prefetch=cfg.prefetch, pin_memory=pin_memory)


def data_metrics(loader, seq_len: int) -> dict:
    """A mixture's tokens seen per source since the start of training (global, all ranks): tokens_seen/<name>."""
    counts = loader.source_counts() if hasattr(loader, "source_counts") else {}
    return {f"tokens_seen/{name}": c * seq_len for name, c in counts.items()}


def held_out_losses(trainer) -> dict:
    """{"eval_loss": ...} from `trainer.evaluate()`; for a mixture also eval_loss/<name> per source, and eval_loss
    is their mean weighted by the mixture's weights (over the sources with a held-out split)."""
    if not isinstance(trainer.eval_ds, dict):
        return {"eval_loss": trainer.evaluate()}
    weights = {s.name: float(s.weight) for s in trainer.train_ds.sources}
    losses = {name: trainer.evaluate(ds) for name, ds in trainer.eval_ds.items()}
    out = {f"eval_loss/{name}": loss for name, loss in losses.items()}
    known = {name: loss for name, loss in losses.items() if loss is not None}
    total = sum(weights[n] for n in known)
    out["eval_loss"] = sum(weights[n] * loss for n, loss in known.items()) / total if known else None
    return out
