"""The gated delta rule (Gated DeltaNet's token mixing) in plain torch: the chunked form for training and prefill,
the recurrent form for decoding, both with an initial state in, the final state out, and document resets.

Per value head, with a state S [d_k, d_v] (decay g_t <= 0 in log space, write strength beta_t in (0, 1)):

    S_t = exp(g_t) S_{t-1} + k_t (beta_t (v_t - exp(g_t) S_{t-1}^T k_t))^T        o_t = S_t^T q_t

q and k are L2-normalized (qk_l2norm) and q is scaled by d_k^-1/2; key heads serve num_value_heads /
num_key_heads consecutive value heads (value head h reads key head h // ratio).

Chunked form (chunks of C = 64 tokens, the WY / UT representation of Yang et al., "Parallelizing linear transformers
with the delta rule"): within a chunk, with G the running sum of g from the chunk's start and D_ij = exp(G_i - G_j)
for j <= i (0 above the diagonal), the writes solve one unit lower-triangular system L = I + strict_tril(beta k k^T
* D): U = L^-1 (beta v) are the chunk's values as if the incoming state were zero, W = L^-1 (beta exp(G) k) how
they correct for it. Then one step per chunk: u = U - W S, o = (exp(G) q) S + (q k^T * D) u,
S <- exp(G_C) S + (exp(G_C - G) k)^T u. Everything but that scan is batched over chunks. fp32 throughout
(fp64 inputs stay fp64).

Per-channel decay (Kimi Delta Attention, KDA: g [b, s, value heads, d_k], each key channel of the state decaying at
its own rate, S_t = diag(exp(g_t)) S_{t-1} + ...): the same algorithm with exp(G) a vector per token, so exp(G)
scales k, q and the state's rows channel by channel, and the chunk's pairwise factor D becomes per channel:
L_ij = sum_c beta_i k_ic k_jc exp(G_ic - G_jc) (and q k^T alike). Writing that as (k exp(G)) (k exp(-G))^T would
overflow (G falls by up to |g| per token: exp(-G) reaches exp(1000) in one chunk); materializing exp(G_i - G_j)
for every pair and channel costs C^2 d_k per chunk. So the chunk is cut into sub-chunks of 16 tokens (fla's
choice too): a pair in different sub-chunks factors through the G of the later sub-chunk's first token r,
exp(G_i - G_r) exp(G_r - G_j), both exponents <= 0 (one matmul per sub-chunk); a pair within a sub-chunk takes
the explicit per-channel factor (16 x 16 x d_k per sub-chunk). Exact in exact arithmetic, no exponent positive.

Documents (packing): `starts` [b, s] marks tokens whose document differs from the previous token's (a row's first
token continues the initial state). The recurrent state must be *zero* before such a token. Two ways that look
simpler are not exact: a decay of exactly zero (g = -inf) at the boundary gives -inf - -inf = NaN in the chunk's
D and G differences; and masking D across boundaries leaves G running over the earlier documents of the chunk, so
G_i - G_j is a difference of two large cumulative sums (up to 64 x 16 per chunk), off by their rounding (1e-4
at |G| ~ 1000) where a document alone would subtract small ones. So the chunks are laid out per document: each
document starts a new chunk (tokens scattered into a [b, chunks, C] layout, the tail of a document's last chunk
zero-padded: k = v = 0, beta = g = 0 leave the state unchanged), and the scan sets the state to zero (torch.where,
not a multiplication) before a chunk that starts a document. Each document is then computed with exactly the
chunks, cumulative sums and padding it would have alone (tests/test_gated_delta.py: packed rows equal their
documents run one by one to 1e-6). The recurrent form zeroes the state at a start token. This is also what fla's
varlen kernels compute (cu_seqlens: chunks never cross a sequence boundary).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

CHUNK = 64
SUB = 16  # per-channel decays: the sub-chunk whose pairs take the explicit per-channel factor
L2_EPS = 1e-6  # as fla and transformers: x * rsqrt(sum(x^2) + eps)


def document_starts(doc_ids: torch.Tensor) -> torch.Tensor:
    """Bool [b, s]: True where a token's document id differs from the previous token's (never at position 0)."""
    starts = torch.zeros_like(doc_ids, dtype=torch.bool)
    starts[:, 1:] = doc_ids[:, 1:] != doc_ids[:, :-1]
    return starts


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """fp32, or fp64 for fp64 inputs (the float64 parity tests: no fp32 rounding left to hide a difference)."""
    return torch.promote_types(dtype, torch.float32)


def l2_normalize(x: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + L2_EPS)


def _heads_first(q, k, v, g, beta, scale, qk_l2norm):
    """fp32 (compute_dtype), [b, hv, s, d] (q, k repeated over their value heads), q scaled; g, beta [b, hv, s]."""
    ratio = v.shape[2] // k.shape[2]
    if v.shape[2] % k.shape[2]:
        raise ValueError(f"{v.shape[2]} value heads are not a multiple of {k.shape[2]} key heads")
    q, k, v, g, beta = (t.transpose(1, 2).to(compute_dtype(t.dtype)) for t in (q, k, v, g, beta))
    if qk_l2norm:
        q, k = l2_normalize(q), l2_normalize(k)
    q = q * (q.shape[-1] ** -0.5 if scale is None else scale)
    if ratio > 1:
        q, k = q.repeat_interleave(ratio, dim=1), k.repeat_interleave(ratio, dim=1)
    return q, k, v, g, beta


def _initial(state, b, h, dk, dv, like):
    if state is None:
        return like.new_zeros(b, h, dk, dv)
    return state.to(like.dtype)


def _chunk_slots(starts: torch.Tensor | None, s: int, size: int):
    """Where each token goes in the chunk layout: (slot [b, s] or None, chunks per row, reset [b, chunks] or None).
    Without documents the layout is the sequence padded to whole chunks; with them every document starts a chunk
    (reset[r, n]: chunk n of row r starts a document, the state is zero before it)."""
    if starts is None:
        return None, -(-s // size), None
    b = starts.shape[0]
    idx = torch.arange(s, device=starts.device).expand(b, s)
    first = starts.clone()
    first[:, 0] = True
    pos = idx - torch.where(first, idx, 0).cummax(dim=1).values  # position within the document
    chunk = (pos % size == 0).long().cumsum(dim=1) - 1
    n = int(chunk[:, -1].max()) + 1  # one host sync per call: the layout's size
    reset = torch.zeros(b, n, dtype=torch.bool, device=starts.device)
    rows = torch.arange(b, device=starts.device).unsqueeze(1).expand(b, s)
    reset[rows[starts], chunk[starts]] = True
    return chunk * size + pos % size, n, reset


def _to_chunks(x: torch.Tensor, slot, n: int, size: int) -> torch.Tensor:
    """[b, h, s, *d] -> [b, h, n, size, *d] (padding zero)."""
    b, h, s = x.shape[:3]
    if slot is None:
        pad = [0, 0] * (x.dim() - 3) + [0, n * size - s]
        return F.pad(x, pad).unflatten(2, (n, size))
    index = slot.view(b, 1, s, *[1] * (x.dim() - 3)).expand(x.shape)
    out = x.new_zeros(b, h, n * size, *x.shape[3:]).scatter(2, index, x)
    return out.unflatten(2, (n, size))


def _from_chunks(x: torch.Tensor, slot, s: int) -> torch.Tensor:
    """[b, h, n, size, d] -> [b, h, s, d]: the tokens back in sequence order."""
    x = x.flatten(2, 3)
    if slot is None:
        return x[:, :, :s]
    b, h = x.shape[:2]
    return x.gather(2, slot.view(b, 1, s, 1).expand(b, h, s, x.shape[-1]))


def _channel_products(q, k, k_beta, G, sub: int = SUB):
    """(L, q k^T) of chunks with per-channel decays (module docstring), q, k, k_beta, G [..., C, d_k]: L_ij =
    sum_c k_beta_ic k_jc exp(G_ic - G_jc) and the same with q_i, for j <= i, zero above the diagonal; [..., C, C]."""
    C = G.shape[-2]
    sub = sub if C % sub == 0 else C
    m = C // sub
    Gs, ks, kbs, qs = (t.unflatten(-2, (m, sub)) for t in (G, k, k_beta, q))  # [..., m, sub, d_k]
    # pairs within a sub-chunk: k_j exp(G_i - G_j) per channel, explicit ([..., m, i, j, d_k]; 0 for j > i)
    tril = torch.ones(sub, sub, dtype=torch.bool, device=G.device).tril().unsqueeze(-1)
    k_in = ks.unsqueeze(-3) * (Gs.unsqueeze(-2) - Gs.unsqueeze(-3)).masked_fill(~tril, float("-inf")).exp()
    inner = [(a.unsqueeze(-2) @ k_in.transpose(-1, -2)).squeeze(-2) for a in (kbs, qs)]  # [..., m, i, j]
    # pairs across sub-chunks, through r = the first token of row i's sub-chunk: exp(G_i - G_r) exp(G_r - G_j)
    R = Gs[..., :1, :]                                                          # [..., m, 1, d_k]
    earlier = (torch.arange(C, device=G.device) < sub * torch.arange(m, device=G.device).unsqueeze(-1))
    k_r = k.unsqueeze(-3) * (R - G.unsqueeze(-3)).masked_fill(~earlier.unsqueeze(-1), float("-inf")).exp()
    to_r = (Gs - R).exp()                                                      # [..., m, sub, d_k], <= 1
    block = torch.eye(m, dtype=G.dtype, device=G.device)[:, None, :, None]     # sub-chunk I's columns in row I
    return [((a * to_r) @ k_r.transpose(-1, -2) + (d.unsqueeze(-2) * block).flatten(-2)).flatten(-3, -2)
            for a, d in zip((kbs, qs), inner)]


def chunk_gated_delta_rule(q, k, v, g, beta, *, scale: float | None = None, initial_state=None,
                           output_final_state: bool = False, qk_l2norm: bool = False, starts=None,
                           chunk_size: int = CHUNK):
    """q, k [b, s, key heads, d_k]; v [b, s, value heads, d_v]; g [b, s, value heads] (per head: Gated DeltaNet)
    or [b, s, value heads, d_k] (per channel: KDA); beta [b, s, value heads]; initial_state
    [b, value heads, d_k, d_v] (continues each row's first document); starts [b, s] bool (document_starts).
    Returns (o [b, s, value heads, d_v] in v's dtype, final state fp32 (fp64 for fp64 inputs) or None)."""
    b, s = v.shape[:2]
    dtype = v.dtype
    q, k, v, g, beta = _heads_first(q, k, v, g, beta, scale, qk_l2norm)
    h, dk, dv = v.shape[1], k.shape[-1], v.shape[-1]
    slot, n, reset = _chunk_slots(starts, s, chunk_size)
    q, k, v, g, beta = (_to_chunks(t, slot, n, chunk_size) for t in (q, k, v, g, beta))  # [b, h, n, C, *]

    G = g.cumsum(3)  # along the chunk: [b, h, n, C] per head, [b, h, n, C, d_k] per channel
    Gk = G if g.dim() == 5 else G.unsqueeze(-1)  # the decay as it meets each key channel: [b, h, n, C, 1 | d_k]
    k_beta = k * beta.unsqueeze(-1)
    if g.dim() == 5:  # per channel (module docstring): L and q k^T through sub-chunks
        L, qk = _channel_products(q, k, k_beta, G)
    else:
        causal = torch.ones(chunk_size, chunk_size, dtype=torch.bool, device=v.device).tril()
        D = (G.unsqueeze(-1) - G.unsqueeze(-2)).masked_fill(~causal, float("-inf")).exp()  # exp(G_i - G_j), j <= i
        L = (k_beta @ k.transpose(-1, -2)) * D  # only its strict lower triangle is read (unitriangular solve)
        qk = (q @ k.transpose(-1, -2)) * D
        del D
    U = torch.linalg.solve_triangular(L, v * beta.unsqueeze(-1), upper=False, unitriangular=True)
    W = torch.linalg.solve_triangular(L, k_beta * Gk.exp(), upper=False, unitriangular=True)
    q_in = q * Gk.exp()                                 # q reading the state that entered the chunk
    k_out = k * (Gk[..., -1:, :] - Gk).exp()            # k decayed to the chunk's end
    decay = Gk[..., -1, :].exp().unsqueeze(-1)          # the whole chunk's decay: [b, h, n, 1 | d_k, 1]
    del L, k_beta, q, k, v, beta  # not needed by the scan (without autograd: freed before it)

    state = _initial(initial_state, b, h, dk, dv, U)
    outs = []
    for i in range(n):
        if reset is not None:
            state = torch.where(reset[:, i].view(b, 1, 1, 1), 0.0, state)
        u = U[:, :, i] - W[:, :, i] @ state
        outs.append(q_in[:, :, i] @ state + qk[:, :, i] @ u)
        state = state * decay[:, :, i] + k_out[:, :, i].transpose(-1, -2) @ u
    o = _from_chunks(torch.stack(outs, dim=2), slot, s)
    return o.transpose(1, 2).to(dtype), state if output_final_state else None


def recurrent_gated_delta_rule(q, k, v, g, beta, *, scale: float | None = None, initial_state=None,
                               output_final_state: bool = False, qk_l2norm: bool = False, starts=None):
    """The same function token by token (decoding: one token per call with the cache's state)."""
    b, s = v.shape[:2]
    dtype = v.dtype
    q, k, v, g, beta = _heads_first(q, k, v, g, beta, scale, qk_l2norm)
    state = _initial(initial_state, b, v.shape[1], k.shape[-1], v.shape[-1], v)
    outs = []
    for t in range(s):
        if starts is not None:
            state = torch.where(starts[:, t].view(b, 1, 1, 1), 0.0, state)
        decay = g[:, :, t].exp()  # [b, h], or [b, h, d_k] per channel: scales the state's rows
        state = state * (decay[..., None] if decay.dim() == 3 else decay[..., None, None])
        k_t = k[:, :, t].unsqueeze(-1)                                   # [b, h, d_k, 1]
        delta = (v[:, :, t] - (k_t.transpose(-1, -2) @ state).squeeze(-2)) * beta[:, :, t].unsqueeze(-1)
        state = state + k_t @ delta.unsqueeze(-2)
        outs.append((q[:, :, t].unsqueeze(-2) @ state).squeeze(-2))
    o = torch.stack(outs, dim=2).transpose(1, 2)
    return o.to(dtype), state if output_final_state else None

