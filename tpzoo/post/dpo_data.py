"""Preference data for DPO: JSONL pairs -> (chosen, rejected) token ids with their loss masks -> one pair per
sequence, its two responses two documents of it (document masking), the rest padding.

Records (one JSON object per line):
  {"prompt": "...", "chosen": "...", "rejected": "..."}        strings: each side is the SFT example
                                                               {"prompt", "response": chosen | rejected}
  {"chosen": [messages], "rejected": [messages]}               two whole conversations (TRL's implicit prompt):
                                                               the messages they share from the start are the
                                                               prompt, the rest of each (ending with an assistant
                                                               message) its completion
Each side is rendered and masked as tpzoo.data.sft renders an SFT example (the same templates, the same EOS rule):
the log-probability of a side sums its completion's trained tokens (the assistant turns after the prompt, each
with its end-of-turn marker or EOS). A shared assistant turn in a conversation's prompt is not trained.

One pair per sequence: chosen, then rejected, each attending only within itself (doc_ids, position_ids restart),
padding last; `dpo_seq` marks each token's side (1 chosen, 2 rejected, 0 padding), `dpo_row` is the sample's
index (plus the dataset's `row_offset`: the held-out set's rows follow the training set's, so one table of
precomputed reference log-probabilities serves both). So a micro-batch always holds whole pairs and
`--global-batch-size` / `--micro-batch-size` count pairs. A pair longer than seq_len is cut from the end of its
longer side(s) (each keeps at least half of seq_len when both are long); a pair left with no trained token on a
side is dropped (warned).
"""
from __future__ import annotations

import os
import warnings

import numpy as np

from tpzoo.data.packed import IGNORE_INDEX, documents_of
from tpzoo.data.sft import ROLES, encode_sft_example, split_records
from tpzoo.data.sources import read_jsonl_records
from tpzoo.data.tokenizer import load_tokenizer
from tpzoo.errors import ConfigError, DataError

CHOSEN, REJECTED = 1, 2  # dpo_seq values (0: padding)


def _check_messages(msgs, where: str, side: str) -> None:
    if not isinstance(msgs, list) or not msgs:
        raise DataError(f"{where}: {side!r} must be a string or a non-empty list of messages")
    for m in msgs:
        if not isinstance(m, dict) or m.get("role") not in ROLES or not isinstance(m.get("content"), str):
            raise DataError(f"{where}: each message of {side!r} needs 'role' in {ROLES} and a string 'content': {m!r}")
    if msgs[-1]["role"] != "assistant":
        raise DataError(f"{where}: {side!r} must end with an assistant message (the completion being compared)")


def check_pair_record(record, where: str) -> dict:
    """A valid preference record (see the module docstring), or one DataError line naming `where`."""
    if not isinstance(record, dict):
        raise DataError(f"{where}: expected a JSON object, got {type(record).__name__}")
    missing = [k for k in ("chosen", "rejected") if k not in record]
    if missing:
        raise DataError(f"{where}: a preference pair needs 'chosen' and 'rejected'; no "
                        f"{' or '.join(map(repr, missing))} (keys: {sorted(record)})")
    chosen, rejected = record["chosen"], record["rejected"]
    if isinstance(chosen, str) and isinstance(rejected, str):
        if not isinstance(record.get("prompt"), str):
            raise DataError(f"{where}: string 'chosen' / 'rejected' need a string 'prompt'")
        return record
    if "prompt" in record:
        raise DataError(f"{where}: the chat form is 'chosen' and 'rejected' as whole conversations, without 'prompt'")
    _check_messages(chosen, where, "chosen")
    _check_messages(rejected, where, "rejected")
    if _shared(chosen, rejected) >= min(len(chosen), len(rejected)):
        raise DataError(f"{where}: 'chosen' and 'rejected' do not differ after their shared messages")
    return record


def load_pair_records(path: str | os.PathLike) -> list[dict]:
    """Validated records of a preference JSONL file (errors name the file and line)."""
    records = [check_pair_record(r, where) for where, r in read_jsonl_records(path)]
    if not records:
        raise DataError(f"{path}: empty file (no preference pairs)")
    return records


def _shared(a: list, b: list) -> int:
    """How many messages two conversations share from the start (their prompt)."""
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def _runs(mask: list[bool]) -> list[tuple[int, int]]:
    """[start, stop) of each run of trained tokens."""
    out, start = [], None
    for i, m in enumerate(mask + [False]):
        if m and start is None:
            start = i
        elif not m and start is not None:
            out.append((start, i))
            start = None
    return out


def _encode_side(messages: list, prompt_len: int, tok, template: str) -> tuple[list[int], list[bool]]:
    """A whole conversation rendered as SFT renders it, with the assistant turns of its first `prompt_len`
    messages (the shared prompt) no longer trained: each assistant turn is one run of trained tokens, in order."""
    ids, mask = encode_sft_example({"messages": messages}, tok, template=template)
    shared = sum(m["role"] == "assistant" for m in messages[:prompt_len])
    runs = _runs(mask)
    if len(runs) < sum(m["role"] == "assistant" for m in messages):
        raise DataError("the chat template renders two assistant turns without anything between them, so the "
                        "prompt's turns cannot be told from the completion's; use --template fallback")
    for start, stop in runs[:shared]:
        mask[start:stop] = [False] * (stop - start)
    return ids, mask


def encode_pair(record: dict, tokenizer, template: str = "auto") -> tuple[tuple, tuple]:
    """((chosen ids, mask), (rejected ids, mask)) of one record (see the module docstring)."""
    tok = load_tokenizer(tokenizer)
    if isinstance(record["chosen"], str):
        return tuple(encode_sft_example({"prompt": record["prompt"], "response": record[side]}, tok,
                                        template=template) for side in ("chosen", "rejected"))
    if template == "raw":
        raise DataError("template 'raw' takes prompt/chosen/rejected strings, not conversations")
    n = _shared(record["chosen"], record["rejected"])
    return tuple(_encode_side(record[side], n, tok, template) for side in ("chosen", "rejected"))


def _fit(a: int, b: int, budget: int) -> tuple[int, int]:
    """Input lengths of the two sides cut to fit `budget` slots together (the longer ones cut first)."""
    if a + b <= budget:
        return a, b
    half = budget // 2
    if a <= half:
        return a, budget - a
    if b <= half:
        return budget - b, b
    return half, budget - half


def _shifted(ids: np.ndarray, mask: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    return ids[:-1], np.where(mask[1:], ids[1:], IGNORE_INDEX)


class PreferenceDataset:
    """One pair per sample: ``{"input_ids", "labels", "token_mask", "doc_ids", "position_ids", "dpo_seq"}``
    int64 arrays of ``seq_len`` and the scalar ``dpo_row`` (see the module docstring). ``lengths[i]``: the
    (chosen, rejected) trained tokens of pair i."""

    def __init__(self, pairs: list[tuple[tuple, tuple]], seq_len: int, pad_id: int, row_offset: int = 0):
        if pad_id is None:
            raise ConfigError("DPO pads each sequence's tail and needs a pad id (the tokenizer has neither pad nor "
                              "eos)")
        if seq_len < 2:
            raise ConfigError(f"seq_len {seq_len} cannot hold a pair (two responses of at least one token)")
        self.seq_len, self.pad_id, self.row_offset = seq_len, pad_id, row_offset
        self.pairs, dropped = [], 0
        for (ci, cm), (ri, rm) in pairs:
            a, b = _fit(len(ci) - 1, len(ri) - 1, seq_len)
            c = (np.asarray(ci[:a + 1], dtype=np.int64), np.asarray(cm[:a + 1], dtype=bool))
            r = (np.asarray(ri[:b + 1], dtype=np.int64), np.asarray(rm[:b + 1], dtype=bool))
            if not (c[1][1:].any() and r[1][1:].any()):
                dropped += 1
                continue
            self.pairs.append((c, r))
        if pairs and not self.pairs:
            raise DataError(f"none of the {dropped} preference pairs keeps a trained token on both sides within "
                            f"seq_len {seq_len} (a longer --seq-len, or shorter prompts)")
        if dropped:
            warnings.warn(f"{dropped} preference pairs have no trained token on a side within seq_len={seq_len} "
                          f"and were dropped", stacklevel=2)
        self.num_dropped = dropped

    def __len__(self) -> int:
        return len(self.pairs)

    def __getitem__(self, i: int) -> dict[str, np.ndarray]:
        (c_in, c_lab), (r_in, r_lab) = (_shifted(*side) for side in self.pairs[i])
        used = len(c_in) + len(r_in)
        pad = self.seq_len - used
        starts = np.array([len(c_in)] + ([used] if pad else []), dtype=np.int64)
        return {"input_ids": np.concatenate([c_in, r_in, np.full(pad, self.pad_id, dtype=np.int64)]),
                "labels": np.concatenate([c_lab, r_lab, np.full(pad, IGNORE_INDEX, dtype=np.int64)]),
                "token_mask": (np.arange(self.seq_len) < used).astype(np.int64),
                "dpo_seq": np.concatenate([np.full(len(c_in), CHOSEN), np.full(len(r_in), REJECTED),
                                           np.zeros(pad)]).astype(np.int64),
                "dpo_row": np.int64(self.row_offset + i),
                **documents_of(starts, self.seq_len)}


def build_preference_datasets(source, tokenizer, seq_len: int, *, eval_fraction: float = 0.0, seed: int = 0,
                              template: str = "auto") -> tuple[PreferenceDataset, PreferenceDataset | None]:
    """(train, held-out or None) from a JSONL path (or a list of records): a seeded `eval_fraction` of the pairs
    held out, as tpzoo.data.sft holds out records; the held-out rows numbered after the training rows."""
    tok = load_tokenizer(tokenizer)
    records = source if isinstance(source, list) else load_pair_records(source)
    train, held = split_records(records, eval_fraction, seed)
    first = PreferenceDataset([encode_pair(r, tok, template) for r in train], seq_len, tok.pad_id)
    second = (PreferenceDataset([encode_pair(r, tok, template) for r in held], seq_len, tok.pad_id,
                                row_offset=len(first)) if held else None)
    return first, second
