"""The optimizer of a run with expert parallelism: two DistributedAdamW, one for the expert weights (their
gradients summed, and ZeRO-sharded, over the expert-data-parallel group: the ranks holding the same experts) and
one for everything else (over dp x cp), behind the one interface the trainer and its checkpoints use.

The global gradient norm is one all-reduce of both local shares (each counts every element of its weights once:
the edp ranks split the experts' buffer as the dp x cp ranks split the rest). For checkpoints the two flat layouts
are laid end to end: `padded`, `full_state`, `params_viewing` and `load_full_state` work on the concatenation, so
tpzoo.train.checkpointing saves and loads the state exactly like a single optimizer's (the expert part gathered
over ep like the weights, docs/moe.md). ZeRO-3 (the weights themselves sharded) is refused with ep > 1 (TrainConfig).
"""
from __future__ import annotations

import contextlib

import torch

from .optim import DistributedAdamW


def is_expert(p) -> bool:
    return getattr(p, "expert_parallel", False)


class ExpertParallelAdamW:
    """`expert_group`: where the expert weights' gradients are summed ("edp"; a replica's own "replica_edp" when
    DiLoCo's replicas train alone, tpzoo.train.diloco); `inner`: the optimizer class of both parts
    (DistributedAdamW, or tpzoo.train.muon.DistributedMuon with its keywords bound); the other keywords go to
    both."""

    def __init__(self, params, dims, expert_group: str = "edp", inner=DistributedAdamW, **kw):
        params = list(params)
        self.dense = inner([p for p in params if not is_expert(p)], dims, **kw)
        self.experts = inner([p for p in params if is_expert(p)], dims, **{**kw, "group": expert_group})
        self.parts = (self.dense, self.experts)
        self.device = dims.device

    # -- one step -----------------------------------------------------------------------------------------
    def zero_grad(self) -> None:
        for o in self.parts:
            o.zero_grad()

    def reduce_grads(self) -> None:
        for o in self.parts:
            o.reduce_grads()

    def global_grad_norm(self, flag: float = 0.0) -> tuple[float, float]:
        return self.dense.global_grad_norm(flag, extra_sq=self.experts.local_sq_norm())

    def step(self, lr: float, grad_scale: float = 1.0, **kw) -> None:
        for o in self.parts:
            o.step(lr, grad_scale, **kw)

    @property
    def step_count(self) -> int:
        return self.dense.step_count

    @step_count.setter
    def step_count(self, value: int) -> None:
        for o in self.parts:
            o.step_count = value

    # -- state (the two layouts end to end) ---------------------------------------------------------------
    @property
    def padded(self) -> int:
        return self.dense.padded + self.experts.padded

    def state_kinds(self) -> list[str]:
        kinds = self.dense.state_kinds()
        return kinds + [k for k in self.experts.state_kinds() if k not in kinds]

    def full_state(self, kind: str) -> torch.Tensor:
        return torch.cat([o.full_state(kind) for o in self.parts])

    def load_full_state(self, kind: str, full: torch.Tensor) -> None:
        self.dense.load_full_state(kind, full[: self.dense.padded])
        self.experts.load_full_state(kind, full[self.dense.padded:])

    def sync_master_from_params(self) -> None:
        for o in self.parts:
            o.sync_master_from_params()

    @contextlib.contextmanager
    def params_viewing(self, full: torch.Tensor):
        with self.dense.params_viewing(full[: self.dense.padded]), \
                self.experts.params_viewing(full[self.dense.padded:]):
            yield

    @contextlib.contextmanager
    def weights_readable(self):
        with self.dense.weights_readable(), self.experts.weights_readable():
            yield

    def buffer_bytes(self) -> dict[str, int]:
        a, b = (o.buffer_bytes() for o in self.parts)
        return {k: a[k] + b[k] for k in a}
