"""What a training step computes: the language model's next-token loss (pretraining, SFT), DPO or distillation.

Every objective runs through the one executor (tpzoo.pipeline.execute) as StepFunctions whose last stage computes
it, so every schedule, tp + SP, cp, ep and ZeRO level work without a path of their own. An objective may run a
frozen model first over the same micro-batches (DPO's reference, a distillation teacher): a forward-only pass of
the executor over that model's chunks (`side_pass`), whose last stage keeps what the objective needs per
micro-batch (a few numbers per sequence or per token) for the training pass to read.

The trainer (tpzoo.train.loop) asks the objective for:
  datasets(cfg, tokenizer)    (train, held-out, description), or None for the trainer's own (text / SFT)
  setup(trainer)              after the model, the optimizer and the datasets exist: reference, teacher, tables
  count(host_batches)         this rank's share of the step's normalizer (trained tokens; DPO: pairs), summed
                              over dp x cp by the trainer: the backward starts from each sum / the global count
  forward_backward(trainer, batches, scale)   {"loss_sum": float, "metrics": {name: sum}} on every rank
  evaluate(trainer, batches)  {"loss_sum", "count", "metrics"}: forward only, the held-out split
  save(trainer, directory)    what a checkpoint must keep for the objective (inside the atomic save)
The metrics are sums over the step's units; the trainer sums them over dp x cp and divides by the global count.
"""
from __future__ import annotations

import torch

from tpzoo.data import IGNORE_INDEX
from tpzoo.parallel import comm
from tpzoo.pipeline import execute, forward_backward, lm_step
from tpzoo.pipeline.stage import StepFunctions


class Totals:
    """Sums on the last pipeline stage, on the device (no host sync per micro-batch); `shared` gives them to every
    pipeline rank."""

    def __init__(self, n: int, device):
        self.values = torch.zeros(n, dtype=torch.float64, device=device)

    def add(self, values) -> None:
        self.values += torch.stack([torch.as_tensor(v, dtype=torch.float64, device=self.values.device).reshape(())
                                    for v in values])

    def shared(self, dims) -> list[float]:
        total = self.values
        if dims.pp > 1:
            total = comm.broadcast(total.clone(), src=dims.pp_peer(dims.pp - 1), group=dims.pp_group)
        return total.tolist()


def unlabelled_step(loss, last) -> StepFunctions:
    """lm_step without labels on any stage: the last stage's output is the logits shard [b, s, V'/tp] (the whole
    sequence under SP) for `last(microbatch, logits, batch)`, which still sees the batch's labels."""
    inner = lm_step(loss, last)

    def forward(index, chunk, batch, received):
        return inner.forward(index, chunk, {k: v for k, v in batch.items() if k != "labels"}, received)

    return StepFunctions(forward, last)


@torch.no_grad()
def side_pass(chunks, batches: list[dict], dims, last, *, labels: bool = True, loss=None) -> None:
    """One forward-only pass of the executor over `chunks` (a frozen model: DPO's reference, a teacher); its last
    stage calls `last(microbatch, output, batch)` (per-token loss with labels, else the logits shard)."""
    step = lm_step(loss, last) if labels else unlabelled_step(loss, last)
    execute(chunks, batches, dims, step, forward_only=True)


def trained_tokens(batches: list[dict]) -> int:
    return sum(int((b["labels"] != IGNORE_INDEX).sum()) for b in batches)


class Objective:
    """The language model's next-token loss over the trained tokens (the trainer's LossOptions: label smoothing,
    z-loss, a mixture of experts' router losses; the held-out loss the language model's alone)."""
    name = "lm"
    unit = "tokens"  # what count() counts (the step's "tokens" in metrics.jsonl; DPO: "pairs")
    metrics: tuple = ()

    def __init__(self, cfg):
        self.cfg = cfg

    def datasets(self, cfg, tokenizer):
        return None

    def setup(self, trainer) -> None:
        pass

    def describe(self) -> str:
        return ""

    def count(self, host_batches: list[dict], dims) -> float:
        return trained_tokens(host_batches)

    def forward_backward(self, trainer, batches: list[dict], scale: float) -> dict:
        out = forward_backward(trainer.chunks, batches, trainer.dims, schedule=self.cfg.schedule, loss_scale=scale,
                               loss=trainer.loss)
        # logged: multi-token prediction's mtp_loss, the auxiliary losses the model trains with (the sparse
        # attention indexer's KL)
        return {"loss_sum": out["loss_sum"], "metrics": out["reports"]}

    def evaluate(self, trainer, batches: list[dict]) -> dict:
        out = forward_backward(trainer.chunks, batches, trainer.dims, schedule=self.cfg.schedule, forward_only=True,
                               loss=trainer.held_out)  # (mtp_loss reported: eval_mtp_loss)
        return {"loss_sum": out["loss_sum"], "count": out["tokens"], "metrics": out["reports"]}

    def save(self, trainer, directory) -> None:
        pass

    def close(self) -> None:
        pass


def objective_of(cfg) -> Objective:
    """The run's objective (--objective)."""
    if cfg.objective == "dpo":
        from .dpo import DPOObjective

        return DPOObjective(cfg)
    if cfg.objective == "distill":
        from .distill import DistillObjective

        return DistillObjective(cfg)
    return Objective(cfg)
