"""Shared by the checkpoint/convert/eval/generate tests: tiny HF models with a locally trained tokenizer."""
from __future__ import annotations

from pathlib import Path

import torch

from hf_models import VOCAB, save_hf_model

KINDS = ["gpt2", "llama", "llama31-tied", "mistral", "qwen2"]
TEXT = ("the quick brown fox jumps over the lazy dog. a tensor parallel model zoo for tiny tests. "
        "every rank holds a shard of the weights, and the shards add up to the model.\n") * 6


def train_tokenizer(out_dir) -> None:
    """A BPE tokenizer (vocabulary below the tiny models' 101) trained here, saved as HF tokenizer files."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Metaspace()
    trainer = trainers.BpeTrainer(vocab_size=96, special_tokens=["<unk>", "<s>", "</s>"], show_progress=False)
    tok.train_from_iterator([TEXT], trainer)
    hf = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>")
    hf.chat_template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    hf.save_pretrained(str(out_dir))
    assert len(hf) <= VOCAB


def write_hf(kind: str, path, *, tokenizer: bool = False, max_shard_size=None):
    """save_pretrained of the tiny `kind` model (plus the tokenizer files); returns the HF model."""
    Path(path).mkdir(parents=True, exist_ok=True)
    model = save_hf_model(kind, path, max_shard_size=max_shard_size)
    if tokenizer:
        train_tokenizer(path)
    return model


def ids(batch: int = 2, seq: int = 24, seed: int = 5) -> torch.Tensor:
    return torch.randint(0, VOCAB, (batch, seq), generator=torch.Generator().manual_seed(seed))


def safetensors_dir(path) -> dict[str, torch.Tensor]:
    """Every tensor of every *.safetensors file in a directory, by name."""
    from safetensors.torch import load_file

    out = {}
    for f in sorted(Path(path).glob("*.safetensors")):
        out.update(load_file(str(f)))
    return out


def assert_bit_exact(a: dict, b: dict) -> None:
    assert a.keys() == b.keys(), sorted(set(a) ^ set(b))
    for k in a:
        assert a[k].dtype == b[k].dtype and a[k].shape == b[k].shape, k
        assert torch.equal(a[k].view(-1).view(torch.uint8), b[k].view(-1).view(torch.uint8)), k
