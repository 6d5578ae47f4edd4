"""Muon for the matrices of the hidden layers, AdamW for the rest, over DistributedAdamW's flat layout: every ZeRO
level, tensor, pipeline, context and expert parallelism (`--optimizer muon`, docs/training.md).

Same buffers, buckets and owned segments as DistributedAdamW (so the gradient reduction, the global norm, ZeRO-3's
gathers, publishing and resharded checkpoints are its own): `exp_avg` over the owned elements holds AdamW's first
moment for AdamW's parameters and Muon's momentum for Muon's (torch.optim.Muon's momentum buffer is the same
running average, `buf.lerp_(grad, 1 - momentum)`); `exp_avg_sq` covers AdamW's elements only. A Muon element costs
4 bytes of optimizer state instead of 8.

One step (torch.optim.Muon's rule, nesterov, adjust_lr_fn="match_rms_adamw", on the clipped gradients):
    buf = lerp(buf, g, 1 - momentum); update = lerp(g, buf, momentum)           owned elements, fp32
    O = NS(update) per matrix (tpzoo.train.muon_matrices), whole matrices gathered at their owners
                                                        (tpzoo.train.muon_exchange; AdamW's update meanwhile)
    W = W (1 - lr wd) - lr 0.2 sqrt(max(rows, cols)) O                          the fp32 master of owned elements
then MuonClip's row scaling of the attention projections (when given) and the publication of the new weights.

Checkpoints: the same model-format state directories as AdamW's, resharded on load like the weights (a run resumes
at another tp / pp / dp / ZeRO level): `exp_avg` holds every parameter's first moment (Muon's momentum for its
matrices), `exp_avg_sq` AdamW's second moment (zeros at Muon's matrices; absent when Muon has them all, as in a
LoRA run), `master` the fp32 weights of a 16-bit run.
"""
from __future__ import annotations

import time
from collections import defaultdict

import torch

from tpzoo.parallel.data_parallel import shard_segments

from .muon_exchange import MuonExchange, Unit
from .muon_matrices import Matrices, full_shape
from .optim import DistributedAdamW


class DistributedMuon(DistributedAdamW):
    """`matrices`: {id(param): (name, Matrices)} of the parameters Muon updates (tpzoo.train.muon_matrices.place;
    the others go to AdamW with the keywords DistributedAdamW takes); `momentum`, `ns_steps`: Muon's; `ns_dtype`:
    the Newton-Schulz iteration's (torch's bfloat16, or float32); `wave_elems`: local elements per wave of the
    exchange (overlap of the orthogonalization with the transfers)."""

    def __init__(self, params, dims, *, matrices: dict, momentum: float = 0.95, ns_steps: int = 5,
                 ns_dtype=torch.bfloat16, wave_elems: int = 1 << 24, **kw):
        super().__init__(params, dims, **kw)
        self.momentum, self.ns_steps, self.ns_dtype = momentum, ns_steps, ns_dtype
        units = []
        for p, o in zip(self.params, self.offsets):
            if id(p) in matrices:
                m, shape = matrices[id(p)][1], full_shape(p, dims.tp)
                units.append(Unit(p, o, m, shape, m.flops(shape, ns_steps)))
        self.units = units
        self._offset = {id(p): o for p, o in zip(self.params, self.offsets)}
        self._split_owned({id(u.param): u for u in units})
        self.exp_avg_sq = torch.zeros(self.n_adamw, dtype=torch.float32, device=self.device)
        sharded = self.zero1 and self.dp_size > 1
        dp, buckets = self.dp_size, self.buckets
        self.exchange = MuonExchange(units, dims=dims, group=self.group_name,
                                     dp_size=dp, dp_rank=self.dp_rank, sharded=sharded, owned=self.owned,
                                     segments_of=lambda r: shard_segments(buckets, dp, r), ns_steps=ns_steps,
                                     wave_elems=wave_elems, ns_dtype=ns_dtype)

    # -- which owned elements are whose ---------------------------------------------------------------------
    def _split_owned(self, units: dict) -> None:
        """Cut the owned vector into AdamW's runs (start, end, decayed, flat start, position in exp_avg_sq) and
        Muon's (start, end, flat start, lr factor); the padding belongs to neither."""
        adamw, muon, n_adamw = [], [], 0
        for lo, hi, pos in self.owned:
            for p, o in zip(self.params, self.offsets):
                a, b = max(o, lo), min(o + p.numel(), hi)
                if a >= b:
                    continue
                u = units.get(id(p))
                if u is None:
                    last = adamw[-1] if adamw else None
                    if last and last[1] == pos + a - lo and last[3] + last[1] - last[0] == a and last[2] == (p.dim() >= 2):
                        adamw[-1] = (last[0], pos + b - lo, last[2], last[3], last[4])
                    else:
                        adamw.append((pos + a - lo, pos + b - lo, p.dim() >= 2, a, n_adamw))
                    n_adamw += b - a
                    continue
                for la, lb, factor in _piece_runs(u, self.dims.tp):
                    fa, fb = max(o + la, a), min(o + lb, b)
                    if fa < fb:
                        muon.append((pos + fa - lo, pos + fb - lo, fa, factor))
        self.adamw_runs, self.muon_runs, self.n_adamw = adamw, muon, n_adamw
        by_factor = defaultdict(list)
        for k, run in enumerate(muon):
            by_factor[run[3]].append(k)
        self.by_factor = dict(by_factor)

    def _adamw_runs(self) -> list[tuple[int, int, bool, int, int]]:
        return self.adamw_runs

    # -- one step -------------------------------------------------------------------------------------------
    @torch.no_grad()
    def step(self, lr: float, grad_scale: float = 1.0, clip_rows=None) -> None:
        """Muon on its matrices and AdamW on the rest, gradients times `grad_scale` (clipping, loss-scale
        unscaling); `clip_rows`: MuonClip's [(param, factor per row of this rank's shard)] applied to the updated
        weights; then the new weights are published."""
        g = self.grad_owned
        self.step_count += 1
        t0 = time.perf_counter()
        if grad_scale != 1.0:
            g.mul_(grad_scale)  # consumed by this step: scaled once for both rules
        spans = [(a, b) for a, b, _, _ in self.muon_runs]  # this rank's elements (none is possible under ZeRO)
        if self.units:  # every rank of the groups takes part in the exchange, with elements or without
            vec = torch.empty(self.exp_avg.numel(), dtype=self.ns_dtype, device=self.device)
            if spans:
                grads, bufs = [g[a:b] for a, b in spans], [self.exp_avg[a:b] for a, b in spans]
                torch._foreach_lerp_(bufs, grads, 1.0 - self.momentum)
                torch._foreach_lerp_(grads, bufs, self.momentum)  # Nesterov, in place: the gradients are consumed
                torch._foreach_copy_([vec[a:b] for a, b in spans], grads)
            self.exchange.start(vec)
        t1 = time.perf_counter()
        self._adamw_update(g, lr, 1.0)  # while the first hop travels
        t2 = time.perf_counter()
        if self.units:
            ortho = self.exchange.finish()
            masters = [self.master_range(a, b, f) for a, b, f, _ in self.muon_runs]
            if self.weight_decay and masters:
                torch._foreach_mul_(masters, 1.0 - lr * self.weight_decay)
            for factor, ks in self.by_factor.items():
                torch._foreach_add_([masters[k] for k in ks], [ortho[spans[k][0]:spans[k][1]] for k in ks],
                                    alpha=-lr * factor)
        # host seconds of Muon's part of the step (momentum, exchange, Newton-Schulz, update): benchmarks
        self.muon_seconds = time.perf_counter() - t0 - (t2 - t1)
        if clip_rows:
            self.scale_rows(clip_rows)
        self.publish()

    def scale_rows(self, rows) -> None:
        """Multiply the master weights' rows of the given parameters (this rank's shards, dim 0) by the factors."""
        for p, factor in rows:
            o = self._offset.get(id(p))
            if o is None:
                continue
            per_element = factor.to(self.device, torch.float32).repeat_interleave(p.numel() // p.shape[0])
            for lo, hi, pos in self.owned:
                a, b = max(o, lo), min(o + p.numel(), hi)
                if a < b:
                    self.master_range(pos + a - lo, pos + b - lo, a).mul_(per_element[a - o:b - o])

    # -- state ----------------------------------------------------------------------------------------------
    def state_kinds(self) -> list[str]:
        """exp_avg (every parameter's first moment: AdamW's, and Muon's momentum buffer, the same running average),
        exp_avg_sq when AdamW has parameters here (zeros at Muon's), master with 16-bit weights."""
        return ["exp_avg"] + (["exp_avg_sq"] if self.n_adamw else []) + ([] if self.master_is_flat else ["master"])

    def full_state(self, kind: str) -> torch.Tensor:
        if kind == "exp_avg_sq":
            owned = torch.zeros_like(self.exp_avg)
            for a, b, _, _, c in self.adamw_runs:
                owned[a:b] = self.exp_avg_sq[c:c + b - a]
            return self.full_of(owned)
        return super().full_state(kind)

    def load_full_state(self, kind: str, full: torch.Tensor) -> None:
        if kind != "exp_avg_sq":
            return super().load_full_state(kind, full)
        owned = self.owned_of(full)
        for a, b, _, _, c in self.adamw_runs:
            self.exp_avg_sq[c:c + b - a] = owned[a:b]


def _piece_runs(u: Unit, tp: int) -> list[tuple[int, int, float]]:
    """(start, end, lr factor) of every piece's block in this rank's shard of unit `u`: a fused weight's parts split
    along the rows of each matrix (q, k, v; gate, up), each expert on its own. Elementwise work runs per block, as
    torch.optim.Muon runs it per matrix (so tp 1 matches it bit for bit: a kernel's vectorized body and scalar tail
    fall on the same elements)."""
    m: Matrices = u.matrices
    factors = m.lr_factors(u.shape)
    shape = u.param.shape
    spec = m.spec
    cols = shape[-1]
    matrices = shape[0] if m.experts else 1
    per_matrix = u.numel // matrices
    along = spec.dim % len(shape) - (len(shape) - 2) if spec.dim is not None else None
    if len(factors) > 1 and along != 0:
        if len(set(factors)) > 1:
            raise NotImplementedError("parts of different shapes along a matrix's columns")
        factors = factors[:1]  # blocks along the columns are not contiguous: one run per matrix
    if len(factors) == 1:
        return [(k * per_matrix, (k + 1) * per_matrix, factors[0]) for k in range(matrices)]
    reps = spec.replicas or (1,) * len(spec.parts)
    rows = [part * rep // tp for part, rep in zip(spec.parts, reps)]
    runs, at = [], 0
    for _ in range(matrices):
        for r, f in zip(rows, factors):
            runs.append((at, at + r * cols, f))
            at += r * cols
    return runs
