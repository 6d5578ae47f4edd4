"""Attention sinks (gpt-oss) against transformers' gpt-oss eager attention (its extra softmax column), fp32:
models/sinks.py's exact core (the CPU flash block kernel, and the torch math) with grouped-query heads, a sliding
window shorter than the sequence, decoding with past keys, and packed documents (models/kinds/document_attention.py's exact path;
FlexAttention's forward on CPU equals it): outputs and the gradients of q, k, v and the sinks. Ring attention at
cp 2 (plain, a binding window, documents) and Ulysses at cp 2 equal the one-process core on every rank's rows,
gradients included, the sinks' gradients summed over the cp ranks (each holds its rows' share). The comparison can
fail: ignoring the sinks moves the outputs far beyond the tolerance, locally and in the ring."""
import types

import pytest
import torch
import torch.nn.functional as F

import tpzoo
from tpzoo.models.documents import Documents
from tpzoo.models.kinds.document_attention import document_attention
from tpzoo.models.sinks import sink_attention
from tpzoo.parallel.context_parallel import padded_length
from tpzoo.parallel.ring_attention import local_positions, ring_attention
from tpzoo.parallel.ulysses import local_heads, ulysses_attention
from tpzoo.testing import run_on_ranks

B, H, HKV, D = 2, 4, 2, 8


def _data(s, seed, h=H, hkv=HKV):
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(B, n, s, D, generator=g, dtype=torch.float64) for n in (h, hkv, hkv))
    sinks = torch.randn(h, generator=g, dtype=torch.float64) * 2
    return q, k, v, sinks, torch.randn(B, h, s, D, generator=g, dtype=torch.float64)


def _visible(s, window=None, doc_ids=None, past=0, sk=None):
    sk = sk or s
    qpos, kpos = torch.arange(past, past + s)[:, None], torch.arange(sk)[None, :]
    mask = kpos <= qpos
    if window is not None:
        mask = mask & (qpos - kpos < window)
    if doc_ids is not None:
        mask = mask & (doc_ids[:, qpos] == doc_ids[:, kpos])
    return mask.expand(B, 1, s, sk) if mask.dim() == 2 else mask.unsqueeze(1)


def _hf_eager(q, k, v, sinks, mask):
    """transformers' gpt-oss eager attention (sinks as the last logit column) -> [b, h, s, d]."""
    from transformers.models.gpt_oss.modeling_gpt_oss import eager_attention_forward

    module = types.SimpleNamespace(num_key_value_groups=q.shape[1] // k.shape[1], sinks=sinks, training=False)
    additive = torch.zeros(mask.shape, dtype=q.dtype).masked_fill(~mask, torch.finfo(q.dtype).min)
    out, _ = eager_attention_forward(module, q, k, v, additive, scaling=q.shape[-1] ** -0.5)
    return out.transpose(1, 2)


def _grads(fn, q, k, v, sinks, grad):
    leaves = [t.clone().requires_grad_() for t in (q, k, v, sinks)]
    out = fn(*leaves)
    out.backward(grad)
    return [out.detach()] + [t.grad for t in leaves]


def _close(got, want, tol=1e-10):
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=tol, atol=tol)


@pytest.mark.parametrize("window,fused", [(None, None), (None, False), (4, None)])
def test_sink_attention_equals_gpt_oss_eager(window, fused):
    s = 10
    q, k, v, sinks, grad = _data(s, 0)
    mask = _visible(s, window)
    want = _grads(lambda *t: _hf_eager(*t, mask), q, k, v, sinks, grad)
    got = _grads(lambda *t: sink_attention(*t, window=window, fused=fused), q, k, v, sinks, grad)
    _close(got, want)
    plain = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
    assert (plain - want[0]).abs().max() > 1e-2  # sinks ignored: far off


def test_sink_attention_decodes_with_past_keys():
    s, new = 9, 2
    q, k, v, sinks, _ = _data(s, 1)
    full = sink_attention(q, k, v, sinks, window=5)
    step = sink_attention(q[:, :, -new:], k, v, sinks, window=5, past=s - new)
    torch.testing.assert_close(step, full[:, :, -new:], rtol=1e-12, atol=1e-12)


def test_document_attention_with_sinks():
    s = 12
    q, k, v, sinks, grad = _data(s, 2)
    ids = torch.tensor([[0] * 5 + [1] * 4 + [2] * 3, [0] * 2 + [1] * 10])
    docs = Documents(ids)
    want = _grads(lambda *t: _hf_eager(*t, _visible(s, 3, ids)), q, k, v, sinks, grad)
    got = _grads(lambda *t: document_attention(t[0], t[1], t[2], docs, window=3, sinks=t[3], impl="exact"),
                 q, k, v, sinks, grad)
    _close(got, want)
    with torch.no_grad():  # FlexAttention: no CPU backward; its forward (the lse route) equals the exact path
        flex = document_attention(q.float(), k.float(), v.float(), Documents(ids), window=3, sinks=sinks.float(),
                                  impl="flex")
    torch.testing.assert_close(flex.double(), want[0], rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="soft-capped"):
        document_attention(q, k, v, docs, softcap=5.0, sinks=sinks)


CP_CASES = [  # (mode, sequence length, window, packed documents)
    ("ring", 12, None, False),
    ("ring", 11, 5, False),   # padded to 12; the window binds in some blocks
    ("ring", 12, None, True),
    ("a2a", 12, 5, False),
]


def _doc_ids(padded):
    ids = torch.tensor([[0] * 5 + [1] * 7, [0] * 9 + [1] * 3])[:, :padded]
    return F.pad(ids, (0, padded - ids.shape[1]), value=ids.max().item() + 1)


def _cp_worker():
    results = []
    for i, (mode, s, window, packed) in enumerate(CP_CASES):
        dims = tpzoo.init_parallel(cp=2)
        try:
            padded = padded_length(s, 2)
            q, k, v, sinks, grad = (F.pad(t, (0, 0, 0, padded - s)) if t.dim() == 4 else t for t in _data(s, 10 + i))
            idx = local_positions(padded // 4, 2, dims.cp_rank, "cpu")
            mine = [t.index_select(2, idx).clone().requires_grad_() for t in (q, k, v)]
            my_sinks = sinks.clone().requires_grad_()
            ids = _doc_ids(padded) if packed else None
            if mode == "ring":
                out = ring_attention(*mine, dims.cp_group, dims.ranks("cp"), dims.cp_rank, window=window,
                                     doc_ids=ids, sinks=my_sinks)
            else:
                heads = local_heads(H, 2, dims.cp_rank)
                out = ulysses_attention(*mine, dims.cp_group, 2,
                                        lambda a, b, c: sink_attention(a, b, c, my_sinks[heads], window=window))
            out.backward(grad.index_select(2, idx))
            results.append({"idx": idx, "out": out.detach(), "grads": [t.grad for t in (*mine, my_sinks)]})
        finally:
            tpzoo.destroy_parallel()
    return results


def test_sinks_under_context_parallelism():
    per_rank = run_on_ranks(2, _cp_worker)
    for i, (mode, s, window, packed) in enumerate(CP_CASES):
        padded = padded_length(s, 2)
        q, k, v, sinks, grad = (F.pad(t, (0, 0, 0, padded - s)) if t.dim() == 4 else t for t in _data(s, 10 + i))
        mask = _visible(padded, window, _doc_ids(padded) if packed else None)
        want = _grads(lambda *t: sink_attention(*t, mask=mask), q, k, v, sinks, grad)
        sink_grad = sum(r[i]["grads"][3] for r in per_rank)
        torch.testing.assert_close(sink_grad, want[4], rtol=1e-10, atol=1e-10, msg=lambda m: f"{CP_CASES[i]}: {m}")
        for rank in per_rank:
            got, idx = rank[i], rank[i]["idx"]
            rows = [want[0], *want[1:4]]
            for a, b in zip([got["out"], *got["grads"][:3]], rows):
                torch.testing.assert_close(a, b.index_select(2, idx), rtol=1e-10, atol=1e-10,
                                           msg=lambda m: f"{CP_CASES[i]}: {m}")
    # the comparison can fail: the ring's output without sinks is far from the reference
    q, k, v, sinks, _ = _data(12, 10)
    plain = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    idx = per_rank[0][0]["idx"]
    assert (plain.index_select(2, idx) - per_rank[0][0]["out"]).abs().max() > 1e-2


@pytest.mark.cuda
def test_sinks_on_cuda_flex_and_fused_blocks():
    """GPU twin of the CPU checks above: the compiled FlexAttention path (its backward through the log-sum-exp)
    and the CUDA block kernels (sink_attention's fused path) against the exact torch math, fp32 and bf16."""
    s, dev = 64, torch.device("cuda")
    ids = torch.tensor([[0] * 20 + [1] * 44, [0] * 50 + [1] * 14], device=dev)
    for dtype, tol in ((torch.float32, 1e-4), (torch.bfloat16, 3e-2)):
        g = torch.Generator(device=dev).manual_seed(0)
        q, k, v = (torch.randn(B, n, s, 16, generator=g, device=dev, dtype=dtype) for n in (H, HKV, HKV))
        sinks = torch.randn(H, generator=g, device=dev)
        grad = torch.randn(B, H, s, 16, generator=g, device=dev, dtype=dtype)
        exact = _grads(lambda *t: document_attention(t[0], t[1], t[2], Documents(ids), window=24, sinks=t[3],
                                                     impl="exact"), q, k, v, sinks, grad)
        flex = _grads(lambda *t: document_attention(t[0], t[1], t[2], Documents(ids), window=24, sinks=t[3],
                                                    impl="flex"), q, k, v, sinks, grad)
        fused = _grads(lambda *t: sink_attention(*t), q, k, v, sinks, grad)
        plain = _grads(lambda *t: sink_attention(*t, fused=False), q, k, v, sinks, grad)
        for got, want in ((flex, exact), (fused, plain)):
            for a, b in zip(got, want):
                torch.testing.assert_close(a.float(), b.float(), rtol=tol, atol=tol)
