"""Where a Megatron-LM checkpoint's weights are, and in which format.

Megatron-LM's `--save DIR` holds `latest_checkpointed_iteration.txt` (an iteration number, or `release`) and one
directory per saved iteration, `iter_0000100/` (or `release/`). Inside it:
  torch_dist   metadata.json {"sharded_backend": "torch_dist", ...}, .metadata, __R_I.distcp files, and common.pt
               (Megatron-Core <= 0.18; later versions keep the common state inside the .distcp files)
  legacy       mp_rank_TT/ (pp = 1), mp_rank_TT_PPP/, with _EEE appended under expert parallelism, each holding
               model_optim_rng.pt (ckpt_format "torch")
SRC may be the save directory or one iteration directory.
"""
from __future__ import annotations

import json
import re
from pathlib import Path

from ..format import CheckpointError, refuse_temp_dir

TRACKER = "latest_checkpointed_iteration.txt"
LEGACY_FILE = "model_optim_rng.pt"
_RANK_DIR = re.compile(r"^mp_rank_(\d{2})(?:_(\d{3}))?(?:_(\d{3}))?$")


def iteration_dir_name(iteration: int | None) -> str:
    return "release" if iteration is None else f"iter_{iteration:07d}"


def _format_of(d: Path) -> str | None:
    if (d / "metadata.json").is_file():
        try:
            backend = json.loads((d / "metadata.json").read_text()).get("sharded_backend")
        except (ValueError, UnicodeDecodeError, AttributeError):
            raise CheckpointError(f"{d / 'metadata.json'}: corrupt (not a JSON object)") from None
        if backend != "torch_dist":
            raise CheckpointError(f"{d}: sharded_backend {backend!r} in metadata.json; tpzoo reads Megatron's "
                                  f"torch_dist and legacy (torch) formats")
        return "torch_dist"
    if any(_RANK_DIR.match(p.name) and (p / LEGACY_FILE).is_file() for p in d.iterdir() if p.is_dir()):
        return "legacy"
    return None


def locate(src) -> tuple[Path, str, int | None]:
    """(iteration directory, "torch_dist" | "legacy", iteration or None for a release checkpoint)."""
    root = Path(src)
    if not root.is_dir():
        raise FileNotFoundError(f"no such directory: {src}")
    refuse_temp_dir(root)
    tracker = root / TRACKER
    if tracker.is_file():
        text = tracker.read_text().strip()
        if text != "release" and not text.isdigit():
            raise CheckpointError(f"{tracker}: expected an iteration number or 'release', found {text[:40]!r}")
        iteration = None if text == "release" else int(text)
        d = root / iteration_dir_name(iteration)
        if not d.is_dir():
            raise CheckpointError(f"{tracker} names iteration {text}, but {d.name}/ is missing")
    else:
        d, m = root, re.fullmatch(r"iter_(\d+)", root.name)
        iteration = int(m.group(1)) if m else None
    fmt = _format_of(d)
    if fmt is None:
        found = sorted(p.name for p in d.iterdir() if p.is_dir() and (p.name.startswith("iter_") or p.name == "release"))
        hint = (f" (it has {', '.join(found[:3])}{' ...' if len(found) > 3 else ''} but no {TRACKER}: pass one of "
                f"them)" if found else "")
        raise CheckpointError(f"{d} is not a Megatron-LM checkpoint: no {TRACKER}, no metadata.json (torch_dist) and "
                              f"no mp_rank_*/{LEGACY_FILE} (legacy){hint}")
    return d, fmt, iteration


def is_megatron_checkpoint(path) -> bool:
    try:
        locate(path)
        return True
    except (OSError, CheckpointError):
        return False


def legacy_rank_dirs(d: Path) -> dict[tuple[int, ...], Path]:
    """{(numbers in the name): directory} of every mp_rank_* directory holding model_optim_rng.pt."""
    out = {}
    for p in sorted(d.iterdir()):
        m = _RANK_DIR.match(p.name)
        if m and p.is_dir():
            if not (p / LEGACY_FILE).is_file():
                raise CheckpointError(f"{p}: no {LEGACY_FILE}")
            out[tuple(int(g) for g in m.groups() if g is not None)] = p
    return out
