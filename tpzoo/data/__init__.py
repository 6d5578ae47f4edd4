"""tpzoo.data: corpora -> tokens -> packed sequences, for pretraining and supervised fine-tuning.

  tokenizer.py    load_tokenizer("byte" | dir), ByteTokenizer, HFTokenizer, train_bpe
  sources.py      iter_documents(paths | hub name), default_corpus() (the stdlib's .py files)
  token_store.py  preprocess(documents, tokenizer, out_dir) -> TokenStore (memory-mapped tokens.bin)
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
from .token_store import TokenStore, preprocess
from .tokenizer import ByteTokenizer, HFTokenizer, load_tokenizer, train_bpe

__all__ = ["ByteTokenizer", "HFTokenizer", "IGNORE_INDEX", "PackedDataset", "PackedSFTDataset", "PaddedSFTDataset",
           "ResumableLoader", "SFTDatasets", "SourceError", "TokenStore", "build_sft_dataset", "build_sft_datasets",
           "collate_long", "default_corpus", "encode_sft_example", "expand_paths", "iter_documents",
           "load_sft_records", "load_tokenizer", "micro_batches_per_step", "packed_loader", "preprocess",
           "single_documents_dropped", "split_records", "train_bpe"]
