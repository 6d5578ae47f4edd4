"""The sample a training run prints, from the trained model chunks at any (tp, pp, virtual stages, SP).

With the whole model on each TP group (pp = 1, one chunk, no sequence parallelism) it is
`tpzoo.generation.generate` (KV cache). Otherwise a KV-less loop runs the whole context through the pipeline for
every new token (fine for a short sample): activations go stage to stage with point-to-point sends, the last stage
gathers the vocab-parallel logits over TP (every TP rank then picks the same token: greedy, or sampled with one
seeded generator per rank) and broadcasts the token back along the pipeline.
"""
from __future__ import annotations

import torch

from tpzoo.parallel import comm
from tpzoo.parallel.state import get_group_ranks, get_pp_group, get_pp_rank, get_pp_size, get_tp_size


def _stage_forward(chunks, ids: torch.Tensor, hidden_shape: tuple, dtype) -> torch.Tensor | None:
    """Run every model stage this rank holds, in model order; the full logits on the last stage, else None."""
    p, rank = get_pp_size(), get_pp_rank()
    ranks = get_group_ranks("pp") if p > 1 else None
    n_stages = p * len(chunks)
    h = None
    for stage in range(n_stages):
        holder, chunk = stage % p, stage // p
        if holder != rank:
            continue
        model = chunks[chunk]
        if stage > 0 and p > 1:
            h = torch.empty(hidden_shape, dtype=dtype)
            comm.batch_send_recv([], [(h, ranks[(stage - 1) % p])], get_pp_group())
        out = model(input_ids=ids) if stage == 0 else model(hidden=h)
        if stage == n_stages - 1:
            return model.full_logits(out)
        if p > 1:
            comm.batch_send_recv([(out.contiguous(), ranks[(stage + 1) % p])], [], get_pp_group())
        h = out
    return None


@torch.no_grad()
def generate(chunks, tokenizer, prompt: str, max_new_tokens: int, *, temperature: float = 0.0, seed: int = 0,
             max_context: int | None = None, sequence_parallel: bool = False) -> str:
    """Continuation of `prompt` (collective over the model-parallel ranks; every rank returns the same text)."""
    cfg = chunks[0].cfg
    prompt_ids = tokenizer.encode(prompt) or [tokenizer.eos_id]
    if get_pp_size() == 1 and len(chunks) == 1 and not sequence_parallel:
        from tpzoo.generation import generate as kv_generate

        n = max(0, min(max_new_tokens, cfg.max_position_embeddings - len(prompt_ids)))
        out = kv_generate(chunks[0], torch.tensor([prompt_ids]), n, greedy=temperature <= 0,
                          temperature=temperature if temperature > 0 else 1.0, seed=seed,
                          eos_token_id=tokenizer.eos_id)[0, len(prompt_ids):].tolist()
        return tokenizer.decode(out[:out.index(tokenizer.eos_id)] if tokenizer.eos_id in out else out)
    was_training = [c.training for c in chunks]
    for c in chunks:
        c.eval()
    max_context = min(max_context or cfg.max_position_embeddings, cfg.max_position_embeddings)
    dtype = next(chunks[0].parameters()).dtype
    tp, p = get_tp_size(), get_pp_size()
    gen = torch.Generator().manual_seed(seed)
    ids = prompt_ids
    new: list[int] = []
    for _ in range(max_new_tokens):
        context = (ids + new)[-max_context:]
        n = len(context)
        # Sequence parallelism splits the sequence over TP: pad on the right (causal attention: the padding
        # cannot change the logits of the real positions) and read the last real position.
        padded = -(-n // tp) * tp if sequence_parallel else n
        if padded > max_context:
            context, n, padded = context[padded - max_context:], n - (padded - max_context), max_context
        x = torch.tensor([context + [tokenizer.eos_id] * (padded - n)], dtype=torch.long)
        seq_local = padded // tp if sequence_parallel else padded
        logits = _stage_forward(chunks, x, (1, seq_local, cfg.hidden_size), dtype)
        token = torch.zeros(1, dtype=torch.long)
        if logits is not None:
            last = logits[0, n - 1].float()
            if temperature > 0:
                token[0] = torch.multinomial(torch.softmax(last / temperature, -1), 1, generator=gen)[0]
            else:
                token[0] = int(last.argmax())
        if p > 1:
            comm.broadcast(token, src=get_group_ranks("pp")[-1], group=get_pp_group())
        t = int(token[0])
        if t == tokenizer.eos_id:
            break
        new.append(t)
    for c, was in zip(chunks, was_training):
        c.train(was)
    return tokenizer.decode(new)
