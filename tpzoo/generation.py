"""Autoregressive generation with a KV cache, under tensor parallelism.

The vocabulary shards of the logits are gathered (`Transformer.full_logits`), so every TP rank holds the same
full logits; the token chosen on TP rank 0 is then broadcast to the others, so the ranks stay in lockstep even
if sampling were to differ between them (it does not: same seed, same logits).
"""
from __future__ import annotations

import torch

from tpzoo.parallel import comm
from tpzoo.parallel import state as ps


def _eos_set(eos_token_id) -> set[int]:
    if eos_token_id is None:
        return set()
    return {int(e) for e in (eos_token_id if isinstance(eos_token_id, (list, tuple, set)) else [eos_token_id])}


def sample_next(logits: torch.Tensor, *, greedy: bool = True, temperature: float = 1.0, top_p: float = 1.0,
                top_k: int = 0, generator: torch.Generator | None = None) -> torch.Tensor:
    """Next token ids [b] from the last position's full logits [b, vocab]."""
    if greedy or temperature == 0:
        return logits.argmax(dim=-1)
    logits = logits.float() / temperature
    if top_k and top_k < logits.shape[-1]:
        kth = logits.topk(top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        probs = sorted_logits.softmax(dim=-1)
        # Drop a token when the tokens before it already reach top_p (the most likely one always stays).
        drop = probs.cumsum(dim=-1) - probs >= top_p
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
        logits = torch.full_like(logits, float("-inf")).scatter(-1, order, sorted_logits)
    probs = logits.softmax(dim=-1)
    return torch.multinomial(probs.cpu(), 1, generator=generator).squeeze(-1).to(logits.device)


def _same_on_tp_ranks(tokens: torch.Tensor) -> torch.Tensor:
    if ps.get_tp_size() == 1 or not ps.is_initialized():
        return tokens
    return comm.broadcast(tokens, src=ps.get_group_ranks("tp")[0], group=ps.get_tp_group())


@torch.no_grad()
def generate(model, input_ids: torch.Tensor, max_new_tokens: int, *, greedy: bool = True, temperature: float = 1.0,
             top_p: float = 1.0, top_k: int = 0, seed: int | None = None, eos_token_id=None,
             pad_token_id: int | None = None) -> torch.Tensor:
    """input_ids [b, s] -> [b, s + n] (n <= max_new_tokens: stops once every row has produced an eos; finished
    rows are padded with pad_token_id, as transformers does). The model must hold every layer (pp = 1)."""
    from tpzoo.models.transformer import new_kv_caches

    if not (model.pre_process and model.post_process):
        raise ValueError("generate needs the whole model on one pipeline stage (pp=1); load it with pp=1")
    if model.sequence_parallel:
        raise ValueError("generate does not support sequence parallelism (decoding steps have length 1)")
    device = next(model.parameters()).device
    ids = input_ids.to(device)
    eos = _eos_set(eos_token_id)
    pad = pad_token_id if pad_token_id is not None else (min(eos) if eos else 0)
    generator = torch.Generator().manual_seed(seed) if seed is not None else None
    caches = new_kv_caches(model)
    finished = torch.zeros(ids.shape[0], dtype=torch.bool, device=device)
    out = [ids]
    step_input = ids
    for _ in range(max_new_tokens):
        logits = model.full_logits(model(step_input, kv_caches=caches)[:, -1:])[:, -1]
        nxt = _same_on_tp_ranks(sample_next(logits, greedy=greedy, temperature=temperature, top_p=top_p,
                                            top_k=top_k, generator=generator).contiguous())
        if eos:
            nxt = torch.where(finished, torch.full_like(nxt, pad), nxt)
            finished |= torch.isin(nxt, torch.tensor(sorted(eos), device=device))
        out.append(nxt[:, None])
        step_input = nxt[:, None]
        if eos and bool(finished.all()):
            break
    return torch.cat(out, dim=1)
