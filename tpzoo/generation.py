"""Autoregressive generation under tensor and pipeline parallelism, through the pipeline executor.

Every new token is one forward-only pass of the executor over this rank's chunks (tpzoo.pipeline.execute):
  - with a cache per chunk (the default; Transformer.new_cache: each layer's own, a KV cache for attention):
    the prompt once, then one token per step;
  - without one (`use_cache=False`, and always under sequence parallelism, which cannot split a single-token
    step over TP ranks): the whole context every step, padded on the right to a multiple of tp (causal
    attention: the padding cannot change the logits of the real positions), in a window of `max_context`.
The last stage gathers the vocabulary shards of the logits (`Transformer.full_logits`), so every TP rank holds
the same full logits; the token chosen on TP rank 0 is broadcast to the TP group (lockstep even if sampling were
to differ), then from the last pipeline stage to the whole pipeline, which feeds it to the first stage.
"""
from __future__ import annotations

import torch

from tpzoo.errors import ConfigError
from tpzoo.parallel import comm, strict
from tpzoo.parallel.dims import ParallelDims
from tpzoo.pipeline import StepFunctions, as_chunks, execute


def _eos_set(eos_token_id) -> set[int]:
    if eos_token_id is None:
        return set()
    return {int(e) for e in (eos_token_id if isinstance(eos_token_id, (list, tuple, set)) else [eos_token_id])}


def sample_next(logits: torch.Tensor, *, greedy: bool = True, temperature: float = 1.0, top_p: float = 1.0,
                top_k: int = 0, generator: torch.Generator | None = None) -> torch.Tensor:
    """Next token ids [b] from the last position's full logits [b, vocab]."""
    if greedy or temperature == 0:
        return logits.argmax(dim=-1)
    probs = sampling_probs(logits, temperature, top_p, top_k)
    # Sampled on the host with a CPU generator: the same draws whatever device the logits are on.
    return torch.multinomial(probs.cpu(), 1, generator=generator).squeeze(-1).to(logits.device)


def sampling_probs(logits: torch.Tensor, temperature: float = 1.0, top_p: float = 1.0, top_k: int = 0) -> torch.Tensor:
    """The distribution sampling draws from, over full logits [..., vocab]: temperature, then top-k, then top-p
    (also a speculative draft's and its verifier's: tpzoo/speculative.py)."""
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
    return logits.softmax(dim=-1)


class _Decoder:
    """One forward-only executor pass per token; the next token on every rank of the pipeline. max_length: of
    the caches (None: no cache)."""

    def __init__(self, chunks, dims: ParallelDims, batch: int, max_length: int | None, pick):
        self.chunks, self.dims, self.pick = chunks, dims, pick
        self.caches = [c.new_cache(batch, max_length) for c in chunks] if max_length is not None else None
        self.device = chunks[0].device

    def next_tokens(self, ids: torch.Tensor, position: int) -> torch.Tensor:
        """Run `ids` [b, s] through the pipeline; the token picked from the logits at `position`, [b]."""
        from tpzoo.models import Inputs, LossOptions

        picked, loss = {}, LossOptions(logits_position=position)

        def forward(index, chunk, batch, hidden):
            inputs = Inputs(ids=batch["input_ids"] if chunk.pre_process else None, hidden=hidden)
            return chunk(inputs, self.caches[index] if self.caches else None, loss)

        def last(mb, logits_shard, batch):  # [b, 1, V'/tp]: the head ran on that position only
            picked["token"] = self.pick(self.chunks[-1].full_logits(logits_shard[:, 0])).contiguous()

        execute(self.chunks, [{"input_ids": ids}], self.dims, StepFunctions(forward, last), forward_only=True)
        dims = self.dims
        token = picked.get("token")
        if token is None:  # not the last stage: the token comes from there
            token = torch.zeros(ids.shape[0], dtype=torch.long, device=self.device)
        elif dims.tp > 1:  # the same token on every TP rank of the last stage
            comm.broadcast(token, src=dims.ranks("tp")[0], group=dims.tp_group)
        if dims.pp > 1:
            comm.broadcast(token, src=dims.pp_peer(dims.pp - 1), group=dims.pp_group)
        return token


@torch.no_grad()
def generate(model_or_chunks, input_ids: torch.Tensor, max_new_tokens: int, *, dims: ParallelDims | None = None,
             greedy: bool = True, temperature: float = 1.0, top_p: float = 1.0, top_k: int = 0,
             seed: int | None = None, eos_token_id=None, pad_token_id: int | None = None,
             use_cache: bool | None = None, max_context: int | None = None) -> torch.Tensor:
    """input_ids [b, s] -> [b, s + n] on the model's device (n <= max_new_tokens: stops once every row has
    produced an eos; finished rows are padded with pad_token_id, as transformers does). Collective over the
    model-parallel ranks (every one returns the same ids). `model_or_chunks`: this rank's Transformer or its
    pipeline chunks. use_cache: default True unless the model uses sequence parallelism. max_context: with a
    cache, generation stops there; without one, the context window slides (default: max positions)."""
    chunks = as_chunks(model_or_chunks)
    dims = dims or chunks[0].dims
    cfg = chunks[0].cfg
    sp = any(c.sequence_parallel for c in chunks)
    use_cache = not sp if use_cache is None else use_cache
    if use_cache and sp:
        raise ConfigError("generate: a cache cannot run under sequence parallelism (a one-token step cannot be "
                         "split over TP ranks); use use_cache=False or load the model without it")
    max_context = min(max_context or cfg.max_position_embeddings, cfg.max_position_embeddings)
    device = chunks[0].device
    eos = _eos_set(eos_token_id)
    pad = pad_token_id if pad_token_id is not None else (min(eos) if eos else 0)
    generator = torch.Generator(device="cpu").manual_seed(seed) if seed is not None else None
    if use_cache:
        max_new_tokens = max(0, min(max_new_tokens, max_context - input_ids.shape[1]))
    decoder = _Decoder(chunks, dims, input_ids.shape[0], input_ids.shape[1] + max_new_tokens if use_cache else None,
                       lambda logits: sample_next(logits, greedy=greedy, temperature=temperature, top_p=top_p,
                                                  top_k=top_k, generator=generator))
    was_training = [c.training for c in chunks]
    for c in chunks:
        c.eval()
    ids = input_ids.to(device)
    finished = torch.zeros(ids.shape[0], dtype=torch.bool, device=device)
    eos_ids = torch.tensor(sorted(eos), dtype=torch.long, device=device)
    out = [ids]
    try:
        for step in range(max_new_tokens):
            if use_cache:
                nxt = decoder.next_tokens(ids if step == 0 else out[-1], -1)
            else:
                context, last = _window(torch.cat(out, dim=1), max_context, dims.tp if sp else 1, pad)
                nxt = decoder.next_tokens(context, last)
            if eos:
                nxt = torch.where(finished, torch.full_like(nxt, pad), nxt)
                finished |= torch.isin(nxt, eos_ids)
            out.append(nxt[:, None])
            if eos and bool(finished.all()):
                break
    finally:
        for c, was in zip(chunks, was_training):
            c.train(was)
    strict.check_all_waited("the end of generate")  # strict collective mode; else a no-op
    return torch.cat(out, dim=1)


def _window(ids: torch.Tensor, max_context: int, multiple: int, pad: int) -> tuple[torch.Tensor, int]:
    """The last tokens that fit the window (max_context rounded down to a multiple of `multiple`), right-padded
    to a multiple of `multiple`, and the index of the last real position."""
    ids = ids[:, -(max_context // multiple * multiple):]
    n = ids.shape[1]
    padded = -(-n // multiple) * multiple
    if padded > n:
        ids = torch.cat([ids, ids.new_full((ids.shape[0], padded - n), pad)], dim=1)
    return ids, n - 1
