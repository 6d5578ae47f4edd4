"""The training loop: `train(config) -> result`, on every rank, at any (tp, cp, pp, dp).

One optimizer step: the step's micro-batches (global batch / (micro batch * dp) per dp rank) go through the run's
objective (tpzoo.post: `tpzoo.pipeline.forward_backward` for the next-token loss; DPO, distillation) with loss scale
1 / (non-ignored tokens, DPO: pairs, of the whole global batch), so the summed gradients are those of the global
mean loss at every layout; `finalize_grads` does the TP and tied-embedding reductions, the optimizer the fp32
data-parallel reduction (all-reduce, or reduce-scatter under ZeRO-1; by default each gradient bucket starts reducing
during the backward passes and the optimizer waits for what is still in flight), the global norm, clipping and
AdamW.

Device. The trainer owns it: `init_parallel(device=cfg.device)` picks it once (cuda:LOCAL_RANK when CUDA is
available, else cpu; --device overrides), the model chunks are built on meta and materialized there (then
initialized, or filled from --base / the checkpoint being resumed), and the optimizer's buffers, the batches
(pinned host memory, non-blocking copies) and every scalar that is all-reduced live on it. A NaN/inf loss or norm skips the update (same decision on every rank: both are
global values); `max_skips` in a row stop the run without saving, so the last good checkpoint stays the newest.
"""
from __future__ import annotations

import contextlib
import datetime
import math
import random
import time

import numpy as np
import torch

import tpzoo
from tpzoo.checkpoint.lora_io import lora_metadata
from tpzoo.data import micro_batches_per_step, single_documents_dropped
from tpzoo.errors import ConfigError
from tpzoo.models import LossOptions, ModelLayout
from tpzoo.models.aux import after_optimizer_step
from tpzoo.parallel import ParallelDims, comm, resolve_device, strict, watchdog
from tpzoo.parallel.context_parallel import shard_batch
from tpzoo.parallel.fp8 import enable_fp8
from tpzoo.parallel.fp8 import hardware_problem as fp8_hardware_problem
from tpzoo.parallel.state import get_dims, is_initialized, job_world_size
from tpzoo.pipeline import build_model_chunks, finalize_grads, materialize_chunks
from tpzoo.post.objective import objective_of
from tpzoo.quant import refuse_full_training

from . import checkpointing as ckpt
from . import diloco, diloco_state, lora_setup, qk_clip
from . import rundir
from .compile import compile_blocks, compile_report, graph_breaks, recompiles
from .compile import eager as compile_eager
from .config import TrainConfig
from .data import build_datasets, data_metrics, held_out_losses, make_loader
from .generate import generate
from .heldout import heldout_batches
from .loss_scale import DynamicLossScaler
from .lr import lr_at
from .metrics import MetricsLogger, Throughput, eval_text, format_line, peak_memory_gb, window_means
from .oom import OOM_ERRORS, out_of_memory
from .optimizers import build_optimizer
from .run_model import resolve_run_model

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def train(cfg: TrainConfig) -> dict:
    """Run (or resume) a training run on this rank. Creates the tpzoo process groups unless they exist (then
    their layout must match cfg); returns the same result dict on every rank."""
    cfg.validate(get_dims().world_size if is_initialized() else job_world_size())  # the world init_parallel joins
    owns = not is_initialized()
    if owns:
        tpzoo.init_parallel(tp=cfg.tp, pp=cfg.pp, cp=cfg.cp, dp=cfg.dp or None, ep=cfg.ep, device=cfg.device,
                            timeout=datetime.timedelta(seconds=cfg.dist_timeout), replicas=cfg.replicas)
    dims = get_dims()
    try:
        if ((dims.tp, dims.pp, dims.cp, dims.ep, dims.replicas) != (cfg.tp, cfg.pp, cfg.cp, cfg.ep, cfg.replicas)
                or (cfg.dp and cfg.dp != dims.dp)):
            raise ConfigError(f"config asks for tp={cfg.tp} cp={cfg.cp} pp={cfg.pp} dp={cfg.dp or 'auto'} ep={cfg.ep} "
                             f"replicas={cfg.replicas}, but the process groups are tp={dims.tp} cp={dims.cp} "
                             f"pp={dims.pp} dp={dims.dp} ep={dims.ep} replicas={dims.replicas}")
        if cfg.device != "auto" and resolve_device(cfg.device) != dims.device:
            raise ConfigError(f"config asks for device {cfg.device}, but the parallel runtime computes on "
                             f"{dims.device}")
        trainer = Trainer(cfg, dims)
        try:
            return trainer.run()
        finally:
            trainer.close()
    finally:
        if owns:
            tpzoo.destroy_parallel()


def _seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2 ** 32)
    torch.manual_seed(seed)


class Trainer:
    def __init__(self, cfg: TrainConfig, dims: ParallelDims):
        # First of all, a run directory has one owner: rank 0 locks --save (and --log-dir), refuses a fresh run
        # into a used one, picks the checkpoint to resume; every rank learns the outcome before doing any work.
        self.run_dir = rundir.claim(cfg, dims)
        try:
            self._setup(cfg, dims)
        except BaseException:
            if getattr(self, "replica_sync", None) is not None:
                self.replica_sync.close()
            self.run_dir.release()  # the lock goes with a run that failed to start
            raise

    def _setup(self, cfg: TrainConfig, dims: ParallelDims) -> None:
        self.cfg, self.dims, self.device = cfg, dims, dims.device
        self.rank, self.world = dims.rank, dims.world_size
        self.tp_rank, self.pp_rank, self.dp_rank, self.dp = dims.tp_rank, dims.pp_rank, dims.dp_rank, dims.dp
        self.dp_group = dims.dp_group
        # dp x cp: where token counts and loss sums are summed (a DiLoCo replica's own: tpzoo.train.diloco)
        self.grad_group = diloco.loss_group(cfg, dims)
        self.is_main = self.rank == 0
        self.n_micro = micro_batches_per_step(cfg.global_batch_size, cfg.micro_batch_size, self.dp)
        _seed_everything(cfg.seed)

        # the model, its tokenizer, its LoRA and the train state resumed: the rules the preflight checked
        # (run_model.py). LoRA: the base frozen in the model dtype (it has no fp32 master), the adapters trained.
        self.run_model = run_model = resolve_run_model(cfg, resume=self.run_dir.resume_from)
        self.resume_dir, self.train_state = run_model.resume, run_model.state
        self.tokenizer, self.model_cfg = run_model.tokenizer, run_model.config
        self.lora, self.lora_base = run_model.lora, run_model.lora_base
        model_cfg = self.model_cfg
        if model_cfg.position == "learned" and cfg.seq_len > model_cfg.max_position_embeddings:
            raise ConfigError(f"seq_len {cfg.seq_len} exceeds the model's max_position_embeddings "
                             f"{model_cfg.max_position_embeddings}")

        # Built on meta, then materialized on the device: initialized there, or filled straight from the
        # checkpoint (each rank reads only its slices). In fp32, so that a bf16 run's fp32 master weights start
        # from the exact initial (or loaded) values.
        if not self.lora:  # a kept-quantized base trains adapters only (preflight says so first)
            refuse_full_training(model_cfg, f"--base {cfg.base}" if cfg.base else "the model")
        # What every LoRA checkpoint of the run records: the adapter config and the base as it was at the start
        # (fingerprinted once here, not at every save).
        self.lora_meta = lora_metadata(self.lora, self.lora_base) if self.lora else None
        # this rank's replica's own weights and optimizer state in a DiLoCo checkpoint (else the checkpoint's)
        own = diloco_state.own_checkpoint(self.resume_dir, self.train_state, cfg, dims)
        layout = ModelLayout(dims, sequence_parallel=cfg.sequence_parallel, cp_mode=cfg.cp_mode,
                             dtype=DTYPES[cfg.dtype] if self.lora else None, device="meta")
        self.chunks = build_model_chunks(model_cfg, layout, recompute=cfg.recompute, seed=cfg.seed,
                                         virtual_stages=cfg.virtual_stages, boundaries=cfg.pp_boundaries or None)
        # What the last stage computes: the training loss, and the held-out one (the language model's alone).
        self.loss = LossOptions(label_smoothing=cfg.label_smoothing, z_loss=cfg.z_loss,
                                fused=cfg.fused_linear_cross_entropy)
        self.held_out = LossOptions(aux_losses=False, fused=cfg.fused_linear_cross_entropy)
        # FP8 matmuls (tpzoo.parallel.fp8): a switch on the layers, nothing stored changes (checkpoints, resharding
        # and HF export never see it); layers whose dims _scaled_mm cannot take stay in the model dtype.
        problem = fp8_hardware_problem(cfg.fp8, self.device)
        if problem:
            raise ConfigError(problem)
        # the weights' fp8 copies are kept for the step, except under ZeRO-3 gathering each layer per use
        self.fp8_report = enable_fp8(self.chunks, cfg.fp8,
                                     cache_weights=cfg.zero_level < 3 or cfg.zero3_gather_per_step)
        if self.lora:
            lora_setup.build(self.chunks, self.device, cfg, self.lora, self.lora_base, own)
        else:
            weights_from = own or (cfg.base or None)
            materialize_chunks(self.chunks, self.device, init=not weights_from)
            if weights_from:
                ckpt.load_weights(self.chunks, weights_from)
        # Regional torch.compile (tpzoo.train.compile): each block, in place, once its weights are in place
        self.compiled_blocks = compile_blocks(self.chunks) if cfg.compile else 0
        # AdamW or Muon; expert weights under ep > 1 reduce over their own group (tpzoo.train.optimizers).
        trainable = [p for chunk in self.chunks for p in chunk.parameters() if p.requires_grad]
        self.optimizer = build_optimizer(cfg, dims, self.chunks, trainable, DTYPES[cfg.dtype])
        # MuonClip's logits (--qk-clip, --log-max-attn-logit): recorded in the step's forwards
        self.logits = qk_clip.create(cfg, dims, self.chunks)

        # What the step computes (tpzoo.post: the next-token loss, DPO, distillation) and, for some, their data
        self.objective = objective_of(cfg)
        sets = self.objective.datasets(cfg, self.tokenizer)
        self.train_ds, self.eval_ds, self.data_desc = sets or build_datasets(cfg, self.tokenizer)
        self.pin = self.device.type == "cuda"
        self.loader = make_loader(self.train_ds, cfg, self.dp_rank, self.dp, pin_memory=self.pin)
        self.start_step, self.skips = 0, 0
        # fp16: gradients would underflow without a loss scale (bf16 and fp32 have fp32's exponent range)
        self.scaler = DynamicLossScaler() if cfg.dtype == "fp16" else None
        if self.train_state is not None:
            ckpt.load_optimizer(self.optimizer, own, self.train_state, self.chunks)
            self.loader.load_state_dict(self.train_state["loader"])
            self.start_step = int(self.train_state["step"])
            self.skips = int(self.train_state.get("consecutive_skips", 0))
            if self.scaler is not None and self.train_state.get("loss_scaler"):
                self.scaler = DynamicLossScaler.from_state(self.train_state["loss_scaler"])
            ckpt.load_rng(self.resume_dir, self.rank, self.world, self.device)
        # replicas / DiLoCo: the outer optimizer and the cross-replica metrics (None without)
        self.replica_sync = diloco.ReplicaSync.create(cfg, dims, self.optimizer, self.chunks)
        if self.train_state is not None:
            diloco_state.load(self.replica_sync, self.resume_dir, self.train_state, self.chunks)
        self.objective.setup(self)  # a reference / teacher, a precomputed table: once the model and data exist
        self.eval_metrics: dict = {}

        self.log_dir = cfg.log_dir or cfg.save
        self.logger = MetricsLogger(self.is_main, self.log_dir or None, cfg.steps, self.start_step,
                                    cfg.progress and not cfg.quiet, resume=self.resume_dir is not None,
                                    quiet=cfg.quiet)
        self.throughput = Throughput(model_cfg.flops_per_token(cfg.seq_len), self.world, cfg.dtype, self.device)
        self.tokens_per_step = cfg.global_batch_size * cfg.seq_len

    # -- one step -------------------------------------------------------------------------------------------
    def _global_sum(self, values: list[float], group) -> list[float]:
        t = torch.tensor(values, dtype=torch.float64, device=self.device)  # NCCL reduces device tensors only
        comm.all_reduce(t, group)
        return t.tolist()

    def _to_device(self, batch: dict) -> dict:
        return {k: v.to(self.device, non_blocking=self.pin) for k, v in batch.items()}

    def _local(self, batch: dict) -> dict:
        """This rank's tokens of a batch (every cp rank of a dp rank loads the same sequences; cp > 1 keeps its
        two load-balanced chunks and their positions). A packed batch of one document per row drops its document
        ids: no mask to build, attention's plain causal path."""
        return shard_batch(single_documents_dropped(batch), self.dims, self.cfg.sequence_parallel)

    def train_step(self, step: int) -> dict:
        """Optimizer step number `step` (1-based)."""
        cfg = self.cfg
        t0 = time.perf_counter()
        if step in cfg.inject_oom_steps:
            raise OOM_ERRORS[0]("CUDA out of memory. Tried to allocate 2.00 GiB (injected: inject_oom_steps)")
        host = [self._local(next(self.loader)) for _ in range(self.n_micro)]
        local_count = self.objective.count(host, self.dims)  # trained tokens (DPO: pairs), on the host copy
        batches = [self._to_device(b) for b in host]
        (tokens,) = self._global_sum([local_count], self.grad_group)
        loss_scale = self.scaler.scale if self.scaler else 1.0
        scale = loss_scale / max(tokens, 1.0)
        if step in cfg.inject_nan_steps:
            scale = float("nan")
        self.optimizer.zero_grad()
        if self.logits is not None:
            self.logits.begin()
        out = self.objective.forward_backward(self, batches, scale)
        finalize_grads(self.chunks, self.dims)
        self.optimizer.reduce_grads()
        loss_sum, *sums = self._global_sum([out["loss_sum"], *out["metrics"].values()], self.grad_group)
        loss = loss_sum / max(tokens, 1.0)
        grad_norm, bad = self.optimizer.global_grad_norm(flag=0.0 if math.isfinite(loss) else 1.0)
        grad_norm /= loss_scale  # the norm of the true (unscaled) gradients
        lr = lr_at(step - 1, lr=cfg.lr, min_lr=cfg.min_lr, warmup_steps=cfg.warmup_steps, total_steps=cfg.steps)
        skipped = bad > 0 or not math.isfinite(grad_norm)
        logits = self.logits.finish(clip=not skipped) if self.logits is not None else None
        # fp16 with a finite loss: the gradients overflowed at this loss scale. Expected now and then: skip the
        # step and let the scaler back off, without counting it as divergence (until the scale cannot shrink).
        overflow = skipped and bad == 0 and self.scaler is not None and loss_scale > self.scaler.min_scale
        if overflow:
            self.scaler.update(True)
            self.logger.print(f"step {step}: fp16 gradient overflow at loss scale {loss_scale:g}: update skipped, "
                              f"scale now {self.scaler.scale:g}")
        elif skipped:
            self.skips += 1
            self.logger.print(f"WARNING: step {step}: non-finite loss ({loss:.4g}) or grad norm ({grad_norm:.4g}): "
                              f"update skipped ({self.skips} in a row; the run stops at {cfg.max_skips})")
        else:
            self.skips = 0
            clip = cfg.clip_grad / (grad_norm + 1e-6) if cfg.clip_grad > 0 and grad_norm > cfg.clip_grad else 1.0
            extra = {"clip_rows": logits.rows} if logits is not None and logits.rows else {}  # MuonClip
            self.optimizer.step(lr, clip / loss_scale, **extra)  # unscale and clip in the update's one pass
            if self.scaler:
                self.scaler.update(False)
        # non-gradient state updated from the step (a router's selection bias; dropped on a skipped step)
        after_optimizer_step(self.chunks, applied=not skipped)
        if self.replica_sync is not None:  # DiLoCo's outer step when due; sync_bytes, sync_s
            m_sync = self.replica_sync.after_step(step)
        strict.check_all_waited(f"the end of training step {step}")  # strict collective mode; else a no-op
        seconds = time.perf_counter() - t0
        self.throughput.add(self.tokens_per_step, seconds)
        m = {"step": step, "loss": loss, "grad_norm": grad_norm, "lr": lr, self.objective.unit: int(tokens),
             "step_time": seconds, "skipped": self.skips if skipped and not overflow else 0}
        m.update({k: v / max(tokens, 1.0) for k, v in zip(out["metrics"], sums)})  # DPO's rewards/..., ...
        if self.scaler:
            m["loss_scale"] = loss_scale
        if logits is not None:
            m["max_attn_logit"] = logits.max_logit
        if self.replica_sync is not None:
            m.update(m_sync)
        return m

    @torch.no_grad()
    def evaluate(self, dataset=None) -> float | None:
        """Mean loss over the held-out split's (or `dataset`'s, a mixture's source) first eval_batches x
        micro_batch_size sequences, the same at every layout (tpzoo.train.heldout; None without a held-out split):
        the language model's (a mixture of experts' router losses left out, as `tpzoo eval` does)."""
        cfg = self.cfg
        dataset = self.eval_ds if dataset is None else dataset
        if dataset is None or len(dataset) == 0:
            return None
        rank, ranks = diloco.eval_share(cfg, self.dims)  # a DiLoCo replica evaluates the whole set on its own
        batches = [self._to_device(self._local(b)) for b in
                   heldout_batches(dataset, cfg.eval_batches, cfg.micro_batch_size, rank, ranks)]
        for c in self.chunks:
            c.eval()
        out = self.objective.evaluate(self, batches)
        for c in self.chunks:
            c.train()
        loss_sum, tokens, *sums = self._global_sum([out["loss_sum"], out["count"], *out["metrics"].values()],
                                                   self.grad_group)
        strict.check_all_waited("the end of evaluation")
        # an objective's held-out metrics (DPO's eval_rewards/..., TRL's names), logged with eval_loss
        self.eval_metrics = {f"eval_{k}": v / max(tokens, 1.0) for k, v in zip(out["metrics"], sums)}
        return loss_sum / max(tokens, 1.0)

    # -- the run --------------------------------------------------------------------------------------------
    def run(self) -> dict:
        cfg = self.cfg
        s = self.dims
        self.logger.print(
            f"tpzoo {cfg.task}: {self.run_model.label} "
            f"({self.model_cfg.num_parameters() / 1e6:.2f}M params, vocab {self.model_cfg.vocab_size}) | "
            f"tp={s.tp} cp={s.cp}{'/' + cfg.cp_mode if s.cp > 1 else ''} pp={s.pp} dp={s.dp}"
            f"{f' ep={s.ep}' if s.ep > 1 else ''} sp={cfg.sequence_parallel} zero={cfg.zero_level} {cfg.dtype} on "
            f"{self.device} | "
            f"batch {cfg.global_batch_size}x{cfg.seq_len} ({self.n_micro} micro-batches of {cfg.micro_batch_size}"
            f" per dp rank) | data {self.data_desc}"
            + (f" | resumed from {self.resume_dir} at step {self.start_step}" if self.resume_dir else ""))
        if self.objective.describe():
            self.logger.print(self.objective.describe())
        if self.fp8_report.line():
            self.logger.print(self.fp8_report.line())
        if self.replica_sync is not None:
            self.logger.print(self.replica_sync.describe())
        if cfg.resume and self.resume_dir is None:
            self.logger.print(f"--resume: no checkpoint under {cfg.save!r} yet, starting at step 0")
        history: list[dict] = []
        window: list[dict] = []
        status, saved, eval_loss = "ok", None, None
        self.loader.reset_wait_stats()
        for step in range(self.start_step + 1, cfg.steps + 1):
            watchdog.note(f"step {step}")  # what a stall report says this rank was doing
            try:
                m = self.train_step(step)
            except OOM_ERRORS as e:  # one line: the step, the peak, the plan's estimate, the flags that lower it
                raise out_of_memory(e, step, cfg, self.model_cfg, self.dims) from e
            if self.compiled_blocks and step == self.start_step + 1:  # the step that compiled: said once
                self.logger.print(compile_report(self.compiled_blocks, m["step_time"]))
            window.append(m)
            m.update(self.throughput.summary(), peak_mem_gb=peak_memory_gb(self.device),
                     data_wait=self.loader.wait_fraction, **data_metrics(self.loader, cfg.seq_len))
            if step == cfg.steps or (cfg.eval_every and step % cfg.eval_every == 0):
                m.update(held_out_losses(self))  # eval_loss (None without a held-out split), a mixture's per source
                m.update(self.eval_metrics)
                eval_loss = m["eval_loss"]
            history.append(m)
            self.logger.step(m)
            if self.skips >= cfg.max_skips:
                status = "diverged"
                self.logger.print(f"step {step}: {self.skips} consecutive non-finite steps: stopping; the last good "
                                  f"checkpoint is {ckpt.latest_checkpoint(cfg.save) if cfg.save else None}")
                break
            if step % cfg.log_interval == 0 or step == cfg.steps:
                line = dict(m, **window_means(window))
                self.logger.print(format_line(line) + eval_text(m))
                window.clear()
                self.throughput.reset()
                self.loader.reset_wait_stats()
            if cfg.save and ((cfg.save_every and step % cfg.save_every == 0) or step == cfg.steps):
                saved = self.save(step)
        self.logger.close_bar()
        if status == "ok" and eval_loss is not None:
            self.logger.print(f"held-out loss: {eval_loss:.4f}")
        result = {"status": status, "start_step": self.start_step, "steps": [m["step"] for m in history],
                  "losses": [m["loss"] for m in history], "grad_norms": [m["grad_norm"] for m in history],
                  "lrs": [m["lr"] for m in history], "eval_loss": eval_loss, "checkpoint": saved,
                  "tokens_per_s": history[-1]["tokens_per_s"] if history else None, "sample": None,
                  "fp8": {"recipe": self.fp8_report.recipe, "layers": len(self.fp8_report.fp8_layers),
                          "fallbacks": [name for name, _, _ in self.fp8_report.fallbacks]},
                  "compile": {"blocks": self.compiled_blocks,
                              "graph_breaks": dict(graph_breaks()) if self.compiled_blocks else {},
                              "recompiles": dict(recompiles()) if self.compiled_blocks else {}}}
        if history:
            self.logger.print(f"loss: first {history[0]['loss']:.4f} (step {history[0]['step']}) -> last "
                              f"{history[-1]['loss']:.4f} (step {history[-1]['step']})")
        if saved:
            self.logger.print(f"checkpoint: {saved}")
        if status == "ok" and cfg.sample_prompt and cfg.sample_tokens > 0 and self.dims.cp > 1:
            self.logger.print("sample skipped: generation runs at cp=1 (tpzoo generate on the checkpoint)")
        elif status == "ok" and cfg.sample_prompt and cfg.sample_tokens > 0:
            with compile_eager() if self.compiled_blocks else contextlib.nullcontext():  # a growing KV cache
                text = generate(self.chunks, self.dims, self.tokenizer, cfg.sample_prompt, cfg.sample_tokens,
                                temperature=cfg.temperature, seed=cfg.seed, max_context=cfg.seq_len)
            result["sample"] = cfg.sample_prompt + text
            self.logger.print(f"sample ({'greedy' if cfg.temperature <= 0 else f'T={cfg.temperature}'}):\n"
                              f"{'-' * 60}\n{cfg.sample_prompt}{text}\n{'-' * 60}")
        return result

    def save(self, step: int) -> str:
        return ckpt.save_checkpoint(self, step)

    def close(self) -> None:
        try:
            if self.replica_sync is not None:
                self.replica_sync.close()
            self.objective.close()
            if self.logits is not None:
                self.logits.close()
            self.loader.close()
            self.logger.close()
        finally:
            self.run_dir.release()
