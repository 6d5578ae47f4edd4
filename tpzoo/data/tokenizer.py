"""Tokenizers behind one small interface: the built-in byte tokenizer and Hugging Face tokenizers.

`load_tokenizer(spec)` takes
  - ``"byte"``: the built-in byte-level tokenizer (ids 0..255 are the UTF-8 bytes, then eos/bos/pad; vocab 259),
  - a directory holding a Hugging Face tokenizer (``tokenizer.json`` / ``tokenizer_config.json`` ...), loaded
    offline with ``AutoTokenizer.from_pretrained(dir, local_files_only=True)``,
  - a directory holding the byte tokenizer's marker file (written by ``ByteTokenizer.save``),
  - a tpzoo checkpoint or token-store directory with one of the above at its top level or in ``tokenizer/``,
  - a Hugging Face hub name, only when it is already in the local cache (nothing is downloaded).

Every tokenizer offers: ``encode(text) -> list[int]`` (no special tokens added), ``encode_batch(texts)``,
``decode(ids) -> str``, ``vocab_size``, ``eos_id``, ``bos_id`` (may be None), ``pad_id``, ``spec`` (how to load
it again), ``chat_template`` / ``apply_chat_template(messages, add_generation_prompt=False) -> str | None`` (None
when the tokenizer has no template) and ``save(dir)``.

transformers is imported only when a Hugging Face tokenizer is used, so byte-level work starts fast.
"""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Iterable, Sequence

from tpzoo.errors import ConfigError, DataError

BYTE_MARKER = "tpzoo_tokenizer.json"
HF_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")

__all__ = ["ByteTokenizer", "HFTokenizer", "has_tokenizer", "load_tokenizer", "peek_vocab_size", "train_bpe",
           "BYTE_MARKER"]


class ByteTokenizer:
    """UTF-8 bytes as tokens: ids 0..255 are bytes, 256 = eos, 257 = bos, 258 = pad (vocab_size 259).

    ``decode`` drops special ids and decodes the bytes as UTF-8, so ``decode(encode(s)) == s`` for every string
    (an arbitrary id sequence that is not valid UTF-8 decodes with U+FFFD replacement characters).
    """

    spec = "byte"
    eos_id = 256
    bos_id = 257
    pad_id = 258
    vocab_size = 259
    chat_template = None

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        return [self.encode(t) for t in texts]

    def decode(self, ids: Iterable[int]) -> str:
        return bytes(int(i) for i in ids if 0 <= int(i) < 256).decode("utf-8", errors="replace")

    def apply_chat_template(self, messages, add_generation_prompt: bool = False) -> str | None:
        return None

    def save(self, directory: str | os.PathLike) -> None:
        """Write a small JSON marker so ``load_tokenizer(directory)`` gives this tokenizer back."""
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        marker = {"type": "byte", "vocab_size": self.vocab_size, "eos_id": self.eos_id, "bos_id": self.bos_id,
                  "pad_id": self.pad_id}
        (directory / BYTE_MARKER).write_text(json.dumps(marker, indent=2) + "\n")

    def __repr__(self) -> str:
        return "ByteTokenizer(vocab_size=259)"


class HFTokenizer:
    """A Hugging Face tokenizer (any ``PreTrainedTokenizerBase``) behind the tpzoo interface.

    ``eos_id`` falls back to the sep token when there is no eos token (it may still be None for tokenizers that
    have neither); ``pad_id`` falls back to ``eos_id``; ``vocab_size`` is ``len(tokenizer)``, which counts added
    tokens (Hugging Face's own ``vocab_size`` does not).
    """

    def __init__(self, hf_tokenizer, spec: str | None = None):
        self.hf = hf_tokenizer
        self.spec = spec if spec is not None else str(getattr(hf_tokenizer, "name_or_path", ""))

    @property
    def vocab_size(self) -> int:
        return len(self.hf)

    @property
    def eos_id(self) -> int | None:
        eos = self.hf.eos_token_id
        return eos if eos is not None else self.hf.sep_token_id

    @property
    def bos_id(self) -> int | None:
        return self.hf.bos_token_id

    @property
    def pad_id(self) -> int | None:
        pad = self.hf.pad_token_id
        return pad if pad is not None else self.eos_id

    @property
    def chat_template(self) -> str | None:
        return getattr(self.hf, "chat_template", None) or None

    def encode(self, text: str) -> list[int]:
        return list(self.hf.encode(text, add_special_tokens=False, verbose=False))

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        if not texts:
            return []
        # The fast (Rust) tokenizers encode a batch on several threads.
        return [list(ids) for ids in self.hf(list(texts), add_special_tokens=False, verbose=False)["input_ids"]]

    def decode(self, ids: Iterable[int]) -> str:
        return self.hf.decode([int(i) for i in ids])

    def apply_chat_template(self, messages, add_generation_prompt: bool = False) -> str | None:
        if self.chat_template is None:
            return None
        return self.hf.apply_chat_template(list(messages), tokenize=False,
                                           add_generation_prompt=add_generation_prompt)

    def save(self, directory: str | os.PathLike) -> None:
        self.hf.save_pretrained(str(directory))

    def __repr__(self) -> str:
        return f"HFTokenizer({self.spec!r}, vocab_size={self.vocab_size})"


def _tokenizer_dir(path: Path) -> tuple[str, Path] | None:
    """('byte'|'hf', dir) for a directory holding tokenizer files at its top level or in tokenizer/."""
    for d in (path, path / "tokenizer"):
        if (d / BYTE_MARKER).is_file():
            return "byte", d
        if any((d / f).is_file() for f in HF_TOKENIZER_FILES):
            return "hf", d
    return None


def has_tokenizer(path) -> bool:
    """Whether a directory holds tokenizer files (at its top level or in tokenizer/), without loading them."""
    path = Path(path)
    return path.is_dir() and _tokenizer_dir(path) is not None


def _read_byte_marker(path: Path) -> dict:
    try:
        marker = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise DataError(f"{path}: corrupt tokenizer marker (not JSON: {e})") from None
    kind = marker.get("type") if isinstance(marker, dict) else None
    if kind != "byte":
        raise DataError(f"{path}: unknown tokenizer type {kind!r}")
    return marker


def peek_vocab_size(spec) -> int | None:
    """The vocabulary size of a tokenizer spec, found without loading it (no transformers import), or None when
    that is not cheap: 259 for the byte tokenizer; for a Hugging Face tokenizer.json, the number of distinct ids
    of its vocabulary and added tokens (at most ``len(tokenizer)``, so a check against it never refuses a
    tokenizer that would fit). Used to check a run before its ranks start."""
    if hasattr(spec, "vocab_size"):
        return int(spec.vocab_size)
    if str(spec) == "byte":
        return ByteTokenizer.vocab_size
    path = Path(str(spec)).expanduser()
    found = _tokenizer_dir(path) if path.is_dir() else None
    if found is None:
        return None
    kind, directory = found
    if kind == "byte":
        _read_byte_marker(directory / BYTE_MARKER)
        return ByteTokenizer.vocab_size
    file = directory / "tokenizer.json"
    if not file.is_file():
        return None
    try:
        data = json.loads(file.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise DataError(f"{file}: corrupt tokenizer file (not JSON: {e})") from None
    vocab = (data.get("model") or {}).get("vocab") if isinstance(data, dict) else None
    if isinstance(vocab, dict):
        ids = {i for i in vocab.values() if isinstance(i, int)}
    elif isinstance(vocab, list):  # Unigram: [[piece, score], ...], the id is the position
        ids = set(range(len(vocab)))
    else:
        return None
    ids |= {t["id"] for t in data.get("added_tokens") or [] if isinstance(t, dict) and isinstance(t.get("id"), int)}
    return len(ids)


def load_tokenizer(spec) -> ByteTokenizer | HFTokenizer:
    """A tokenizer from ``"byte"``, a tokenizer/checkpoint/token-store directory, or a locally cached hub name.

    A tokenizer object (anything with ``encode`` and ``vocab_size``) is returned unchanged.
    """
    if hasattr(spec, "encode") and hasattr(spec, "vocab_size"):
        return spec
    spec = str(spec)
    if spec == "byte":
        return ByteTokenizer()
    path = Path(spec).expanduser()
    if path.is_dir():
        found = _tokenizer_dir(path)
        if found is None:
            raise FileNotFoundError(
                f"no tokenizer in directory {path}: expected {BYTE_MARKER} (byte tokenizer) or one of "
                f"{', '.join(HF_TOKENIZER_FILES)} (Hugging Face), at its top level or in {path / 'tokenizer'}")
        kind, directory = found
        if kind == "byte":
            _read_byte_marker(directory / BYTE_MARKER)
            return ByteTokenizer()
        from transformers import AutoTokenizer

        hf = AutoTokenizer.from_pretrained(str(directory), local_files_only=True)
        return HFTokenizer(hf, spec=str(directory.resolve()))
    if path.exists():
        raise ConfigError(f"tokenizer spec {spec!r} is a file; give 'byte' or the directory that holds it")
    from transformers import AutoTokenizer

    try:  # a hub name that is already in the local Hugging Face cache; never downloads
        hf = AutoTokenizer.from_pretrained(spec, local_files_only=True)
    except Exception as e:  # noqa: BLE001 - transformers raises several types here
        raise FileNotFoundError(
            f"tokenizer {spec!r} is not 'byte', not a directory, and not in the local Hugging Face cache "
            f"(tpzoo never downloads at run time; save the tokenizer to a directory first): {e}") from e
    return HFTokenizer(hf, spec=spec)


def train_bpe(texts: Iterable[str], vocab_size: int, out_dir: str | os.PathLike, *,
              eos_token: str = "<|endoftext|>", pad_token: str = "<|pad|>", bos_token: str | None = None,
              chat_template: str | None = None, min_frequency: int = 2) -> HFTokenizer:
    """Train a byte-level BPE on ``texts`` and save it to ``out_dir`` as a Hugging Face tokenizer directory.

    Byte-level pre-tokenization with the full 256-byte initial alphabet means every string encodes (no unknown
    token) and decodes back exactly. The special tokens get the first ids (eos 0, pad 1, then bos if given).
    ``vocab_size`` is an upper bound: a small corpus may yield fewer merges. Returns the loaded tokenizer.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    specials = [eos_token, pad_token] + ([bos_token] if bos_token else [])
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, min_frequency=min_frequency, special_tokens=specials,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(texts, trainer)
    hf = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=eos_token, pad_token=pad_token,
                                 bos_token=bos_token)
    if chat_template is not None:
        hf.chat_template = chat_template
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    hf.save_pretrained(str(out_dir))
    return load_tokenizer(out_dir)
