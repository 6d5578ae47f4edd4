"""MuonClip (tpzoo.train.qk_clip, `--qk-clip`) against a reference computed from the full attention logits.

The reference trains in one process with the same Muon and, after each step, takes every head's largest logit
from the whole score matrices (scale * q k^T of each micro-batch's q and k as the attention core received them,
under the causal mask, every token, no blocks) and scales the rows itself: grouped queries by their kv group's
smallest eta = min(1, tau / logit), square-rooted, on the query and key rows; latent attention per head, q_nope and
k_nope by sqrt(eta), q_rope by eta. tp 2 with sequence parallelism, cp 2 (the keys of both cp ranks), pp 2
(each stage its own layers), MLA at tp 2, a kv head replicated over tp 2, Kimi Linear at tp 2 (its NoPE latent
attention clipped, q_lora_rank null; its Kimi Delta Attention layers have no softmax logits and are left alone), and
DeepSeek Sparse Attention at tp 2 + SP and cp 2 (its logits over the keys the indexer selected) must give the same
step maxima and the same weights; tau is chosen so that some heads are clipped and some not, and without clipping
the weights would differ.
"""
from __future__ import annotations

import functools

import pytest
import torch

from tpzoo.models import Transformer
from tpzoo.parallel.dims import local_dims
from tpzoo.pipeline import finalize_grads, forward_backward
from tpzoo.testing import run_on_ranks

from test_muon import LR, MODELS, RTOL, SEED, STEPS, local_batches, make_muon, reference, run_layouts

# between the first step's largest logits of the heads or kv groups (gqa 0.028-0.037, mla 0.022-0.048; llama's one
# kv group per layer: 0.048 and 0.037)
# kimi: its one latent attention layer's heads 0.022-0.034 over the three steps (6 of 12 head-steps clipped)
# dsa: over the selected keys 0.034-0.046 in layer 0 (0.048 over every causal key: a recorder blind to the selection
# clips one more head), under 0.024 in layer 1
TAU = {"gqa": 0.035, "mla": 0.04, "llama": 0.04, "kimi": 0.025, "dsa": 0.035}


def full_logits(q: torch.Tensor, k: torch.Tensor, scale: float, selected=None) -> torch.Tensor:
    """Largest causal logit per head of one forward: q [b, h, s, d], k [b, kv, s, d]; of DeepSeek Sparse Attention
    over the keys its indexer selected (the core's mask `selected` [b, 1, s, s])."""
    k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
    scores = (q.detach().double() @ k.detach().double().mT) * scale
    hidden = torch.ones(q.shape[2], k.shape[2], dtype=torch.bool).triu(1)
    if selected is not None:
        assert not (selected & hidden).any()  # (the selection is causal)
        hidden = ~selected
    return scores.masked_fill(hidden, float("-inf")).amax(dim=(0, 2, 3))


def clip_rows(mod, eta: torch.Tensor) -> None:
    """The reference's own row scaling (module docstring), in place on the weights (fp32: the master)."""
    with torch.no_grad():
        if hasattr(mod, "qkv"):
            hd, heads, kv = mod.head_dim, mod.heads, mod.kv_heads
            f = eta.view(kv, -1).amin(dim=1).sqrt()
            w = mod.qkv.weight
            for h in range(heads):
                w[h * hd:(h + 1) * hd] *= f[h // (heads // kv)]
            for g in range(kv):
                w[heads * hd + g * hd: heads * hd + (g + 1) * hd] *= f[g]
        else:
            m = mod.m
            q_w = (mod.q_proj if m.q_lora_rank is None else mod.q_b_proj).weight
            q = q_w.view(mod.heads, m.qk_nope_head_dim + m.qk_rope_head_dim, -1)
            q[:, :m.qk_nope_head_dim] *= eta.sqrt().view(-1, 1, 1)
            q[:, m.qk_nope_head_dim:] *= eta.view(-1, 1, 1)
            kv = mod.kv_b_proj.weight.view(mod.heads, m.qk_nope_head_dim + m.v_head_dim, -1)
            kv[:, :m.qk_nope_head_dim] *= eta.sqrt().view(-1, 1, 1)


@functools.cache
def clip_reference(model: str) -> dict:
    cfg, dims, tau = MODELS[model], local_dims(), TAU[model]
    net = Transformer(cfg, dims, seed=SEED)
    opt = make_muon([net], dims, {})
    seen, mixers = [], {}
    for i, block in net.layers.items():
        if not callable(getattr(block.attn, "qk_clip_scales", None)):  # a linear attention: no logits to clip
            continue
        mixers[int(i)] = block.attn
        scale = block.attn.core.scale or block.attn.head_dim ** -0.5 if hasattr(block.attn, "head_dim") else \
            block.attn.core.scale
        block.attn.core.register_forward_pre_hook(
            lambda _, args, layer=int(i), scale=scale: seen.append(
                (layer, full_logits(args[0], args[1], scale, args[3] if getattr(args[3], "dtype", None) == torch.bool
                                   else None))))
    maxima, clipped = [], 0
    for step in range(STEPS):
        seen.clear()
        mbs, tokens = local_batches(cfg, step, dims)
        opt.zero_grad()
        forward_backward([net], mbs, dims, loss_scale=1.0 / tokens)
        finalize_grads([net], dims)
        opt.reduce_grads()
        opt.step(LR)
        per_layer = {}
        for layer, m in seen:
            per_layer[layer] = m if layer not in per_layer else torch.maximum(per_layer[layer], m)
        maxima.append(max(float(m.max()) for m in per_layer.values()))
        for layer, m in per_layer.items():
            eta = torch.clamp(tau / m, max=1.0).float()
            clipped += int((eta < 1).sum())
            clip_rows(mixers[layer], eta)
    params = {n: p.detach().clone() for n, p in net.named_parameters()}
    return {"params": params, "max_logits": maxima, "clipped": clipped}


LAYOUTS = [dict(model="gqa", tp=2, sp=True, qk_clip=TAU["gqa"]), dict(model="gqa", cp=2, qk_clip=TAU["gqa"]),
           dict(model="gqa", pp=2, qk_clip=TAU["gqa"]), dict(model="mla", tp=2, qk_clip=TAU["mla"]),
           dict(model="llama", tp=2, qk_clip=TAU["llama"]),  # its one kv head on both tp ranks
           dict(model="kimi", tp=2, qk_clip=TAU["kimi"]),  # NoPE latent attention among Kimi Delta Attention
           dict(model="dsa", tp=2, sp=True, qk_clip=TAU["dsa"]), dict(model="dsa", cp=2, qk_clip=TAU["dsa"])]


def test_qk_clip_equals_the_full_logits_reference_at_tp_cp_pp():
    results = run_on_ranks(2, run_layouts, LAYOUTS)
    for i, layout in enumerate(LAYOUTS):
        ref, plain = clip_reference(layout["model"]), reference(layout["model"])
        assert 0 < ref["clipped"] < STEPS * 8, ref["clipped"]  # some heads clipped, not all
        for r in (r[i] for r in results):
            assert r["max_logits"] == pytest.approx(ref["max_logits"], rel=1e-5), layout
            for name, p in r["params"].items():
                want, rtol = ref["params"][name], RTOL.get(layout["model"], 1e-5)
                torch.testing.assert_close(p, want, rtol=rtol, atol=rtol * float(want.abs().max()),
                                           msg=lambda m: f"{layout} {name}: {m}")
        moved = max(float((ref["params"][n] - plain["params"][n]).abs().max()) for n in ref["params"])
        assert moved > 1e-3, moved  # clipping changed the weights (far beyond the tolerance)
