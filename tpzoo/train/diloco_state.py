"""DiLoCo in checkpoints: every replica's own weights and AdamW state, the outer optimizer's state and each
fragment's phase, saved and resumed exactly (also mid-interval), at another layout too.

Between syncs the replicas hold different weights and moments, so a DiLoCo checkpoint (sync_every > 1 with
replicas) holds each replica's:

    step_N/                          replica 0's weights and optimizer state, as any training checkpoint (so
                                     convert, eval, generate and --base read it as a model)
    step_N/replicas/r01/             replica 1's weights, and its optim/exp_avg, optim/exp_avg_sq (, optim/master)
    step_N/diloco/global/            the global parameters (fp32) the outer optimizer holds
    step_N/diloco/velocity/          its Nesterov momentum buffer (fp32)
    step_N/diloco/ready/             the mean outer gradients received and not yet applied (an exchange in flight
                                     when the checkpoint was taken: waited for first), fragments listed in
                                     train_state.json

Each is a model-format directory over the trained parameters, written through `params_viewing` like the AdamW
moments (tpzoo.train.checkpointing), so it reshards on load: a run resumes at another tp, pp, cp, dp per replica
or ZeRO level with everything kept. train_state.json's "diloco" entry records the number of replicas and the
schedule (sync_every, sync_fragments, sync_overlap), which a resumed run must keep (one line otherwise); the
outer learning rate, momentum and the sync dtype may change. A synchronous run's replicas are identical: its
checkpoints are ordinary ones and resume at any number of replicas.
"""
from __future__ import annotations

from pathlib import Path

import torch

from tpzoo.checkpoint import load_weights_into, save_model_shards
from tpzoo.checkpoint.lora_io import is_lora_param, lora_info
from tpzoo.errors import ConfigError

from .diloco import diloco

OUTER_STATES = ("global", "velocity", "ready")


def _replica_dir(r: int) -> str:
    return f"replicas/r{r:02d}"


def own_checkpoint(resume_dir, train_state: dict | None, cfg, dims):
    """The directory this rank's replica resumes its weights and optimizer state from (replica 0 and ordinary
    checkpoints: the checkpoint itself); ConfigError when the run does not keep a DiLoCo checkpoint's replicas and
    schedule."""
    if resume_dir is None or not (train_state or {}).get("diloco"):
        return resume_dir
    saved = train_state["diloco"]
    now = {"replicas": dims.replicas, "sync_every": cfg.sync_every, "sync_fragments": cfg.sync_fragments,
           "sync_overlap": cfg.sync_overlap}
    changed = {k: (saved[k], v) for k, v in now.items() if saved[k] != v}
    if changed:
        what = ", ".join(f"{k} {a} (now {b})" for k, (a, b) in changed.items())
        raise ConfigError(f"{resume_dir} is a DiLoCo checkpoint taken with {what}: its replicas hold their own "
                          f"weights between syncs; resume with the same replicas and schedule")
    return Path(resume_dir) / _replica_dir(dims.replica) if dims.replica else resume_dir


def _full(sync, state: list) -> torch.Tensor:
    """A list of owned vectors (one per optimizer part) as the flat layout the checkpoint writer views."""
    return torch.cat([part.full_of(v) for part, v in zip(sync.parts, state)])


def save(trainer, tmp: Path, lora: dict) -> dict | None:
    """Write what a DiLoCo run adds into the checkpoint being written at `tmp` (collective); returns the train
    state's "diloco" entry (None: nothing to add)."""
    sync = getattr(trainer, "replica_sync", None)
    if sync is None or not diloco(trainer.cfg):
        return None
    sync.settle()
    cfg, dims, opt, chunks = trainer.cfg, trainer.dims, trainer.optimizer, trainer.chunks
    per = dims.dp // dims.replicas
    dirs = []
    if dims.replicas > 1:  # replica 0's are the checkpoint's own weights and optimizer state
        subs = [_replica_dir(r) for r in range(1, dims.replicas)]
        with opt.weights_readable():
            for r, sub in enumerate(subs, 1):
                (tmp / sub).mkdir(parents=True, exist_ok=True)
                save_model_shards(chunks, tmp / sub, trainer.model_cfg, dp_writer=r * per, **lora)
        for kind in opt.state_kinds():
            full = opt.full_state(kind)
            with opt.params_viewing(full):
                for r, sub in enumerate(subs, 1):
                    (tmp / sub / "optim" / kind).mkdir(parents=True, exist_ok=True)
                    save_model_shards(chunks, tmp / sub / "optim" / kind, trainer.model_cfg, dp_writer=r * per,
                                      **lora)
        dirs += subs + [f"{sub}/optim/{kind}" for sub in subs for kind in opt.state_kinds()]
    ready = sorted(sync.ready)
    for kind in OUTER_STATES:
        if kind == "ready" and not ready:
            continue
        state = sync.global_ if kind == "global" else sync.velocity if kind == "velocity" else _ready_vectors(sync)
        full = _full(sync, state)
        (tmp / "diloco" / kind).mkdir(parents=True, exist_ok=True)
        with opt.params_viewing(full):
            save_model_shards(chunks, tmp / "diloco" / kind, trainer.model_cfg, **lora)  # replica 0 writes
        dirs.append(f"diloco/{kind}")
    return {"replicas": dims.replicas, "sync_every": cfg.sync_every, "sync_fragments": cfg.sync_fragments,
            "sync_overlap": cfg.sync_overlap, "ready": ready, "dirs": dirs, "syncs": sync.syncs}


def _ready_vectors(sync) -> list:
    """The received means as owned vectors (zero outside their fragments)."""
    out = [torch.zeros_like(g) for g in sync.global_]
    for f in sync.fragments:
        if f.index in sync.ready and f.runs:
            pieces = torch.split(sync.ready[f.index], [b - a for _, a, b, _ in f.runs])
            for (i, a, b, _), piece in zip(f.runs, pieces):
                out[i][a:b] = piece
    return out


def load(sync, resume_dir, train_state: dict, chunks) -> None:
    """A DiLoCo checkpoint's outer state into `sync` (resharded to this layout); nothing for other checkpoints,
    where every replica starts from the checkpoint's weights as the global parameters."""
    entry = train_state.get("diloco")
    if sync is None or not entry or not sync.fragments:
        return
    select = is_lora_param if lora_info(resume_dir) else None
    opt = sync.optimizer
    for kind in OUTER_STATES:
        if kind == "ready" and not entry["ready"]:
            continue
        full = torch.zeros(opt.padded, dtype=torch.float32, device=opt.device)
        with opt.params_viewing(full):
            load_weights_into(chunks, Path(resume_dir) / "diloco" / kind, select=select)
        owned, at = [], 0
        for part in sync.parts:
            owned.append(part.owned_of(full[at:at + part.padded]))
            at += part.padded
        if kind == "ready":
            for f in sync.fragments:
                if f.index in entry["ready"]:
                    pieces = [owned[i][a:b] for i, a, b, _ in f.runs]
                    sync.ready[f.index] = torch.cat(pieces) if pieces else torch.zeros(0, device=opt.device)
        else:
            for dst, src in zip(sync.global_ if kind == "global" else sync.velocity, owned):
                dst.copy_(src)
    sync.syncs = int(entry.get("syncs", 0))
