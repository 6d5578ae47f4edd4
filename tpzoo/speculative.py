"""Self-speculative decoding with the model's multi-token-prediction depths as the draft (tpzoo.models.mtp).

Each step drafts D tokens (one per depth, the report's chain: depth k at the last position embeds the token depth
k-1 drafted and reads its output) and verifies them with one forward of the main model over [last token, drafts]:
  - greedy: the drafts are kept while they equal the model's own argmax, then the model's next token is added,
    so the output is plain greedy decoding's, token for token;
  - sampling: standard speculative sampling (Leviathan et al. 2023, Chen et al. 2023): draft k is kept with
    probability min(1, p(d)/q(d)) (p the model's distribution, q the depth's, both after temperature / top-k /
    top-p), a rejected one replaced by a draw from max(0, p - q) renormalized, and when all are kept one more token
    is drawn from p: every token is distributed exactly as plain sampling's.
The main model keeps its caches (a cache with a `length`, KV or latent, is cut back to the accepted tokens; any
other, a Gated DeltaNet's recurrent state, is saved before the verification and, when drafts are rejected,
restored and fed the accepted tokens again). Each depth keeps a cache of its own positions; a depth's position is
kept once its input token is committed, the ones read from drafts are computed again the next step.

Any tp and pp: the main forwards run through the pipeline executor; the depths run on the last stage beside the
head (their collectives over its tp group); the decisions are made on its first tp rank and broadcast to every
rank. One sequence at a time (batch 1), with a cache (not under sequence parallelism), at cp 1.
"""
from __future__ import annotations

import torch

from tpzoo.errors import ConfigError
from tpzoo.parallel import comm, strict
from tpzoo.parallel.dims import ParallelDims
from tpzoo.pipeline import StepFunctions, as_chunks, execute

from .generation import _eos_set, sampling_probs as _processed


def accept_drafts(drafts: torch.Tensor, q: torch.Tensor, p: torch.Tensor, generator) -> tuple[int, int]:
    """Speculative sampling for one sequence: drafts [D] drawn from q [D, V]; p [D + 1, V] the model's
    distributions at the D + 1 verified positions. Returns (drafts kept, the next token): the tokens emitted are
    distributed as D + 1 draws from p. Host tensors (the draws come from the CPU `generator`)."""
    for j in range(drafts.numel()):
        d = int(drafts[j])
        u = torch.rand((), generator=generator)
        if u * q[j, d] < p[j, d]:  # accept with probability min(1, p/q)
            continue
        residual = (p[j] - q[j]).clamp(min=0)
        total = residual.sum()
        residual = residual / total if total > 0 else p[j]
        return j, int(torch.multinomial(residual, 1, generator=generator))
    return drafts.numel(), int(torch.multinomial(p[-1], 1, generator=generator))


def _rewind(cache, length: int) -> None:
    """Cut a chunk's (or a depth's) cache back to `length` tokens (the positional ones: KV, latent)."""
    cache.length = length
    for c in cache.layers.values():
        if c is not None and hasattr(c, "length"):
            c.length = length


def _state(cache) -> dict | None:
    """What a verification changes in the caches without a length (recurrent state), to restore; None: none."""
    saved = {i: {k: v.clone() if torch.is_tensor(v) else v for k, v in vars(c).items()}
             for i, c in cache.layers.items() if c is not None and not hasattr(c, "length")}
    return saved or None


class _Main:
    """The main model's forwards through the executor, with a cache per chunk: (full logits [s, V], the final
    norm's output [1, s, h]) of the fed tokens on the last stage, None elsewhere."""

    def __init__(self, chunks, dims: ParallelDims, max_length: int):
        self.chunks, self.dims = chunks, dims
        self.caches = [c.new_cache(1, max_length) for c in chunks]

    def __call__(self, ids: torch.Tensor):
        from tpzoo.models import Inputs, LossOptions

        out, loss = {}, LossOptions(hidden=True)

        def forward(index, chunk, batch, hidden):
            inputs = Inputs(ids=batch["input_ids"] if chunk.pre_process else None, hidden=hidden)
            return chunk(inputs, self.caches[index], loss)

        def last(mb, result, batch):
            logits, h = result
            out["logits"], out["hidden"] = self.chunks[-1].full_logits(logits)[0], h

        execute(self.chunks, [{"input_ids": ids}], self.dims, StepFunctions(forward, last), forward_only=True)
        return (out["logits"], out["hidden"]) if out else None

    @property
    def length(self) -> int:
        return self.caches[0].length


class _Drafter:
    """The depths' caches and what each next depth reads (see the module docstring); on the last stage."""

    def __init__(self, model, max_length: int):
        self.model, self.depths = model, model.cfg.mtp_depths
        self.caches = model.mtp.new_caches(1, max_length)
        self.outputs = [(0, None)] * (self.depths + 1)  # depth k's outputs: (first position, [1, n, h])

    def _take(self, k: int, start: int, new: tuple) -> None:
        """Depth k's outputs (k = 0: the main model's) from position `start` on: the kept ones before `new`'s."""
        first, old = self.outputs[k]
        new_first, out = new
        if old is not None and start < new_first:
            out = torch.cat([old[:, start - first:new_first - first], out], dim=1)
        self.outputs[k] = (start, out)

    def draft(self, seq: list[int], main_hidden: torch.Tensor, main_first: int, pick) -> tuple[list, list]:
        """The depths' drafts of the tokens after `seq` (every committed token, the last one not yet in the main
        model) and their full logits, given the main model's new outputs (positions main_first .. len(seq) - 2)."""
        n = len(seq) - 1  # position of the newest committed token
        device = main_hidden.device
        self._take(0, self.caches[0].length, (main_first, main_hidden))
        drafts, logits = [], []
        for k in range(1, self.depths + 1):
            cache = self.caches[k - 1]
            start = cache.length
            first, hidden = self.outputs[k - 1]
            h_in = hidden[:, start - first:]
            ids = [seq[i + k] if i + k <= n else drafts[i + k - n - 1] for i in range(start, n)]
            out, last = self.model.mtp.draft(self.model, k - 1, h_in,
                                             torch.tensor([ids], dtype=torch.long, device=device), cache)
            drafts.append(pick(last[0]))
            logits.append(last[0])
            if k < self.depths:  # what depth k + 1 reads: from its own first position not yet kept
                self._take(k, self.caches[k].length, (start, out))
            _rewind(cache, n - k + 1)  # positions whose token is committed
        return drafts, logits


@torch.no_grad()
def generate_with_mtp(model_or_chunks, input_ids: torch.Tensor, max_new_tokens: int, *,
                      dims: ParallelDims | None = None, greedy: bool = True, temperature: float = 1.0,
                      top_p: float = 1.0, top_k: int = 0, seed: int | None = None, eos_token_id=None,
                      max_context: int | None = None) -> tuple[torch.Tensor, dict]:
    """input_ids [1, s] -> ([1, s + n], {"steps", "drafted", "accepted"}): the continuation plain decoding gives
    (greedy: the same tokens; sampling: the same distribution), drafted by the multi-token-prediction depths
    (steps: the main model's verifying forwards). Collective over the model-parallel ranks (each returns the same)."""
    chunks = as_chunks(model_or_chunks)
    dims = dims or chunks[0].dims
    cfg = chunks[0].cfg
    if cfg.mtp is None:
        raise ConfigError("--draft mtp: the model has no multi-token-prediction layers (docs/models.md)")
    if input_ids.shape[0] != 1:
        raise ConfigError(f"--draft mtp decodes one sequence at a time, got a batch of {input_ids.shape[0]}")
    if any(c.sequence_parallel for c in chunks) or dims.cp > 1:
        raise ConfigError("--draft mtp decodes with caches: no sequence parallelism, and cp 1")
    depths = cfg.mtp_depths
    max_context = min(max_context or cfg.max_position_embeddings, cfg.max_position_embeddings)
    max_new_tokens = max(0, min(max_new_tokens, max_context - input_ids.shape[1] - depths))
    max_length = input_ids.shape[1] + max_new_tokens + depths + 1
    generator = torch.Generator(device="cpu").manual_seed(seed if seed is not None else 0)
    sample = not greedy and temperature > 0
    device = chunks[0].device
    head = chunks[-1] if chunks[-1].post_process else None
    main = _Main(chunks, dims, max_length)
    drafter = _Drafter(head, max_length) if head is not None else None
    was_training = [c.training for c in chunks]
    for c in chunks:
        c.eval()

    def pick(logits):  # a draft from a depth's full logits [V]
        if not sample:
            return int(logits.argmax())
        return int(torch.multinomial(_processed(logits, temperature, top_p, top_k).cpu(), 1, generator=generator))

    def decide(logits, drafts, draft_logits) -> tuple[int, int]:  # (drafts kept, the next token)
        if not drafts:
            return 0, pick(logits[-1])
        if sample:
            p = _processed(logits, temperature, top_p, top_k).cpu()
            q = torch.stack([_processed(d, temperature, top_p, top_k) for d in draft_logits]).cpu()
            return accept_drafts(torch.tensor(drafts), q, p, generator)
        wanted = logits.argmax(-1).tolist()
        kept = next((j for j in range(len(drafts)) if drafts[j] != wanted[j]), len(drafts))
        return kept, wanted[kept]

    def shared(values: list[int]) -> list[int]:  # the last stage's first tp rank's values, on every rank
        msg = torch.tensor(values, dtype=torch.long, device=device)
        if dims.tp > 1 and head is not None:
            comm.broadcast(msg, src=dims.ranks("tp")[0], group=dims.tp_group)
        if dims.pp > 1:
            comm.broadcast(msg, src=dims.pp_peer(dims.pp - 1), group=dims.pp_group)
        return msg.tolist()

    eos = _eos_set(eos_token_id)
    seq, new = input_ids[0].tolist(), []
    stats = {"steps": 0, "drafted": 0, "accepted": 0}
    drafts, draft_logits, saved, first = [], [], None, 0
    # whether any stage holds a cache that cannot be cut back (a recurrent state): then every rank replays a
    # rejection, also a stage holding only positional caches (the decision must be the same on every rank)
    recurrent = torch.tensor([float(any(_state(c) is not None for c in main.caches))], device=device)
    if dims.pp > 1:
        recurrent = comm.all_reduce(recurrent, dims.pp_group, op=torch.distributed.ReduceOp.MAX)
    recurrent = bool(recurrent.item())
    out = main(input_ids.to(device))
    try:
        while True:
            kept, nxt = shared(list(decide(out[0], drafts, draft_logits)) if head is not None else [0, 0])
            if drafts:  # the verified step: cut the caches back to the committed tokens
                stats["steps"] += 1
                stats["drafted"] += len(drafts)
                stats["accepted"] += kept
                replay = recurrent and kept < len(drafts)
                for cache, state in zip(main.caches, saved):
                    _rewind(cache, first if replay else first + kept + 1)
                    if replay and state is not None:
                        for i, attrs in state.items():
                            vars(cache[i]).update(attrs)
                if replay:  # (a recurrent state cannot be cut: restored, then fed the accepted tokens again)
                    out = main(torch.tensor([[seq[-1]] + drafts[:kept]], device=device))
            committed = drafts[:kept] + [nxt]
            if eos and any(t in eos for t in committed):
                committed = committed[:next(j for j, t in enumerate(committed) if t in eos) + 1]
            hidden_first = first
            seq, new = seq + committed, new + committed
            if len(new) >= max_new_tokens or (eos and committed[-1] in eos):
                break
            # the next drafts, then their verification
            if head is not None:
                hidden = out[1][:, :len(committed) if drafts else None]
                drafts, draft_logits = drafter.draft(seq, hidden, hidden_first, pick)
            drafts = shared(drafts if head is not None else [0] * depths)
            first = main.length
            saved = [_state(c) for c in main.caches] if recurrent else [None] * len(chunks)
            out = main(torch.tensor([[seq[-1]] + drafts], device=device))
    finally:
        for c, was in zip(chunks, was_training):
            c.train(was)
    strict.check_all_waited("the end of generate (--draft mtp)")  # strict collective mode; else a no-op
    return torch.tensor([seq[:input_ids.shape[1] + max_new_tokens]], dtype=torch.long, device=device), stats
