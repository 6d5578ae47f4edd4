"""Training checkpoints: the sharded model format (tpzoo.checkpoint) plus everything needed to continue exactly.

    SAVE/step_00000040/
      manifest.json, model-tpXX-ppYY.safetensors   the model, in tpzoo's sharded format (convert, reshard, load)
      tokenizer files                               so the checkpoint alone can be decoded / exported
      optim/exp_avg/, optim/exp_avg_sq/             AdamW moments (fp32), each parameter-shaped state stored as a
      optim/master/ (bf16 runs: fp32 master)        model-format checkpoint: it reshards on load exactly like the
                                                    weights, so a run resumes at any (tp, pp, dp, ZeRO-1)
      replicas/, diloco/                            DiLoCo runs: the other replicas, the outer optimizer
                                                    (tpzoo.train.diloco_state)
      rng/rank-NNNNN.json                           each rank's torch / numpy / python RNG states
      train_state.json                              step, config, data-loader position, layout, skip counter
    SAVE/latest                                     name of the newest complete checkpoint

No pickle anywhere: tensors are safetensors, everything else JSON. A checkpoint is written into a temporary
sibling directory and renamed into place only when every rank has finished (atomic_dir's protocol), so a crash
mid-save leaves the previous checkpoints intact; `latest` is replaced atomically after the rename; older
checkpoints beyond --keep-last are deleted only then. The temporary directory records its writer (rank 0's pid
and host, tpzoo.checkpoint.atomic), so a starting run deletes only the temporary directories whose writer is
gone, never one that a live run writes.

Resuming (`--resume auto`) takes the newest checkpoint that passes the header checks (checkpoint_problem: the
train state parses, the manifests and shard headers of the weights and of every optimizer state agree); each
one skipped is reported with its reason.
"""
from __future__ import annotations

import errno
import json
import os
import random
import re
import shutil
import signal
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from tpzoo.checkpoint.atomic import temp_dirs, writer_gone
from tpzoo.checkpoint.format import CheckpointError, atomic_dir, is_checkpoint
from tpzoo.checkpoint.lora_io import is_lora_param, lora_info
from tpzoo.errors import ConfigError

from . import diloco_state, rundir

STATE_FILE = "train_state.json"
LATEST_FILE = "latest"
FORMAT = "tpzoo-train-state"
STEP_DIR = re.compile(r"^step_(\d+)$")
KILL_ENV = "TPZOO_TEST_KILL_DURING_SAVE"  # testing aid: SIGKILL this process midway through its N-th save
FULL_DISK_ENV = "TPZOO_TEST_FULL_DISK_DURING_SAVE"  # testing aid: ENOSPC midway through the N-th save

_saves_in_this_process = 0


# -- finding checkpoints -----------------------------------------------------------------------------------------

def is_train_checkpoint(path) -> bool:
    return (Path(path) / STATE_FILE).is_file()


def list_checkpoints(save_dir) -> list[Path]:
    """Complete training checkpoints under save_dir, oldest first (temporary directories are never listed)."""
    d = Path(save_dir)
    if not d.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in d.iterdir() if (m := STEP_DIR.match(p.name)) and is_train_checkpoint(p)]
    return [p for _, p in sorted(found)]


def latest_checkpoint(save_dir) -> Path | None:
    d = Path(save_dir)
    pointer = d / LATEST_FILE
    if pointer.is_file():
        p = d / pointer.read_text().strip()
        if is_train_checkpoint(p):
            return p
    found = list_checkpoints(d)
    return found[-1] if found else None


def _newest_first(save_dir) -> list[Path]:
    """Every step_N directory under save_dir (complete or damaged), newest first: the one `latest` names (the
    most recent save, even when a resumed run went back to an earlier step), then by step, descending."""
    d = Path(save_dir)
    if not d.is_dir():
        return []
    found = sorted(((int(m.group(1)), p) for p in d.iterdir() if (m := STEP_DIR.match(p.name)) and p.is_dir()),
                   reverse=True)
    order = [p for _, p in found]
    pointer = d / LATEST_FILE
    try:
        named = d / pointer.read_text().strip() if pointer.is_file() else None
    except (OSError, UnicodeDecodeError):
        named = None
    if named in order:
        order.remove(named)
        order.insert(0, named)
    return order


def _check_model_dir(path: Path) -> None:
    """The header checks of one model-format directory (the weights, or one optimizer state): what opening it
    checks (tpzoo.checkpoint.structure: the manifest, every shard file's size and header, the listed auxiliary
    files; no checksum, which would read every byte). Raises CheckpointError / OSError naming the file."""
    from tpzoo.checkpoint import open_source

    if not is_checkpoint(path):
        raise CheckpointError(f"{path} has no manifest.json")
    open_source(path, verify=False).close()


def checkpoint_problem(path) -> str | None:
    """Why a training checkpoint cannot be resumed from (one line naming the file), or None when it passes the
    header checks: train_state.json parses, the weights and every optimizer state it lists check out."""
    from tpzoo.errors import message

    path = Path(path)
    try:
        state = read_train_state(path)
        for key in ("step", "optimizer_steps", "loader", "optimizer_state"):
            if key not in state:
                raise CheckpointError(f"{path / STATE_FILE} has no {key!r}")
        _check_model_dir(path)
        for kind in state["optimizer_state"]:
            _check_model_dir(path / "optim" / str(kind))
        for sub in (state.get("diloco") or {}).get("dirs", []):  # other replicas, the outer state (diloco_state)
            _check_model_dir(path / str(sub))
    except (CheckpointError, OSError, ValueError, KeyError, TypeError) as e:
        return message(e)
    return None


def newest_intact_checkpoint(save_dir, say=rundir.warn) -> Path | None:
    """The newest checkpoint under save_dir that passes checkpoint_problem; each one skipped is reported through
    `say` with its reason. None when there is none at all; CheckpointError when there are some but every one is
    damaged."""
    candidates = _newest_first(save_dir)
    first = None
    for p in candidates:
        problem = checkpoint_problem(p)
        if problem is None:
            return p
        first = first or (p, problem)
        say(f"--resume: skipping {p}: {problem}")
    if first is None:
        return None
    raise CheckpointError(f"--resume: no intact checkpoint under {save_dir}: all {len(candidates)} are damaged "
                          f"(the newest, {first[0].name}: {first[1]})")


def resolve_resume(cfg, say=rundir.warn) -> Path | None:
    """The checkpoint to resume from: --resume auto (or its aliases 'latest' and the bare flag) -> the newest
    intact one under --save (None: none yet, start fresh); --resume DIR -> DIR itself when it is a checkpoint
    (refused with the reason when damaged), or the newest intact one inside it. Skipped ones go to `say`."""
    if not cfg.resume:
        return None
    if cfg.resume in rundir.RESUME_NEWEST:
        return newest_intact_checkpoint(cfg.save, say) if cfg.save else None
    p = Path(cfg.resume)
    if is_train_checkpoint(p):
        problem = checkpoint_problem(p)
        if problem:
            raise CheckpointError(f"--resume {cfg.resume}: {problem}")
        return p
    inner = newest_intact_checkpoint(p, say) if p.is_dir() else None
    if inner is None:
        raise FileNotFoundError(f"--resume {cfg.resume}: not a training checkpoint (no {STATE_FILE}) and no "
                                f"checkpoint under it")
    return inner


def remove_stale_temp_dirs(save_dir) -> list[Path]:
    """Delete the temporary directories of saves whose writer is gone (crashed, killed: this host, and its pid no
    longer runs). Any other (a live writer, another host, an unknown one) is left in place with a warning.
    Returns those deleted."""
    removed = []
    for p, owner in temp_dirs(save_dir, ".step_"):
        if writer_gone(owner):
            shutil.rmtree(p, ignore_errors=True)
            removed.append(p)
        elif owner is None:
            rundir.warn(f"left {p} in place: a temporary save directory whose writer is unknown; delete it if no "
                        f"run is writing it")
        else:
            rundir.warn(f"left {p} in place: a save in progress by pid {owner['pid']} on host {owner['host']}")
    return removed


# -- what a resumed run must keep -----------------------------------------------------------------------------------

# The settings that define a run's stream of training sequences: the loader position a checkpoint keeps counts
# sequences of this data, cut this way, in this order, this many per step. Everything else may change on resume:
# the layout (tp, cp, pp, dp, ep, ZeRO, schedule), the micro-batch size, --steps, the optimizer's settings (not the
# optimizer itself: its state is AdamW's or Muon's, check_resumable), logging and saving.
RESUME_KEEPS = ("task", "data", "text_field", "seq_len", "eval_fraction", "seed", "global_batch_size")
RESUME_KEEPS_SFT = ("packing", "template", "objective")  # fine-tuning: how the records become sequences


def _same_data(a: list, b: list) -> bool:
    def norm(specs):
        return [os.path.abspath(s) if os.path.exists(s) else s for s in specs]
    return norm(a) == norm(b)


def check_resumable(cfg, state: dict, path) -> None:
    """The run being resumed from `path` (its train_state.json `state`) keeps its --model (a run without --base) and
    every RESUME_KEEPS setting of `cfg`; else one line naming each one that changed with both values, and what may
    change instead."""
    saved = {k: v for section in (state.get("config") or {}).values() if isinstance(section, dict)
             for k, v in section.items()}
    if not (cfg.base or saved.get("base")) and saved.get("model") not in (None, cfg.model):
        raise ConfigError(f"cannot resume from {path} with --model {cfg.model}: that run trains {saved['model']} "
                          f"(resume with --model {saved['model']}, or start the new model in another --save "
                          f"directory)")
    keys = RESUME_KEEPS + (RESUME_KEEPS_SFT if cfg.task == "sft" else ())
    changed = []
    for key in keys:
        if key not in saved:
            continue  # a checkpoint from before the field existed
        then, now = saved[key], getattr(cfg, key)
        if then != now and not (key == "data" and _same_data(then, now)):
            changed.append(f"{key} {now!r} (the checkpoint's run: {then!r})")
    then = saved.get("optimizer", "adamw")  # a checkpoint from before --optimizer: AdamW's
    if then != cfg.optimizer:
        raise ConfigError(f"cannot resume from {path} with --optimizer {cfg.optimizer}: its optimizer state is "
                          f"{then}'s; start a new run from its weights (--base {path}) in another --save directory")
    if changed:
        raise ConfigError(f"cannot resume from {path} with {'; '.join(changed)}: a resumed run keeps "
                          f"{', '.join(keys)} (its data position counts those sequences); the layout, micro-batch "
                          f"size, steps, optimizer and logging settings may change. To change them, start a new run "
                          f"from its weights (--base {path}) in another --save directory")


# -- the train state, the weights ------------------------------------------------------------------------------------

def read_train_state(path) -> dict:
    f = Path(path) / STATE_FILE
    if not f.is_file():
        raise CheckpointError(f"{path}: no {STATE_FILE}")
    try:
        state = json.loads(f.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{f}: corrupt ({e})") from None
    if not isinstance(state, dict) or state.get("format") != FORMAT:
        raise CheckpointError(f"{f}: not a tpzoo training state")
    return state


def load_weights(chunks, path) -> None:
    """This rank's part of the weights from a tpzoo checkpoint (any layout) or a Hugging Face directory."""
    from tpzoo.checkpoint import load_weights_into

    load_weights_into(chunks, str(path))


# -- saving ------------------------------------------------------------------------------------------------------------

def _rng_state(device: torch.device) -> dict:
    np_state = np.random.get_state()
    py = random.getstate()
    out = {"torch": torch.get_rng_state().tolist(),
           "numpy": {"key": np_state[1].tolist(), "pos": int(np_state[2]), "has_gauss": int(np_state[3]),
                     "gauss": float(np_state[4])},
           "python": {"version": py[0], "state": list(py[1]), "gauss": py[2]}}
    if device.type == "cuda":  # this rank's GPU generator (dropout, sampling on the device)
        out["cuda"] = torch.cuda.get_rng_state(device).tolist()
    return out


def load_rng(path, rank: int, world_size: int, device: torch.device) -> None:
    """Restore this rank's RNG states, CPU and its device's (only when the world size is the one saved: ranks
    must correspond)."""
    f = Path(path) / "rng" / f"rank-{rank:05d}.json"
    state = read_train_state(path)
    if not f.is_file() or state.get("world_size") != world_size:
        return
    s = json.loads(f.read_text())
    torch.set_rng_state(torch.tensor(s["torch"], dtype=torch.uint8, device="cpu"))
    n = s["numpy"]
    np.random.set_state(("MT19937", np.array(n["key"], dtype=np.uint32), n["pos"], n["has_gauss"], n["gauss"]))
    py = s["python"]
    random.setstate((py["version"], tuple(py["state"]), py["gauss"]))
    if "cuda" in s and device.type == "cuda" and s["cuda"] and not isinstance(s["cuda"][0], list):
        torch.cuda.set_rng_state(torch.tensor(s["cuda"], dtype=torch.uint8, device="cpu"), device)


def _maybe_die_for_test(stage: str, where: Path) -> None:
    if stage != "model-written":
        return
    if os.environ.get(KILL_ENV) and int(os.environ[KILL_ENV]) == _saves_in_this_process:
        os.kill(os.getpid(), signal.SIGKILL)
    if os.environ.get(FULL_DISK_ENV) and int(os.environ[FULL_DISK_ENV]) == _saves_in_this_process:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(where))


def save_checkpoint(trainer, step: int) -> str:
    """Write SAVE/step_NNNNNNNN atomically (collective: every rank calls it); returns its path."""
    global _saves_in_this_process
    from tpzoo.checkpoint import save_model_shards

    _saves_in_this_process += 1
    cfg, opt = trainer.cfg, trainer.optimizer
    save_dir = Path(cfg.save)
    final = save_dir / f"step_{step:08d}"
    # A LoRA run saves its adapters only (and their optimizer state), naming the frozen base it trains on.
    lora = {"select": is_lora_param, "metadata": trainer.lora_meta} if trainer.lora else {}
    with atomic_dir(final, force=True) as tmp:
        with opt.weights_readable():  # ZeRO-3: the weights all-gathered from the dp shards while written
            save_model_shards(trainer.chunks, tmp, trainer.model_cfg, tokenizer=trainer.tokenizer, **lora)
        _maybe_die_for_test("model-written", tmp)
        for kind in opt.state_kinds():  # one state at a time: at most one model-sized gathered copy in memory
            full = opt.full_state(kind)  # all-gather over dp under ZeRO-1 (every rank, same order)
            (tmp / "optim" / kind).mkdir(parents=True, exist_ok=True)
            with opt.params_viewing(full):
                save_model_shards(trainer.chunks, tmp / "optim" / kind, trainer.model_cfg, **lora)
            del full
        outer = diloco_state.save(trainer, tmp, lora)  # DiLoCo: the other replicas and the outer optimizer
        trainer.objective.save(trainer, tmp)  # DPO's precomputed reference (tpzoo.post)
        (tmp / "rng").mkdir(exist_ok=True)
        (tmp / "rng" / f"rank-{trainer.rank:05d}.json").write_text(json.dumps(_rng_state(trainer.device)))
        if trainer.rank == 0:
            s = trainer.dims
            state = {"format": FORMAT, "version": 1, "step": step, "optimizer_steps": opt.step_count,
                     "consecutive_skips": trainer.skips, "loader": trainer.loader.state_dict(),
                     "loss_scaler": trainer.scaler.state_dict() if trainer.scaler else None,
                     "layout": {"tp": s.tp, "cp": s.cp, "pp": s.pp, "dp": s.dp, "virtual_stages": cfg.virtual_stages,
                                "zero": cfg.zero_level, "dtype": cfg.dtype},
                     "world_size": s.world_size, "optimizer_state": opt.state_kinds(),
                     "config": cfg.to_dict(), "model_config": trainer.model_cfg.to_dict()}
            if outer:
                state["diloco"] = outer
            (tmp / STATE_FILE).write_text(json.dumps(state, indent=1) + "\n")
    if trainer.rank == 0:
        pointer = save_dir / LATEST_FILE
        tmp_pointer = save_dir / f".{LATEST_FILE}.tmp"
        tmp_pointer.write_text(final.name + "\n")
        os.replace(tmp_pointer, pointer)
        if cfg.keep_last > 0:
            for old in list_checkpoints(save_dir)[:-cfg.keep_last]:
                if old.name != final.name:
                    shutil.rmtree(old, ignore_errors=True)
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()
    return str(final)


# -- optimizer state on resume --------------------------------------------------------------------------------------

def load_optimizer(opt, path, state: dict, chunks) -> None:
    """AdamW state from the checkpoint, resharded to the current layout (any tp, pp, virtual stages, dp, ZeRO-1).
    A bf16 run resumed from an fp32 one takes its master weights from the (fp32) weights."""
    from tpzoo.checkpoint import load_weights_into

    select = is_lora_param if lora_info(path) else None  # a LoRA run's state covers its adapters only
    for kind in opt.state_kinds():
        d = Path(path) / "optim" / kind
        if not d.is_dir():
            if kind == "master":
                opt.sync_master_from_params()
                continue
            raise FileNotFoundError(f"checkpoint {path} has no optimizer state {kind} ({d})")
        full = torch.zeros(opt.padded, dtype=torch.float32, device=opt.device)
        with opt.params_viewing(full):
            load_weights_into(chunks, d, select=select)
        opt.load_full_state(kind, full)
    opt.step_count = int(state["optimizer_steps"])
