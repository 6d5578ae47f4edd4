"""LoRA checkpoints: the adapters only, in the ordinary sharded format, plus a reference to their base.

A LoRA checkpoint of a 70B model is megabytes: its manifest lists only the adapter tensors (`....lora.A.q_proj`,
sharded as the layers are), and `metadata.lora` holds the adapter config (rank, alpha, dropout, targets) and
`base`: the base model's path and a fingerprint of it. The fingerprint of a tpzoo checkpoint is the SHA-256 of
its manifest (which carries every shard file's checksum, so any change of weights changes it); of a Hugging Face
directory, of its config.json and each safetensors file's size and header (names, dtypes, shapes, offsets: a
cheap check that catches another model or a re-saved one, not an in-place edit of values). Readers refuse a base
that is missing or whose fingerprint changed, in one line, before reading anything.
"""
from __future__ import annotations

import hashlib
import struct
from pathlib import Path

from tpzoo.parallel.lora import is_lora_param

from .format import MANIFEST_NAME, CheckpointError, is_checkpoint, read_manifest


def is_base_param(name: str) -> bool:
    return not is_lora_param(name)


def fingerprint(path) -> str:
    """SHA-256 identifying a base model directory (see the module docstring)."""
    root = Path(path)
    h = hashlib.sha256()
    if is_checkpoint(root):
        h.update((root / MANIFEST_NAME).read_bytes())
        return h.hexdigest()
    config = root / "config.json"
    if not config.is_file():
        raise CheckpointError(f"{root} is neither a tpzoo checkpoint nor a Hugging Face model directory "
                              f"(no manifest.json or config.json)")
    h.update(config.read_bytes())
    for f in sorted(root.glob("*.safetensors")):
        with open(f, "rb") as fh:
            head = fh.read(8)
            n = struct.unpack("<Q", head)[0] if len(head) == 8 else 0
            h.update(f.name.encode() + struct.pack("<Q", f.stat().st_size) + fh.read(min(n, 1 << 26)))
    return h.hexdigest()


def lora_metadata(lora_cfg, base) -> dict:
    """The manifest metadata of a LoRA checkpoint whose base is the directory `base`."""
    base = Path(base).resolve()
    return {"lora": {**lora_cfg.to_dict(), "base": {"path": str(base), "fingerprint": fingerprint(base)}}}


def lora_of_manifest(manifest: dict | None) -> dict | None:
    """metadata.lora of a checkpoint manifest (None: not a LoRA checkpoint)."""
    return ((manifest or {}).get("metadata") or {}).get("lora")


def lora_info(path) -> dict | None:
    """metadata.lora of a tpzoo checkpoint directory (None: not a LoRA checkpoint, or not a tpzoo one)."""
    return lora_of_manifest(read_manifest(path)) if is_checkpoint(path) else None


def lora_config_of(info: dict):
    from tpzoo.models.lora import LoRAConfig

    return LoRAConfig.from_dict(info)


def resolve_base(info: dict, ckpt) -> str:
    """The base directory of a LoRA checkpoint, after checking it is there and unchanged."""
    base = (info.get("base") or {}).get("path")
    if not base or not Path(base).exists():
        raise CheckpointError(f"LoRA checkpoint {ckpt}: its base model {base} is missing (the adapters need the "
                              f"exact base they were trained on)")
    want = info["base"].get("fingerprint")
    if want and fingerprint(base) != want:
        raise CheckpointError(f"LoRA checkpoint {ckpt}: its base model {base} has changed since the adapters "
                              f"were trained (fingerprint {fingerprint(base)[:12]} != {want[:12]})")
    return base
