"""MuonClip's QK-clip (Kimi K2 report): the largest pre-softmax attention logit of every head over a step, and the
scaling of the query and key projections of the heads whose logit exceeded `--qk-clip TAU`.

Recording. Every attention kind that declares `qk_clip_scales` (softmax attention, latent attention) gets a forward
pre-hook on its `core`, the parameterless softmax(q k^T) v: it sees this rank's heads' q [b, h, s, d] and k after the
rotary (and the q/k norms), and computes, without autograd and in blocks of queries, the largest scale * q.k over
the (query, key) pairs the attention lets meet: causal by position, within a sliding window, within a document of
a packed batch (before a soft-cap; sinks are not q.k logits). A recomputation does not record again. Under context
parallelism a rank's queries meet every rank's keys: the keys of the cp group are all-gathered for it (forward
only, counted; ring attention never holds them all), masked by the global positions of the load-balanced chunks.
This is an extra q k^T per layer and micro-batch (flash kernels do not return the row maxima).
A core that is no LocalCore says itself which pairs meet (`logit_pairs(*args) -> (q, k, allowed [b, s_q, s_k],
scale)`, every key already on the rank): DeepSeek Sparse Attention's (models/kinds/sparse_mla.py), whose queries meet
only the keys its indexer selected, the logits taken over those pairs.

Per step: the maximum of each (layer, head) over the micro-batches, then one all-reduce (MAX) over the world of a
[layers, heads] table that each rank fills with the heads it holds, so every rank sees every head's logit (tp
splits the heads, pp the layers, dp and cp the tokens). `max_attn_logit` is its largest entry (metrics.jsonl,
TensorBoard, the log line), with clipping or without (`--log-max-attn-logit`).

Clipping: eta = min(1, TAU / max logit) per head, turned by the kind into factors of its projections' rows
(softmax attention: a kv group's smallest eta, square-rooted, on its query heads and its key head, Megatron-Core's
rule for grouped queries; latent attention: q_nope and k_nope by sqrt(eta), q_rope by eta, the shared rotary key
untouched, as Kimi K2 does), which the optimizer multiplies into the updated master weights before publishing them
(tpzoo.train.muon.DistributedMuon.scale_rows): every copy of a row gets the same factor.
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch

from tpzoo.errors import ConfigError
from tpzoo.models.kinds.attention_core import LocalCore
from tpzoo.models.recompute import is_recomputing
from tpzoo.parallel import comm
from tpzoo.parallel.ring_attention import local_positions

BLOCK_SCORES = 1 << 24  # logits computed at once (per block of queries)


@dataclass
class StepLogits:
    max_logit: float | None        # the step's largest logit over every head (None: no attention layer)
    rows: list                     # [(param, factor per row of this rank's shard)] to clip; empty: nothing to do


def create(cfg, dims, chunks) -> "MaxLogits | None":
    """The recorder of a run that clips (--qk-clip > 0) or logs the logits (--log-max-attn-logit), else None."""
    if not (cfg.qk_clip > 0 or cfg.log_max_attn_logit):
        return None
    return MaxLogits(chunks, dims, cfg.qk_clip)


class MaxLogits:
    """The step's largest logit per (layer, head) of this rank's attention layers (module docstring)."""

    def __init__(self, chunks, dims, tau: float = 0.0):
        self.dims, self.tau, self.active = dims, tau, False
        self.mixers, self.hooks, self.values = {}, [], {}
        self.context = None  # the forward's Context (its token mask), seen by the mixer's pre-hook
        cfg = chunks[0].cfg
        self.num_layers, self.num_heads = cfg.num_layers, cfg.attention.num_heads
        for chunk in chunks:
            for name, mod in chunk.named_modules():
                if not callable(getattr(mod, "qk_clip_scales", None)):
                    continue
                layer = int(name.split(".")[1])
                if tau > 0 and getattr(mod, "qk_norm", "none") != "none":
                    raise ConfigError(f"--qk-clip {tau:g}: layer {layer} normalizes q and k after their projections "
                                      f"(qk_norm {mod.qk_norm!r}), so scaling the projections changes no logit; use "
                                      f"--log-max-attn-logit to watch the logits")
                local = next((m for m in mod.core.modules() if isinstance(m, LocalCore)), None)
                if local is None and not callable(getattr(mod.core, "logit_pairs", None)):
                    raise ConfigError(f"--qk-clip / --log-max-attn-logit: layer {layer}'s attention core "
                                      f"({type(mod.core).__name__}) does not say which logits it computes")
                self.mixers[layer] = mod
                self.hooks.append(mod.register_forward_pre_hook(self._see_context))
                self.hooks.append(mod.core.register_forward_pre_hook(functools.partial(self._record, layer, mod,
                                                                                       local)))

    def close(self) -> None:
        for h in self.hooks:
            h.remove()

    def begin(self) -> None:
        """Start recording a training step (evaluation and generation forwards are not recorded)."""
        self.active, self.values = True, {}

    def _see_context(self, module, args) -> None:
        self.context = args[1] if len(args) > 1 else None

    def _record(self, layer: int, mixer, local: LocalCore, module, args) -> None:
        if not self.active or is_recomputing():
            return
        q, k = args[0], args[1]
        mask = getattr(self.context, "token_mask", None)
        mask = mask if mask is not None and mask.shape[-1] == q.shape[2] else None
        if local is None:  # a core that masks the pairs itself (module docstring)
            q, k, allowed, scale = module.logit_pairs(*args)
            if mask is not None:
                allowed = allowed & mask.view(q.shape[0], -1, 1).bool()
            value = masked_max_logits(q, k, scale, allowed)
        else:
            past = args[3] if len(args) > 3 else 0
            docs = args[4] if len(args) > 4 else None
            value = head_max_logits(q, k, local.scale, local.window, past, docs, self.dims, mask)
        prev = self.values.get(layer)
        self.values[layer] = value if prev is None else torch.maximum(prev, value)

    def finish(self, clip: bool = True) -> StepLogits:
        """The step's logits on every rank (one all-reduce over the world: every rank calls it), and with `clip`
        the rows to scale."""
        self.active = False
        table = torch.full((self.num_layers, self.num_heads), -math.inf, dtype=torch.float32,
                           device=self.dims.device)
        for layer, value in self.values.items():
            at = self.dims.tp_rank * value.numel()
            table[layer, at:at + value.numel()] = value
        self.values = {}
        if self.dims.world_size > 1:
            comm.all_reduce(table, None, op=torch.distributed.ReduceOp.MAX)
        top = float(table.max())
        rows = []
        if clip and self.tau > 0 and top > self.tau:
            eta = torch.where(table > self.tau, self.tau / table, torch.ones_like(table))
            for layer, mixer in self.mixers.items():
                if bool((eta[layer] < 1).any()):
                    rows += mixer.qk_clip_scales(eta[layer])
        return StepLogits(top if math.isfinite(top) else None, rows)


def head_max_logits(q, k, scale: float | None, window: int | None, past: int, docs, dims,
                    token_mask=None) -> torch.Tensor:
    """The largest scale * q.k per query head [h] (fp32) over the visible pairs of q [b, h, s_q, d] and k
    [b, kv_heads, s_k, d] (kv heads shared by h / kv_heads query heads each); under cp (dims.cp > 1) over the keys
    of every cp rank."""
    with torch.no_grad():
        b, _, s_q, d = q.shape
        scale = d ** -0.5 if scale is None else scale
        device = q.device
        if dims.cp > 1:
            chunk, cp = s_q // 2, dims.cp
            k = comm.all_gather(k.contiguous(), dims.cp_group, dim=2)
            qpos = local_positions(chunk, cp, dims.cp_rank, device)
            kpos = torch.cat([local_positions(chunk, cp, r, device) for r in range(cp)])
        else:
            qpos = torch.arange(past, past + s_q, device=device)
            kpos = torch.arange(k.shape[2], device=device)
        visible = kpos.unsqueeze(0) <= qpos.unsqueeze(1)  # [s_q, s_k]
        if window is not None:
            visible = visible & (qpos.unsqueeze(1) - kpos.unsqueeze(0) < window)
        visible = visible.unsqueeze(0).expand(b, -1, -1)
        if docs is not None:
            ids = docs.ids
            visible = visible & (ids[:, qpos].unsqueeze(2) == ids[:, kpos].unsqueeze(1))
        if token_mask is not None:
            visible = visible & token_mask.view(b, s_q, 1).bool()
        return masked_max_logits(q, k, scale, visible)


def masked_max_logits(q, k, scale: float, allowed) -> torch.Tensor:
    """The largest scale * q.k per query head [h] (fp32) over the pairs `allowed` [b or 1, s_q, s_k] lets meet, of q
    [b, h, s_q, d] and k [b, kv_heads, s_k, d], in blocks of queries."""
    with torch.no_grad():
        b, h, s_q, _ = q.shape
        kv = k.shape[1]
        allowed = allowed.expand(b, -1, -1)
        qf = q.float().unflatten(1, (kv, h // kv))          # [b, kv, g, s_q, d]
        kf = k.float().unsqueeze(2)                          # [b, kv, 1, s_k, d]
        best = torch.full((kv, h // kv), -math.inf, device=q.device)
        step = max(1, BLOCK_SCORES // max(1, b * h * k.shape[2]))
        for lo in range(0, s_q, step):
            scores = (qf[:, :, :, lo:lo + step] @ kf.mT) * scale  # [b, kv, g, block, s_k]
            scores = scores.masked_fill(~allowed[:, None, None, lo:lo + step], -math.inf)
            best = torch.maximum(best, scores.amax(dim=(0, 3, 4)))
        return best.flatten()
