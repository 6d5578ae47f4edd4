"""Supervised fine-tuning data: JSONL examples -> token ids with a loss mask -> packed or padded samples.

Record formats (one JSON object per line):
  {"prompt": "...", "response": "..."}
  {"messages": [{"role": "system"|"user"|"assistant"|"tool", "content": "..."}, ...]}  (>= 1 assistant turn)

Rendering (``template=``):
  - ``"auto"`` (default): the tokenizer's chat template when it has one, else the fallback format. A
    prompt/response record is the conversation ``[user: prompt, assistant: response]``.
  - ``"fallback"``: always the fallback format. Each message is ``"<|{role}|>\\n"`` then its content; a
    non-assistant message ends with ``"\\n"``, an assistant message with the EOS token. For example
    ``<|user|>\\nHi\\n<|assistant|>\\nHello<eos>``.
  - ``"raw"``: prompt/response records only: ``prompt + response + <eos>``, verbatim (the prompt carries its own
    formatting).
Loss is on the assistant turns only: the tokens of every assistant message's content (with a chat template: the
text the template renders for that turn after the generation prompt, end-of-turn marker included) and the EOS
after it; every other token (system, user, role headers, template scaffolding) gets label -100. Every example
ends with EOS: it is appended (and trained) when the last token is not already EOS. With a chat template the
conversation is rendered prefix by prefix (``messages[:i]`` with the generation prompt, then ``messages[:i+1]``)
and each piece is tokenized on its own, so the mask is exact; a template whose renderings are not prefixes of one
another is rejected with an error.

Samples (both in the shifted convention of `tpzoo.data.packed`: ``labels[t]`` is the target of position ``t``):
  - ``packing=True``: examples are concatenated into one stream and cut into ``seq_len + 1`` windows by
    `PackedDataset`; a label whose target is the first token of an example is -100 (no prediction across
    examples), as is every label whose target is not a trained token.
  - ``packing=False``: one example per sample, truncated to ``seq_len + 1`` tokens, inputs padded with the
    tokenizer's pad id and labels with -100. Examples left without any trained label are dropped (warned).
SFT sets are held in memory (tokenized once when built). ``eval_fraction`` holds out a deterministic, seeded
subset of *examples* (before packing, so no example is split between train and eval).
"""
from __future__ import annotations

import os
import warnings
from typing import NamedTuple

import numpy as np

from tpzoo.errors import ConfigError, DataError

from .packed import IGNORE_INDEX, PackedDataset
from .sources import read_jsonl_records
from .tokenizer import load_tokenizer

ROLES = ("system", "user", "assistant", "tool")

__all__ = ["load_sft_records", "encode_sft_example", "split_records", "PaddedSFTDataset", "SFTDatasets",
           "build_sft_dataset", "build_sft_datasets"]


def _check_record(record, where: str) -> dict:
    if not isinstance(record, dict):
        raise DataError(f"{where}: expected a JSON object, got {type(record).__name__}")
    if "messages" in record:
        msgs = record["messages"]
        if not isinstance(msgs, list) or not msgs:
            raise DataError(f"{where}: 'messages' must be a non-empty list")
        for m in msgs:
            if not isinstance(m, dict) or m.get("role") not in ROLES or not isinstance(m.get("content"), str):
                raise DataError(f"{where}: each message needs 'role' in {ROLES} and a string 'content': {m!r}")
        if not any(m["role"] == "assistant" for m in msgs):
            raise DataError(f"{where}: no assistant message (nothing to train on)")
        return record
    if isinstance(record.get("prompt"), str) and isinstance(record.get("response"), str):
        return record
    raise DataError(f"{where}: expected {{'prompt', 'response'}} strings or 'messages'; got keys {sorted(record)}")


def load_sft_records(path: str | os.PathLike) -> list[dict]:
    """Validated records of an SFT JSONL file (blank lines skipped; errors name the file and line, or the byte
    offset of invalid UTF-8). A file without a record is an error: training on it could only fail later, with a
    message about samples rather than the file."""
    records = [_check_record(record, where) for where, record in read_jsonl_records(path)]
    if not records:
        blank = os.path.getsize(path) > 0
        raise DataError(f"{path}: empty file" + (" (only blank lines, no records)" if blank else ""))
    return records


def _template_segments(tok, messages: list[dict]) -> list[tuple[str, bool]]:
    """(text, trained) pieces of a conversation rendered by the tokenizer's chat template."""
    segments, done = [], ""
    for i, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        prompt = tok.apply_chat_template(messages[:i], add_generation_prompt=True) if i else ""
        full = tok.apply_chat_template(messages[:i + 1])
        if not prompt.startswith(done) or not full.startswith(prompt):
            raise DataError("the chat template does not render conversations prefix by prefix (turn "
                             f"{i} changes earlier text), so prompt tokens cannot be masked exactly; "
                             "use template='fallback'")
        segments += [(prompt[len(done):], False), (full[len(prompt):], True)]
        done = full
    rest = tok.apply_chat_template(messages)
    if not rest.startswith(done):
        raise DataError("the chat template renders the whole conversation differently from its prefixes")
    segments.append((rest[len(done):], False))
    return segments


def encode_sft_example(record: dict, tokenizer, *, template: str = "auto",
                       prepend_bos: bool = False) -> tuple[list[int], list[bool]]:
    """Token ids of one record and, per token, whether the loss is taken on it (see the module docstring)."""
    tok = load_tokenizer(tokenizer)
    if tok.eos_id is None:
        raise ConfigError(f"{tok!r} has no eos token")
    if template not in ("auto", "fallback", "raw"):
        raise ConfigError(f"template must be 'auto', 'fallback' or 'raw', got {template!r}")
    _check_record(record, "record")
    ids: list[int] = [tok.bos_id] if prepend_bos and tok.bos_id is not None else []
    mask: list[bool] = [False] * len(ids)

    def add(text_or_ids, trained: bool) -> None:
        piece = tok.encode(text_or_ids) if isinstance(text_or_ids, str) else list(text_or_ids)
        ids.extend(piece)
        mask.extend([trained] * len(piece))

    if template == "raw":
        if "messages" in record:
            raise DataError("template='raw' takes prompt/response records, not messages")
        add(record["prompt"], False)
        add(record["response"], True)
    else:
        messages = record.get("messages") or [{"role": "user", "content": record["prompt"]},
                                              {"role": "assistant", "content": record["response"]}]
        if template == "auto" and tok.chat_template is not None:
            for text, trained in _template_segments(tok, messages):
                add(text, trained)
        else:
            for m in messages:
                add(f"<|{m['role']}|>\n", False)
                if m["role"] == "assistant":
                    add(m["content"], True)
                    add([tok.eos_id], True)
                else:
                    add(m["content"] + "\n", False)
    if not ids or ids[-1] != tok.eos_id:
        add([tok.eos_id], True)
    return ids, mask


def split_records(records: list, eval_fraction: float, seed: int = 0) -> tuple[list, list]:
    """(train, eval): a seeded random ``eval_fraction`` of the records held out; both keep the file order.

    At least one record is held out when ``eval_fraction > 0`` and there are two or more records.
    """
    if not 0.0 <= eval_fraction < 1.0:
        raise ConfigError(f"eval_fraction must be in [0, 1), got {eval_fraction}")
    n = len(records)
    n_eval = int(round(n * eval_fraction))
    if eval_fraction > 0 and n_eval == 0 and n >= 2:
        n_eval = 1
    held = set(np.random.default_rng(seed).permutation(n)[:n_eval].tolist())
    return ([r for i, r in enumerate(records) if i not in held], [r for i, r in enumerate(records) if i in held])


class PaddedSFTDataset:
    """One example per sample: ``{"input_ids", "labels"}`` int64 arrays of ``seq_len``, padded (see above)."""

    def __init__(self, examples: list[tuple[list[int], list[bool]]], seq_len: int, pad_id: int):
        if pad_id is None:
            raise ConfigError("padding needs a pad id (the tokenizer has neither pad nor eos)")
        self.seq_len, self.pad_id = seq_len, pad_id
        self.examples, self.num_dropped, self.num_truncated = [], 0, 0
        for ids, mask in examples:
            if len(ids) > seq_len + 1:
                self.num_truncated += 1
                ids, mask = ids[:seq_len + 1], mask[:seq_len + 1]
            if not any(mask[1:]):
                self.num_dropped += 1
                continue
            self.examples.append((np.asarray(ids, dtype=np.int64), np.asarray(mask, dtype=bool)))
        if self.num_dropped:
            warnings.warn(f"{self.num_dropped} SFT examples have no trained token within seq_len={seq_len} "
                          "and were dropped", stacklevel=2)

    def __len__(self) -> int:
        return len(self.examples)

    def __getitem__(self, i: int) -> dict[str, np.ndarray]:
        ids, mask = self.examples[i]
        n = len(ids) - 1
        input_ids = np.full(self.seq_len, self.pad_id, dtype=np.int64)
        labels = np.full(self.seq_len, IGNORE_INDEX, dtype=np.int64)
        input_ids[:n] = ids[:-1]
        labels[:n] = np.where(mask[1:], ids[1:], IGNORE_INDEX)
        return {"input_ids": input_ids, "labels": labels}


def build_sft_dataset(records: list[dict], tokenizer, seq_len: int, *, packing: bool = True,
                      template: str = "auto", prepend_bos: bool = False):
    """A `PackedDataset` (``packing=True``) or `PaddedSFTDataset` of ``records``, ready for `ResumableLoader`."""
    tok = load_tokenizer(tokenizer)
    examples = [encode_sft_example(r, tok, template=template, prepend_bos=prepend_bos) for r in records]
    if not packing:
        return PaddedSFTDataset(examples, seq_len, tok.pad_id)
    lengths = np.array([len(ids) for ids, _ in examples], dtype=np.int64)
    offsets = np.concatenate([[0], np.cumsum(lengths)])
    tokens = np.fromiter((t for ids, _ in examples for t in ids), dtype=np.int64, count=int(offsets[-1]))
    loss_mask = np.fromiter((m for _, mask in examples for m in mask), dtype=bool, count=int(offsets[-1]))
    return PackedDataset(tokens, seq_len, respect_doc_boundaries=True, doc_offsets=offsets, loss_mask=loss_mask)


class SFTDatasets(NamedTuple):
    train: object
    eval: object | None


def build_sft_datasets(source, tokenizer, seq_len: int, *, packing: bool = True, eval_fraction: float = 0.0,
                       seed: int = 0, template: str = "auto", prepend_bos: bool = False) -> SFTDatasets:
    """Train and held-out SFT datasets from a JSONL path (or a list of records); ``eval`` is None without a split.

    Feed each to ``ResumableLoader(dataset, micro_batch_size, dp_rank=..., dp_size=..., seed=...)`` for batches
    ``{"input_ids": LongTensor[b, seq_len], "labels": LongTensor[b, seq_len]}``.
    """
    records = source if isinstance(source, list) else load_sft_records(source)
    train, held = split_records(records, eval_fraction, seed)
    kw = dict(packing=packing, template=template, prepend_bos=prepend_bos)
    return SFTDatasets(build_sft_dataset(train, tokenizer, seq_len, **kw),
                       build_sft_dataset(held, tokenizer, seq_len, **kw) if held else None)
