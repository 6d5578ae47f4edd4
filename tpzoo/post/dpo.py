"""Direct Preference Optimization (Rafailov et al. 2023) at every layout, with TRL's definitions.

For a pair (chosen c, rejected r) of one prompt, log pi(y) sums the policy's log-probabilities of y's trained tokens
(its completion, EOS included: tpzoo.post.dpo_data), ref(y) the reference model's, and the log-ratios are
rho_y = log pi(y) - log ref(y). Per pair (TRL's DPOTrainer):
  sigmoid  -(1 - eps) log sigmoid(beta (rho_c - rho_r)) - eps log sigmoid(-beta (rho_c - rho_r))
           (eps = --dpo-label-smoothing: conservative DPO, Mitchell's formula; 0: the paper's loss)
  ipo      (rho_c / n_c - rho_r / n_r - 1 / (2 beta))^2, each log-ratio averaged over its n trained tokens
           (TRL's current IPO)
The loss is the mean over the step's pairs (every pair of the global batch, whatever the layout). Reported, as TRL
names them: rewards/chosen and rewards/rejected (beta rho, summed log-ratios, means over the pairs),
rewards/accuracies (the share with rewards/chosen > rewards/rejected, strictly), rewards/margins (their difference),
logps/chosen and logps/rejected (the policy's summed log-probabilities).

How it runs. A pair is one sequence (chosen, then rejected, document-masked), so both sides are in the same
micro-batch and row. The last pipeline stage computes the per-token loss with the head (fused linear
cross-entropy: -log pi of each label, no logits of the whole sequence; a mixture of experts' router losses are not
added) and sums it per side of each row (`side_sums`; under cp each rank holds some of a row's tokens: the sums are
all-reduced over cp, their gradient flowing back to each rank's own tokens), then the pair losses. The reference
log-probabilities come first, per micro-batch, from tpzoo.post.dpo_reference. A side with trained tokens whose other
side has none in the same micro-batch (a pair split apart: only a hand-made batch can do it) stops the step with a
DataError on every rank, before the update.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from tpzoo.data import IGNORE_INDEX
from tpzoo.errors import DataError
from tpzoo.models import LossOptions
from tpzoo.parallel import comm
from tpzoo.pipeline import execute, lm_step

from .objective import Objective, Totals

LOSSES = ("sigmoid", "ipo")
METRICS = ("rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins", "logps/chosen",
           "logps/rejected")
_TOTALS = ("loss", *METRICS, "pairs", "split")


@dataclass(frozen=True)
class DPOSettings:
    beta: float = 0.1
    loss: str = "sigmoid"
    label_smoothing: float = 0.0

    def __post_init__(self):
        if self.loss not in LOSSES:
            raise ValueError(f"dpo loss must be one of {LOSSES}, got {self.loss!r}")
        if not self.beta > 0:
            raise ValueError(f"dpo beta must be > 0, got {self.beta}")
        if not 0 <= self.label_smoothing < 0.5:
            raise ValueError(f"dpo label smoothing must be in [0, 0.5), got {self.label_smoothing}")

    @classmethod
    def of(cls, cfg) -> "DPOSettings":
        return cls(cfg.dpo_beta, cfg.dpo_loss, cfg.dpo_label_smoothing)


def pair_losses(policy: torch.Tensor, reference: torch.Tensor, counts: torch.Tensor,
                s: DPOSettings) -> tuple[torch.Tensor, torch.Tensor]:
    """(loss per pair [n], rewards [n, 2]) from the summed log-probabilities [n, 2] (chosen, rejected) of the
    policy and the reference and each side's trained tokens [n, 2] (see the module docstring)."""
    ratios = policy - reference
    if s.loss == "ipo":
        mean = ratios / counts.clamp(min=1)
        losses = (mean[:, 0] - mean[:, 1] - 1 / (2 * s.beta)) ** 2
    else:
        z = s.beta * (ratios[:, 0] - ratios[:, 1])
        eps = s.label_smoothing
        losses = -(1 - eps) * F.logsigmoid(z) - eps * F.logsigmoid(-z)
    return losses, s.beta * ratios.detach()


def _summed_over(t: torch.Tensor, group) -> torch.Tensor:
    """t's sum over the ranks of `group` as the value, the identity as the gradient (each rank's share of a sum
    that every rank then uses alike)."""
    total = t.detach().clone()
    comm.all_reduce(total, group)
    return t + (total - t.detach())


def side_sums(per_token: torch.Tensor, batch: dict, dims) -> tuple[torch.Tensor, torch.Tensor]:
    """(summed log-probabilities [b, 2] (chosen, rejected) of each row's trained tokens, differentiable; their
    numbers of trained tokens [b, 2]) from the per-token loss (-log p of each label), over the whole rows under cp.
    No host synchronization."""
    labels, side = batch["labels"].to(per_token.device), batch["dpo_seq"].to(per_token.device)
    b = labels.shape[0]
    trained = (labels != IGNORE_INDEX) & (side > 0)
    slot = (torch.arange(b, device=per_token.device).unsqueeze(1) * 2 + (side - 1).clamp(min=0)).reshape(-1)
    weight = trained.reshape(-1).double()
    sums = torch.zeros(2 * b, dtype=torch.float64, device=per_token.device).index_add(
        0, slot, -per_token.reshape(-1).double() * weight)
    counts = torch.zeros_like(sums).index_add_(0, slot, weight)
    if dims.cp > 1:
        sums = _summed_over(sums, dims.cp_group)
        comm.all_reduce(counts, dims.cp_group)
    return sums.view(b, 2), counts.view(b, 2)


class PolicyLast:
    """Last stage of the policy's pass: the pair losses of a micro-batch from its per-token losses and the
    reference's log-probabilities for it (`reference[microbatch]`, [b, 2]); sums the totals (on cp rank 0 only,
    so sums over dp x cp count each pair once) and returns the scaled loss sum to backpropagate."""

    def __init__(self, settings: DPOSettings, dims, reference: list, scale: float | None, device):
        self.settings, self.dims, self.reference, self.scale = settings, dims, reference, scale
        self.totals = Totals(len(_TOTALS), device)

    def __call__(self, mb, per_token, batch):
        sums, counts = side_sums(per_token, batch, self.dims)
        present = counts > 0
        pair = present.all(1).double()  # rows with neither side trained (held-out fillers) count for nothing
        split = (present.any(1) & ~present.all(1)).double().sum()
        losses, rewards = pair_losses(sums, self.reference[mb].to(sums), counts, self.settings)
        losses = losses * pair
        if self.dims.cp_rank == 0:
            c, r = rewards.unbind(1)
            self.totals.add([losses.detach().sum(), (c * pair).sum(), (r * pair).sum(), ((c > r) * pair).sum(),
                             ((c - r) * pair).sum(), (sums[:, 0].detach() * pair).sum(),
                             (sums[:, 1].detach() * pair).sum(), pair.sum(), split])
        return None if self.scale is None else losses.sum() * self.scale


def dpo_pass(chunks, batches: list[dict], dims, settings: DPOSettings, reference: list, *, schedule: str = "1f1b",
             scale: float | None = None, fused: bool = True, group=None) -> dict:
    """The policy's pass over the micro-batches (forward and backward with `scale`, forward only without):
    {"loss": sum of the pair losses, metric: sum, "pairs": n} of this rank's share (cp rank 0 of each pair),
    the same on every pipeline rank. A pair split between micro-batches raises DataError on every rank of
    `group` (the ranks summing the step: dp x cp), before anything is updated."""
    last = PolicyLast(settings, dims, reference, scale, chunks[0].device)
    execute(chunks, batches, dims, lm_step(LossOptions(aux_losses=False, fused=fused), last), schedule=schedule,
            forward_only=scale is None)
    out = dict(zip(_TOTALS, last.totals.shared(dims)))
    split = torch.tensor([out.pop("split")], dtype=torch.float64, device=chunks[0].device)
    comm.all_reduce(split, dims.grad_group if group is None else group)
    if split.item():
        raise DataError(f"{int(split.item())} preference pair(s) have their chosen and rejected responses in "
                        f"different micro-batches (each row of a DPO batch must hold one whole pair: "
                        f"tpzoo.post.dpo_data)")
    return out


class DPOObjective(Objective):
    """`--objective dpo`: preference pairs, the reference of tpzoo.post.dpo_reference."""
    name = "dpo"
    unit = "pairs"
    metrics = METRICS

    def __init__(self, cfg):
        super().__init__(cfg)
        self.settings = DPOSettings.of(cfg)
        self.reference = None

    def datasets(self, cfg, tokenizer):
        from .dpo_data import build_preference_datasets

        train, held = build_preference_datasets(cfg.data[0], tokenizer, cfg.seq_len, eval_fraction=cfg.eval_fraction,
                                                seed=cfg.seed, template=cfg.template)
        return train, held, f"preference pairs {cfg.data[0]} ({len(train)} pairs, one per sequence)"

    def setup(self, trainer) -> None:
        from .dpo_reference import reference_of_run

        self.reference = reference_of_run(trainer)

    def describe(self) -> str:
        s = self.settings
        smooth = f", label smoothing {s.label_smoothing:g}" if s.label_smoothing else ""
        return f"objective dpo ({s.loss}, beta {s.beta:g}{smooth}) | reference: {self.reference.describe()}"

    def count(self, host_batches: list[dict], dims) -> float:
        """Pairs: one per row (counted once per pair: on cp rank 0)."""
        return sum(b["labels"].shape[0] for b in host_batches) if dims.cp_rank == 0 else 0

    def _pass(self, trainer, batches, scale) -> dict:
        return dpo_pass(trainer.chunks, batches, trainer.dims, self.settings, self.reference.logps(batches),
                        schedule=self.cfg.schedule, scale=scale, fused=self.cfg.fused_linear_cross_entropy,
                        group=trainer.grad_group)

    def forward_backward(self, trainer, batches: list[dict], scale: float) -> dict:
        out = self._pass(trainer, batches, scale)
        return {"loss_sum": out["loss"], "metrics": {k: out[k] for k in METRICS}}

    def evaluate(self, trainer, batches: list[dict]) -> dict:
        out = self._pass(trainer, batches, None)
        return {"loss_sum": out["loss"], "count": out["pairs"], "metrics": {k: out[k] for k in METRICS}}

    def save(self, trainer, directory) -> None:
        self.reference.save(trainer, directory)

    def close(self) -> None:
        self.reference = None
