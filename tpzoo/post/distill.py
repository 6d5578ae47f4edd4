"""Top-K logit distillation: a frozen teacher's K most likely tokens per position guide the student.

Per trained (response) token, with the teacher's top-K ids k_1..k_K and log-probabilities l_1..l_K:
  p_j = softmax_j(l_j / T)                 the teacher renormalized over its top K, at temperature T
  log q_j = log softmax(z / T)[k_j]        the student's log-softmax over its whole vocabulary, at those ids
  loss = A T^2 sum_j p_j (log p_j - log q_j) + (1 - A) CE(z, label)
(A = --distill-alpha, T = --distill-temperature, K = --distill-topk; CE the usual next-token loss with the run's
label smoothing and z-loss), averaged over the trained tokens of the step as SFT's loss is. l_j / T renormalized
is the teacher's softmax(z_t / T) restricted to its top K (the log-sum-exp cancels), so log-probabilities stored
at T = 1 (a cache) serve every T.

Under TP the vocabulary is split: the teacher's top K is each rank's own top K all-gathered (2K numbers per token
and rank) and the student's log q at K ids one all-reduce of K numbers per token (tpzoo.parallel.vocab_topk):
never a vocabulary row. The student's last stage computes its logits shard (the whole sequence under SP; not the
fused head, whose loss needs only the label); the teacher runs first, forward only through the executor over the
same micro-batches at the student's layout (tpzoo.post.reference.frozen_model, resharded from whatever layout it
was saved at), keeping [b, s, K] ids and log-probabilities per micro-batch on the last stage; or they come with the
batches from a cache written by `tpzoo distill-cache` (tpzoo.post.teacher_cache), and the teacher never loads.
A mixture of experts' router losses are not added (as in DPO).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from tpzoo import kernels
from tpzoo.data import IGNORE_INDEX
from tpzoo.errors import ConfigError
from tpzoo.parallel.vocab_topk import vocab_parallel_log_softmax_at, vocab_parallel_topk
from tpzoo.pipeline import execute

from .objective import Objective, Totals, side_pass, unlabelled_step

METRICS = ("distill/kl", "distill/ce")


def sparse_kl(teacher_logprobs: torch.Tensor, student_logq: torch.Tensor, temperature: float) -> torch.Tensor:
    """KL(teacher || student) over the teacher's top K per position [...]: teacher_logprobs [..., K] (at T = 1,
    renormalized here at `temperature`), student_logq [..., K] (log softmax(z / T) at the same ids)."""
    log_p = F.log_softmax(teacher_logprobs.to(student_logq.dtype) / temperature, dim=-1)
    return (log_p.exp() * (log_p - student_logq)).sum(-1)


def _head(chunks):
    """The last stage's head (vocabulary and TP group), or None on the other pipeline ranks."""
    last = next((c for c in chunks if c.post_process), None)
    return None if last is None else last.lm_head


class StudentLast:
    """Last stage of the student's pass: the per-token distillation loss from its logits shard and the teacher's
    top K (`teacher(microbatch, batch)` -> (ids, log-probabilities) [b, s, K])."""

    def __init__(self, head, teacher, cfg, scale: float | None, device):
        self.head, self.teacher, self.scale = head, teacher, scale
        self.k, self.t, self.alpha = cfg.distill_topk, cfg.distill_temperature, cfg.distill_alpha
        self.label_smoothing, self.z_loss = cfg.label_smoothing, cfg.z_loss
        self.totals = Totals(3, device)

    def __call__(self, mb, logits, batch):
        group, vocab = self.head.dims.tp_group, self.head.vocab_size
        labels = batch["labels"].to(logits.device)
        ids, logprobs = self.teacher(mb, batch)
        ids, logprobs = ids[..., :self.k].to(logits.device), logprobs[..., :self.k].to(logits.device)
        trained = labels != IGNORE_INDEX
        logq = vocab_parallel_log_softmax_at(logits, ids, self.t, vocab, group)
        kl = sparse_kl(logprobs, logq, self.t).masked_fill(~trained, 0.0)
        ce = kernels.cross_entropy(logits, labels, label_smoothing=self.label_smoothing, vocab_size=vocab,
                                   group=group, z_loss=self.z_loss)
        per_token = self.alpha * self.t ** 2 * kl + (1 - self.alpha) * ce
        self.totals.add([per_token.detach().sum(), kl.detach().sum(), ce.detach().sum()])
        return None if self.scale is None else per_token.sum() * self.scale


def distill_pass(chunks, batches: list[dict], dims, cfg, teacher, *, scale: float | None = None) -> list[float]:
    """The student's pass (forward and backward with `scale`): [loss sum, KL sum, CE sum] over this rank's trained
    tokens, the same on every pipeline rank. `teacher(microbatch, batch)` gives the teacher's top K."""
    last = StudentLast(_head(chunks), teacher, cfg, scale, chunks[0].device)
    execute(chunks, batches, dims, unlabelled_step(None, last), schedule=cfg.schedule, forward_only=scale is None)
    return last.totals.shared(dims)


class LiveTeacher:
    """The teacher's top K of each micro-batch, from a forward-only pass of the frozen teacher."""

    def __init__(self, chunks, dims, k: int):
        self.chunks, self.dims, self.k = chunks, dims, k
        self.head = _head(chunks)
        self.kept: list = []

    def run(self, batches: list[dict]) -> None:
        kept: list = [None] * len(batches)

        def last(mb, logits, batch):
            kept[mb] = vocab_parallel_topk(logits, self.k, self.head.vocab_size, self.head.dims.tp_group)

        side_pass(self.chunks, batches, self.dims, last, labels=False)
        self.kept = kept

    def __call__(self, mb, batch):
        return self.kept[mb]


def cached_teacher(mb, batch):
    """The teacher's top K carried by the batch (tpzoo.post.teacher_cache)."""
    return batch["teacher_ids"], batch["teacher_logprobs"]


class DistillObjective(Objective):
    """`--objective distill --teacher CKPT_OR_HF_DIR_OR_CACHE`; the held-out loss stays the next-token loss."""
    name = "distill"
    metrics = METRICS

    def __init__(self, cfg):
        super().__init__(cfg)
        self.teacher = None
        self.cache = None

    def datasets(self, cfg, tokenizer):
        from .teacher_cache import TeacherCache, cached_sft_datasets, is_teacher_cache

        if not is_teacher_cache(cfg.teacher):
            return None
        self.cache = TeacherCache(cfg.teacher)
        return cached_sft_datasets(cfg, tokenizer, self.cache)

    def setup(self, trainer) -> None:
        from .reference import frozen_model

        if self.cache is not None:
            self.cache.check(trainer.model_cfg.vocab_size, self.cfg.distill_topk)
            return
        chunks = frozen_model(self.cfg.teacher, trainer.dims, self.cfg)
        vocab = chunks[0].cfg.vocab_size
        if vocab != trainer.model_cfg.vocab_size:
            raise ConfigError(f"--teacher {self.cfg.teacher} has a vocabulary of {vocab}, the student "
                              f"{trainer.model_cfg.vocab_size}: distillation needs the student's tokenizer")
        self.teacher = LiveTeacher(chunks, trainer.dims, self.cfg.distill_topk)

    def describe(self) -> str:
        c = self.cfg
        where = f"cache {c.teacher}" if self.cache is not None else f"teacher {c.teacher}"
        return (f"objective distill (top {c.distill_topk}, T {c.distill_temperature:g}, alpha {c.distill_alpha:g}) | "
                f"{where}")

    def forward_backward(self, trainer, batches: list[dict], scale: float) -> dict:
        if self.teacher is not None:
            self.teacher.run(batches)
        totals = distill_pass(trainer.chunks, batches, trainer.dims, self.cfg,
                              self.teacher if self.teacher is not None else cached_teacher, scale=scale)
        if self.teacher is not None:
            self.teacher.kept = []
        return {"loss_sum": totals[0], "metrics": dict(zip(METRICS, totals[1:]))}

    def close(self) -> None:
        self.teacher = None
