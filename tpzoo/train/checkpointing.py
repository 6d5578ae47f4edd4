"""Training checkpoints: the sharded model format (tpzoo.checkpoint) plus everything needed to continue exactly.

    SAVE/step_00000040/
      manifest.json, model-tpXX-ppYY.safetensors   the model, in tpzoo's sharded format (convert, reshard, load)
      tokenizer files                               so the checkpoint alone can be decoded / exported
      optim/exp_avg/, optim/exp_avg_sq/             AdamW moments (fp32), each parameter-shaped state stored as a
      optim/master/ (bf16 runs: fp32 master)        model-format checkpoint: it reshards on load exactly like the
                                                    weights, so a run resumes at any (tp, pp, dp, ZeRO-1)
      rng/rank-NNNNN.json                           each rank's torch / numpy / python RNG states
      train_state.json                              step, config, data-loader position, layout, skip counter
    SAVE/latest                                     name of the newest complete checkpoint

No pickle anywhere: tensors are safetensors, everything else JSON. A checkpoint is written into a temporary
sibling directory and renamed into place only when every rank has finished (tpzoo.checkpoint.atomic_dir), so a
crash mid-save leaves the previous checkpoints intact; `latest` is replaced atomically after the rename; older
checkpoints beyond --keep-last are deleted only then.
"""
from __future__ import annotations

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

from tpzoo.checkpoint.format import CheckpointError, atomic_dir, is_checkpoint, read_manifest

STATE_FILE = "train_state.json"
LATEST_FILE = "latest"
FORMAT = "tpzoo-train-state"
STEP_DIR = re.compile(r"^step_(\d+)$")
KILL_ENV = "TPZOO_TEST_KILL_DURING_SAVE"  # testing aid: SIGKILL this process midway through its N-th save

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


def resolve_resume(cfg) -> Path | None:
    """The checkpoint to resume from: --resume latest -> newest under --save (None: none yet, start fresh);
    --resume DIR -> DIR itself, or the newest checkpoint inside it."""
    if not cfg.resume:
        return None
    if cfg.resume == "latest":
        return latest_checkpoint(cfg.save) if cfg.save else None
    p = Path(cfg.resume)
    if is_train_checkpoint(p):
        return p
    inner = latest_checkpoint(p) if p.is_dir() else None
    if inner is None:
        raise FileNotFoundError(f"--resume {cfg.resume}: not a training checkpoint (no {STATE_FILE}) and no "
                                f"checkpoint under it")
    return inner


def remove_stale_temp_dirs(save_dir) -> None:
    """Temporary directories left by a save that crashed (their names start with '.step_')."""
    d = Path(save_dir)
    if d.is_dir():
        for p in d.iterdir():
            if p.name.startswith(".step_") and ".tmp-" in p.name and p.is_dir():
                shutil.rmtree(p, ignore_errors=True)


# -- model config, tokenizer, weights -------------------------------------------------------------------------------

def read_train_state(path) -> dict:
    state = json.loads((Path(path) / STATE_FILE).read_text())
    if state.get("format") != FORMAT:
        raise CheckpointError(f"{path}/{STATE_FILE}: not a tpzoo training state")
    return state


def model_config_of(path):
    """The ModelConfig of a tpzoo checkpoint or a Hugging Face model directory."""
    from tpzoo.models import ModelConfig, from_hf_config

    if is_checkpoint(path):
        return ModelConfig.from_dict(read_manifest(path)["model_config"])
    return from_hf_config(path)


def resolve_model_config(cfg, tokenizer):
    """--base's config, else the named config with the vocabulary set to the tokenizer's (unless --vocab-size)."""
    from tpzoo.models import get_config

    if cfg.base:
        return model_config_of(cfg.base)
    model_cfg = get_config(cfg.model)
    return model_cfg.replace(vocab_size=cfg.vocab_size or tokenizer.vocab_size)


def load_tokenizer_of(path):
    from tpzoo.data import load_tokenizer

    return load_tokenizer(path)


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


def _maybe_die_for_test(stage: str) -> None:
    target = os.environ.get(KILL_ENV)
    if target and int(target) == _saves_in_this_process and stage == "model-written":
        os.kill(os.getpid(), signal.SIGKILL)


def save_checkpoint(trainer, step: int) -> str:
    """Write SAVE/step_NNNNNNNN atomically (collective: every rank calls it); returns its path."""
    global _saves_in_this_process
    from tpzoo.checkpoint import save_model_shards

    _saves_in_this_process += 1
    cfg, opt = trainer.cfg, trainer.optimizer
    save_dir = Path(cfg.save)
    final = save_dir / f"step_{step:08d}"
    with atomic_dir(final, force=True) as tmp:
        save_model_shards(trainer.chunks, tmp, trainer.model_cfg, tokenizer=trainer.tokenizer)
        _maybe_die_for_test("model-written")
        for kind in opt.state_kinds():  # one state at a time: at most one model-sized gathered copy in memory
            full = opt.full_state(kind)  # all-gather over dp under ZeRO-1 (every rank, same order)
            (tmp / "optim" / kind).mkdir(parents=True, exist_ok=True)
            with opt.params_viewing(full):
                save_model_shards(trainer.chunks, tmp / "optim" / kind, trainer.model_cfg)
            del full
        (tmp / "rng").mkdir(exist_ok=True)
        (tmp / "rng" / f"rank-{trainer.rank:05d}.json").write_text(json.dumps(_rng_state(trainer.device)))
        if trainer.rank == 0:
            s = trainer.dims
            state = {"format": FORMAT, "version": 1, "step": step, "optimizer_steps": opt.step_count,
                     "consecutive_skips": trainer.skips, "loader": trainer.loader.state_dict(),
                     "loss_scaler": trainer.scaler.state_dict() if trainer.scaler else None,
                     "layout": {"tp": s.tp, "pp": s.pp, "dp": s.dp, "virtual_stages": cfg.virtual_stages,
                                "zero1": cfg.zero1, "dtype": cfg.dtype},
                     "world_size": s.world_size, "optimizer_state": opt.state_kinds(),
                     "config": cfg.to_dict(), "model_config": trainer.model_cfg.to_dict()}
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

    for kind in opt.state_kinds():
        d = Path(path) / "optim" / kind
        if not d.is_dir():
            if kind == "master":
                opt.sync_master_from_params()
                continue
            raise FileNotFoundError(f"checkpoint {path} has no optimizer state {kind} ({d})")
        full = torch.zeros(opt.padded, dtype=torch.float32, device=opt.device)
        with opt.params_viewing(full):
            load_weights_into(chunks, d)
        opt.load_full_state(kind, full)
    opt.step_count = int(state["optimizer_steps"])
