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

Samples (both in the shifted convention of `tpzoo.data.packed`: ``labels[t]`` is the target of position ``t``).
Either way an example is truncated to ``seq_len + 1`` tokens (its ``seq_len`` input/label pairs) and one left
without any trained label is dropped (warned):
  - ``packing=False`` (`PaddedSFTDataset`): one example per sample, inputs padded with the tokenizer's pad id and
    labels with -100.
  - ``packing=True`` (`PackedSFTDataset`): whole examples packed into samples of ``seq_len`` slots (best-fit
    decreasing: an example never split between samples), the rest padded; each sample carries ``doc_ids`` (its
    examples 0, 1, ..., the padding last) and ``position_ids`` restarting at each example, so the model attends
    within examples only (models/documents.py). An example's tokens, labels, positions and attention are those
    of its padded sample: packing changes how many slots a step wastes on padding, never the loss or gradient
    (tests/test_documents.py).
  Both carry ``token_mask`` (1 on the examples' tokens, 0 on the padding): the router statistics of a mixture of
  experts skip the padding (transformers' attention mask does the same).
SFT sets are held in memory (tokenized once when built). ``eval_fraction`` holds out a deterministic, seeded
subset of *examples* (before packing, so no example is split between train and eval).
"""
from __future__ import annotations

import bisect
import os
import warnings
from typing import NamedTuple

import numpy as np

from tpzoo.errors import ConfigError, DataError

from .packed import IGNORE_INDEX, documents_of
from .sources import read_jsonl_records
from .tokenizer import load_tokenizer

ROLES = ("system", "user", "assistant", "tool")

__all__ = ["load_sft_records", "encode_sft_example", "split_records", "PaddedSFTDataset", "PackedSFTDataset",
           "SFTDatasets", "build_sft_dataset", "build_sft_datasets", "pack_lengths"]


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


def _trainable(examples: list[tuple[list[int], list[bool]]], seq_len: int):
    """(examples as (ids, mask) arrays truncated to seq_len + 1 tokens, those with a trained label only;
    number dropped; number truncated), warning about the dropped."""
    kept, dropped, truncated = [], 0, 0
    for ids, mask in examples:
        if len(ids) > seq_len + 1:
            truncated += 1
            ids, mask = ids[:seq_len + 1], mask[:seq_len + 1]
        if not any(mask[1:]):
            dropped += 1
            continue
        kept.append((np.asarray(ids, dtype=np.int64), np.asarray(mask, dtype=bool)))
    if examples and not kept:
        raise DataError(f"none of the {dropped} SFT examples has a trained token within its first seq_len + 1 = "
                        f"{seq_len + 1} tokens (a longer --seq-len, or shorter prompts)")
    if dropped:
        warnings.warn(f"{dropped} SFT examples have no trained token within seq_len={seq_len} and were dropped",
                      stacklevel=3)
    return kept, dropped, truncated


def _shifted(ids: np.ndarray, mask: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(inputs, labels) of one example: each token but the last predicts the next, where that one is trained."""
    return ids[:-1], np.where(mask[1:], ids[1:], IGNORE_INDEX)


def _real_tokens(n: int, seq_len: int) -> np.ndarray:
    """``token_mask`` of a sample whose first `n` slots hold examples: 1 there, 0 on the padding. A mixture of
    experts' router statistics count only these tokens, as transformers' do given the attention mask, so padding
    never enters the load-balancing and z-losses and a packed batch's router losses equal those of the same
    examples padded."""
    return (np.arange(seq_len) < n).astype(np.int64)


class PaddedSFTDataset:
    """One example per sample: ``{"input_ids", "labels", "token_mask"}`` int64 arrays of ``seq_len``, padded (see
    above)."""

    def __init__(self, examples: list[tuple[list[int], list[bool]]], seq_len: int, pad_id: int):
        if pad_id is None:
            raise ConfigError("padding needs a pad id (the tokenizer has neither pad nor eos)")
        self.seq_len, self.pad_id = seq_len, pad_id
        self.examples, self.num_dropped, self.num_truncated = _trainable(examples, seq_len)

    def __len__(self) -> int:
        return len(self.examples)

    def __getitem__(self, i: int) -> dict[str, np.ndarray]:
        inputs, targets = _shifted(*self.examples[i])
        input_ids = np.full(self.seq_len, self.pad_id, dtype=np.int64)
        labels = np.full(self.seq_len, IGNORE_INDEX, dtype=np.int64)
        input_ids[:len(inputs)], labels[:len(inputs)] = inputs, targets
        return {"input_ids": input_ids, "labels": labels, "token_mask": _real_tokens(len(inputs), self.seq_len)}


def pack_lengths(lengths: list[int], capacity: int) -> list[list[int]]:
    """Best-fit decreasing: indices of `lengths` (each <= capacity) grouped into bins of at most `capacity`,
    longest first, each into the fullest bin it fits (a new bin when none). Deterministic (ties: input order).
    Bins by free space: a sorted list of the distinct free amounts (at most capacity + 1) and a stack of bins
    for each, so placing an item costs a bisection, not a scan of the bins."""
    bins: list[list[int]] = []
    free: list[int] = []  # sorted distinct free amounts that some bin has
    with_free: dict[int, list[int]] = {}  # free amount -> bins that have it
    for i in sorted(range(len(lengths)), key=lambda j: -lengths[j]):
        n = lengths[i]
        at = bisect.bisect_left(free, n)
        if at == len(free):
            b, room = len(bins), capacity
            bins.append([])
        else:
            room = free[at]
            b = with_free[room].pop()
            if not with_free[room]:
                del free[at], with_free[room]
        bins[b].append(i)
        if room - n not in with_free:
            bisect.insort(free, room - n)
            with_free[room - n] = []
        with_free[room - n].append(b)
    return bins


class PackedSFTDataset:
    """Whole examples packed into samples of ``seq_len`` (see above): ``{"input_ids", "labels", "token_mask",
    "doc_ids", "position_ids"}`` int64 arrays; ``rows[i]`` are the examples of sample ``i``, in order."""

    def __init__(self, examples: list[tuple[list[int], list[bool]]], seq_len: int, pad_id: int):
        if pad_id is None:
            raise ConfigError("packing pads each sample's tail and needs a pad id (the tokenizer has neither pad "
                              "nor eos)")
        self.seq_len, self.pad_id = seq_len, pad_id
        self.examples, self.num_dropped, self.num_truncated = _trainable(examples, seq_len)
        self.rows = pack_lengths([len(ids) - 1 for ids, _ in self.examples], seq_len)

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i: int) -> dict[str, np.ndarray]:
        parts = [_shifted(*self.examples[j]) for j in self.rows[i]]
        used = sum(len(inputs) for inputs, _ in parts)
        pad = self.seq_len - used
        input_ids = np.concatenate([p[0] for p in parts] + [np.full(pad, self.pad_id, dtype=np.int64)])
        labels = np.concatenate([p[1] for p in parts] + [np.full(pad, IGNORE_INDEX, dtype=np.int64)])
        starts = np.cumsum([len(inputs) for inputs, _ in parts])[:-1 if pad == 0 else None]  # the padding: last
        return {"input_ids": input_ids, "labels": labels, "token_mask": _real_tokens(used, self.seq_len),
                **documents_of(starts, self.seq_len)}


def build_sft_dataset(records: list[dict], tokenizer, seq_len: int, *, packing: bool = True,
                      template: str = "auto", prepend_bos: bool = False):
    """A `PackedSFTDataset` (``packing=True``) or `PaddedSFTDataset` of ``records``, ready for `ResumableLoader`."""
    tok = load_tokenizer(tokenizer)
    examples = [encode_sft_example(r, tok, template=template, prepend_bos=prepend_bos) for r in records]
    return (PackedSFTDataset if packing else PaddedSFTDataset)(examples, seq_len, tok.pad_id)


class SFTDatasets(NamedTuple):
    train: object
    eval: object | None


def build_sft_datasets(source, tokenizer, seq_len: int, *, packing: bool = True, eval_fraction: float = 0.0,
                       seed: int = 0, template: str = "auto", prepend_bos: bool = False) -> SFTDatasets:
    """Train and held-out SFT datasets from a JSONL path (or a list of records); ``eval`` is None without a split.

    Feed each to ``ResumableLoader(dataset, micro_batch_size, dp_rank=..., dp_size=..., seed=...)`` for batches
    ``{"input_ids": LongTensor[b, seq_len], "labels": LongTensor[b, seq_len], "token_mask": ...}`` (and
    ``doc_ids``, ``position_ids`` when packed).
    """
    records = source if isinstance(source, list) else load_sft_records(source)
    train, held = split_records(records, eval_fraction, seed)
    kw = dict(packing=packing, template=template, prepend_bos=prepend_bos)
    return SFTDatasets(build_sft_dataset(train, tokenizer, seq_len, **kw),
                       build_sft_dataset(held, tokenizer, seq_len, **kw) if held else None)
