"""tpzoo.data: corpora -> tokens -> packed sequences, for pretraining and supervised fine-tuning.

  tokenizer.py    load_tokenizer("byte" | dir), ByteTokenizer, HFTokenizer, train_bpe
  sources.py      iter_documents(paths | hub name), default_corpus() (the stdlib's .py files)
  token_store.py  TokenStore (memory-mapped tokens.bin), open_store (a tpzoo store or a Megatron prefix)
  preprocessing.py preprocess(documents, tokenizer, out_dir, workers=N, format="tpzoo"|"megatron"): on every
                  core, ordered, atomic, resumable
  megatron.py     Megatron-LM's indexed dataset (PREFIX.bin + PREFIX.idx, MMIDIDX): MegatronStore, write_index
  mixture.py      weighted corpus mixtures: parse_mixture (WEIGHT PATH pairs), Blend, MixtureLoader
  packed.py       PackedDataset (seq_len + 1 windows, doc-boundary masking, document ids), packed_loader
  loader.py       ResumableLoader (seeded, DP-sharded, exactly resumable, prefetching), micro_batches_per_step
  sft.py          SFT JSONL (prompt/response or messages) -> packed (whole examples, document ids) or padded
                  samples with prompt masking

Formats and on-disk layout: docs/data.md.
"""
from .loader import ResumableLoader, collate_long, micro_batches_per_step
from .packed import IGNORE_INDEX, PackedDataset, packed_loader, single_documents_dropped
from .sft import (PackedSFTDataset, PaddedSFTDataset, SFTDatasets, build_sft_dataset, build_sft_datasets,
                  encode_sft_example, load_sft_records, split_records)
from .sources import SourceError, default_corpus, expand_paths, iter_documents
from .megatron import MegatronStore
from .mixture import Blend, MixtureLoader, MixtureSource, parse_mixture
from .preprocessing import default_workers, preprocess
from .token_store import TokenStore, is_token_store, open_store
from .tokenizer import ByteTokenizer, HFTokenizer, load_tokenizer, train_bpe

__all__ = ["Blend", "ByteTokenizer", "HFTokenizer", "IGNORE_INDEX", "MegatronStore", "MixtureLoader",
           "MixtureSource", "PackedDataset", "PackedSFTDataset", "PaddedSFTDataset", "ResumableLoader",
           "SFTDatasets", "SourceError", "TokenStore", "build_sft_dataset", "build_sft_datasets", "collate_long",
           "default_corpus", "default_workers", "encode_sft_example", "expand_paths", "is_token_store",
           "iter_documents", "load_sft_records", "load_tokenizer", "micro_batches_per_step", "open_store",
           "packed_loader", "parse_mixture", "preprocess", "single_documents_dropped", "split_records", "train_bpe"]
