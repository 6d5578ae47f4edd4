"""The sample a training run prints: `tpzoo.generation.generate` on the trained chunks (any tp, pp, virtual
stages; under sequence parallelism without a KV cache), from a text prompt to text."""
from __future__ import annotations

import torch

from tpzoo.generation import generate as generate_ids
from tpzoo.parallel.dims import ParallelDims


@torch.no_grad()
def generate(chunks, dims: ParallelDims, tokenizer, prompt: str, max_new_tokens: int, *, temperature: float = 0.0,
             seed: int = 0, max_context: int | None = None) -> str:
    """Continuation of `prompt` (collective over the model-parallel ranks; every rank returns the same text)."""
    prompt_ids = tokenizer.encode(prompt) or [tokenizer.eos_id]
    out = generate_ids(chunks, torch.tensor([prompt_ids], device="cpu"), max_new_tokens, dims=dims,
                       greedy=temperature <= 0, temperature=temperature if temperature > 0 else 1.0, seed=seed,
                       eos_token_id=tokenizer.eos_id, max_context=max_context)
    new = out[0, len(prompt_ids):].tolist()
    return tokenizer.decode(new[:new.index(tokenizer.eos_id)] if tokenizer.eos_id in new else new)
