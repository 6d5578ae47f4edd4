"""The types of manifest.json's fields (docs/checkpoint-format.md), checked once when a manifest is read.

Everything after `read_manifest` indexes the manifest freely (m["files"][i]["tensors"][name]["shape"][d]); a
field of the wrong type or a missing key would surface there as a raw KeyError or TypeError far from its cause.
So each field is checked here and a problem is reported as `<manifest path>: <field>: expected ..., got ...`.
Cross-field consistency (shapes against shard specs, the model config and the shard headers) is structure.py's.
"""
from __future__ import annotations

from .safetensors_io import DTYPES


class SchemaError(Exception):
    """A field of the wrong type; read_manifest turns it into a CheckpointError naming the manifest."""


def _show(value) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _fail(where: str, what: str, value) -> None:
    raise SchemaError(f"{where}: expected {what}, got {_show(value)}")


def _get(d: dict, key: str, where: str, optional: bool = False, default=None):
    if key not in d:
        if optional:
            return default
        raise SchemaError(f"{where}: missing key {key!r}" if where else f"missing key {key!r}")
    return d[key]


def _int(value, where: str, lo: int = 0, hi: int | None = None) -> int:
    # bool is an int to Python, never to the manifest
    if not isinstance(value, int) or isinstance(value, bool) or value < lo or (hi is not None and value >= hi):
        _fail(where, f"an integer >= {lo}" + (f" and < {hi}" if hi is not None else ""), value)
    return value


def _opt_int(value, where: str, lo: int = 0) -> None:
    if value is not None:
        _int(value, where, lo)


def _type(value, kind, where: str, what: str):
    if not isinstance(value, kind):
        _fail(where, what, value)
    return value


def _ints(value, where: str, lo: int = 0) -> list:
    _type(value, list, where, "a list of integers")
    for i, n in enumerate(value):
        _int(n, f"{where}[{i}]", lo)
    return value


def _dtype(value, where: str) -> None:
    if value not in DTYPES:
        _fail(where, f"a safetensors dtype ({', '.join(DTYPES)})", value)


def _split(value, where: str) -> None:
    if value is None:
        return
    _type(value, dict, where, "null or a shard spec object")
    _int(_get(value, "dim", where), f"{where}.dim", lo=-8)
    parts, replicas = value.get("parts"), value.get("replicas")
    if parts is not None:
        _ints(parts, f"{where}.parts", lo=1)
    if replicas is not None:
        _ints(replicas, f"{where}.replicas", lo=1)
        if parts is None or len(replicas) != len(parts):
            _fail(f"{where}.replicas", "one entry per part", replicas)
    _int(value.get("block", 1), f"{where}.block", lo=1)


def _model_config(value, where: str):
    from tpzoo.errors import UserError
    from tpzoo.models.config import ModelConfig

    _type(value, dict, where, "an object")
    _type(_get(value, "family", where), str, f"{where}.family", "a string")
    for key in ("vocab_size", "hidden_size", "num_layers"):
        _int(_get(value, key, where), f"{where}.{key}", lo=1)
    _opt_int(value.get("max_position_embeddings"), f"{where}.max_position_embeddings", lo=1)
    # A kind's settings sit in its sub-object (format 2: ModelConfig.to_dict()), or flat (format 1)
    for group, keys, optional in (("attention", ("num_heads",), ("num_kv_heads", "head_dim")),
                                  ("mlp", ("ffn_hidden_size",), ())):
        flat = any(k in value for k in keys)
        sub, at = (value, where) if flat else (value.get(group), f"{where}.{group}")
        if not flat:
            _type(_get(value, group, where), dict, at, "an object")
        for key in keys:
            _int(_get(sub, key, at), f"{at}.{key}", lo=1)
        for key in optional:
            _opt_int(sub.get(key), f"{at}.{key}", lo=1)
    try:
        return ModelConfig.from_dict(value)
    except (UserError, TypeError, ValueError, KeyError, ZeroDivisionError) as e:
        raise SchemaError(f"{where}: {type(e).__name__}: {e}") from None


def check_schema(m) -> None:
    """Raise SchemaError naming the first field that is missing or of the wrong type."""
    _type(m, dict, "manifest", "a JSON object")
    _int(_get(m, "format_version", "", optional=True, default=1), "format_version", lo=1)
    _model_config(_get(m, "model_config", ""), "model_config")
    tp = _int(_get(m, "tp", ""), "tp", lo=1)
    pp = _int(_get(m, "pp", ""), "pp", lo=1)
    _int(_get(m, "virtual_stages", "", optional=True, default=1), "virtual_stages", lo=1)
    vocab = _type(_get(m, "vocab", ""), dict, "vocab", "an object")
    _int(_get(vocab, "size", "vocab"), "vocab.size", lo=1)
    _int(_get(vocab, "padded", "vocab"), "vocab.padded", lo=vocab["size"])
    _int(vocab.get("padding_multiple", 1), "vocab.padding_multiple", lo=1)

    stages = _type(_get(m, "stages", ""), list, "stages", "a list of stage objects")
    if not stages:
        _fail("stages", "at least one stage", stages)
    for i, st in enumerate(stages):
        w = f"stages[{i}]"
        _type(st, dict, w, "an object")
        _int(_get(st, "pp_rank", w), f"{w}.pp_rank", hi=pp)
        layers = _ints(_get(st, "layers", w), f"{w}.layers")
        if len(layers) != 2 or layers[0] > layers[1]:
            _fail(f"{w}.layers", "[first, end)", layers)
        for flag in ("pre_process", "post_process"):
            _type(_get(st, flag, w), bool, f"{w}.{flag}", "true or false")

    tensors = _type(_get(m, "tensors", ""), dict, "tensors", "an object (name -> tensor)")
    for name, t in tensors.items():
        w = f"tensors[{name!r}]"
        _type(t, dict, w, "an object")
        _ints(_get(t, "shape", w), f"{w}.shape")
        _dtype(_get(t, "dtype", w), f"{w}.dtype")
        _split(_get(t, "split", w), f"{w}.split")
        _opt_int(t.get("vocab_dim"), f"{w}.vocab_dim")
        _int(_get(t, "pp_rank", w), f"{w}.pp_rank", hi=pp)

    files = _type(_get(m, "files", ""), list, "files", "a list of file objects")
    for i, f in enumerate(files):
        w = f"files[{i}]"
        _type(f, dict, w, "an object")
        _type(_get(f, "path", w), str, f"{w}.path", "a relative path")
        _int(_get(f, "tp_rank", w), f"{w}.tp_rank", hi=tp)
        _int(_get(f, "pp_rank", w), f"{w}.pp_rank", hi=pp)
        _int(_get(f, "bytes", w), f"{w}.bytes")
        _type(_get(f, "checksum", w), str, f"{w}.checksum", "'crc32:<hex>' or 'sha256:<hex>'")
        for name, t in _type(_get(f, "tensors", w), dict, f"{w}.tensors", "an object").items():
            tw = f"{w}.tensors[{name!r}]"
            _type(t, dict, tw, "an object")
            _ints(_get(t, "shape", tw), f"{tw}.shape")
            _dtype(_get(t, "dtype", tw), f"{tw}.dtype")

    for i, name in enumerate(_type(m.get("aux_files", []), list, "aux_files", "a list of file names")):
        _type(name, str, f"aux_files[{i}]", "a file name")
    _type(m.get("metadata", {}), dict, "metadata", "an object")
