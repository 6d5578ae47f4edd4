"""The cheap structural check every reader runs on opening a checkpoint: headers only, no tensor data.

A manifest can be well typed (schema.py) and still contradict itself or its files: a full shape that its shard
spec does not split into the shard shapes a file holds, a tensor the model config does not have, a shard file
whose header lists other tensors, dtypes or shapes. Readers index the files by the manifest, so such a
contradiction surfaced as a raw IndexError deep in a conversion, or as silently wrong slices. Here, before
anything is read:

1. the stages cover the model's layers in order, every pipeline rank has one;
2. each file entry lists exactly the tensors of its pipeline rank, in the manifest's dtype, with the local shape
   that the manifest's full shape, vocabulary padding and shard spec give for that tensor-parallel rank;
3. the manifest's tensors are exactly those the model config builds at the stored layout (tpzoo.models on the
   meta device: names, pipeline rank, shard spec, vocabulary dim, full shape);
4. every shard file exists, has its recorded size, and its safetensors header lists exactly the tensors,
   dtypes and shapes of its file entry (format.verify_file without the checksum); listed auxiliary files exist.

It costs a few header reads and one meta-device model build (milliseconds, even for 405B). The checksums, which
read every byte, stay with `verify=True` readers and `tpzoo inspect --verify`.
"""
from __future__ import annotations

from pathlib import Path

from tpzoo.errors import UserError

from .format import MANIFEST_NAME, CheckpointError, safe_path, verify_file
from .layout import layout_plan, spec_from_json, spec_to_json
from .lora_io import lora_config_of, lora_of_manifest

_SHARD_PATTERN = "model-tp*-pp*.safetensors"


def _norm_split(split: dict | None) -> dict | None:
    """A split as spec_to_json writes it (absent keys at their defaults), for comparison."""
    return None if split is None else spec_to_json(spec_from_json(split))


def _local_shape(t: dict, tp: int, padded: int) -> list[int]:
    """The shard shape that the manifest's full shape and shard spec give for one tensor-parallel rank."""
    shape = list(t["shape"])
    spec = spec_from_json(t["split"])
    if spec.dim is None:
        return shape
    if not -len(shape) <= spec.dim < len(shape):
        raise ValueError(f"split dim {spec.dim} outside its {len(shape)}-d shape")
    d = spec.dim % len(shape)
    full_len = padded if t.get("vocab_dim") == d else shape[d]
    # Arithmetic only (the same on every tp rank): local_segments walks replicated blocks one by one, which a
    # corrupt size could make endless; readers use it only once _model_problems has matched the shapes.
    shape[d] = spec.local_size(full_len, tp)
    return shape


def _stage_problems(m: dict, cfg) -> list[str]:
    stages, pp = m["stages"], m["pp"]
    want = pp * m.get("virtual_stages", 1)
    if len(stages) != want:
        return [f"{len(stages)} stages for pp={pp} x virtual_stages={m.get('virtual_stages', 1)} (expected {want})"]
    end = 0
    for i, st in enumerate(stages):
        first, last = st["layers"]
        if first != end:
            return [f"stages[{i}] starts at layer {first}, the previous stage ends at {end}"]
        if st["pre_process"] != (i == 0) or st["post_process"] != (i == len(stages) - 1):
            return [(f"stages[{i}]: only the first stage has the embedding (pre_process) and only the last the "
                     f"head (post_process)")]
        end = last
    if end != cfg.num_layers:
        return [f"the stages end at layer {end}, the model config has {cfg.num_layers} layers"]
    missing = sorted(set(range(pp)) - {st["pp_rank"] for st in stages})
    return [f"no stage on pipeline rank(s) {missing}"] if missing else []


def _split_text(t: dict, tp: int) -> str:
    split = t["split"]
    if split is None:
        return "replicated"
    parts = f" (parts {split['parts']})" if split.get("parts") else ""
    return f"split on dim {split['dim']}{parts} over tp={tp}"


def _file_problems(m: dict) -> list[str]:
    """File entries against the manifest's tensors: names, dtypes, and shard shapes from full shapes + specs
    (one problem per tensor: every tp rank's file usually disagrees the same way)."""
    tensors, tp, padded = m["tensors"], m["tp"], m["vocab"]["padded"]
    out, reported = [], set()
    for f in m["files"]:
        want = {n for n, t in tensors.items() if t["pp_rank"] == f["pp_rank"]}
        have = set(f["tensors"])
        if want - have:
            out.append(f"the entry of {f['path']} lacks tensor(s) {sorted(want - have)[:5]} of pipeline rank "
                       f"{f['pp_rank']}")
        unknown = sorted(n for n in have - want if n not in tensors)
        if unknown:
            out.append(f"the entry of {f['path']} lists tensor(s) {unknown[:5]} that are not in the manifest's "
                       f"tensors")
        elsewhere = sorted(n for n in have - want if n in tensors)
        if elsewhere:
            out.append(f"the entry of {f['path']} (pipeline rank {f['pp_rank']}) lists tensor(s) {elsewhere[:5]} "
                       f"that the manifest places on pipeline rank {tensors[elsewhere[0]]['pp_rank']}")
        for name in sorted((want & have) - reported):
            t, local = tensors[name], f["tensors"][name]
            if local["dtype"] != t["dtype"]:
                reported.add(name)
                out.append(f"tensor {name}: dtype {t['dtype']} in the manifest, {local['dtype']} in the entry of "
                           f"{f['path']}")
                continue
            try:
                expect = _local_shape(t, tp, padded)
            except (UserError, ValueError) as e:
                reported.add(name)
                out.append(f"tensor {name}: full shape {t['shape']} cannot be {_split_text(t, tp)}: {e}")
                continue
            if expect != list(local["shape"]):
                reported.add(name)
                out.append(f"tensor {name}: full shape {t['shape']} {_split_text(t, tp)} gives shards of {expect}, "
                           f"but {f['path']} holds {list(local['shape'])} (the full shape contradicts the shards)")
    return out


def _model_problems(m: dict, cfg) -> list[str]:
    """The manifest's tensors against what the model config builds at the stored layout."""
    try:
        lora = lora_of_manifest(m)
        if lora is not None:  # a LoRA checkpoint: the adapters only (the base is another checkpoint)
            lora = lora_config_of(lora)
        plans = layout_plan(cfg, m["tp"], m["stages"], m["vocab"].get("padding_multiple", 1), lora)
    except (UserError, ValueError, TypeError, RuntimeError) as e:
        return [f"the model config cannot be built at tp={m['tp']} with the stored stages: {e}"]
    tensors, out = m["tensors"], []
    expected = {info.name: (info, plan.pp_rank) for plan in plans for info in plan.params}
    missing = sorted(set(expected) - set(tensors))
    if missing:
        out.append(f"no entry for tensor(s) {missing[:5]} that the model config has ({len(missing)} in all)")
    unknown = sorted(set(tensors) - set(expected))
    if unknown:
        out.append(f"tensor(s) {unknown[:5]} that the model config does not have ({len(unknown)} in all)")
    for name in sorted(set(expected) & set(tensors)):
        info, pp_rank = expected[name]
        t = tensors[name]
        if list(t["shape"]) != list(info.full_shape):
            out.append(f"tensor {name}: full shape {t['shape']} in the manifest, the model config implies "
                       f"{list(info.full_shape)}")
        elif _norm_split(t["split"]) != spec_to_json(info.spec):
            out.append(f"tensor {name}: shard spec {t['split']} in the manifest, the model has "
                       f"{spec_to_json(info.spec)}")
        elif t.get("vocab_dim") != info.vocab_dim:
            out.append(f"tensor {name}: vocab_dim {t.get('vocab_dim')} in the manifest, the model has "
                       f"{info.vocab_dim}")
        elif t["pp_rank"] != pp_rank:
            out.append(f"tensor {name}: on pipeline rank {t['pp_rank']} in the manifest, the stages put it on "
                       f"{pp_rank}")
        elif info.padded is not None and info.padded != m["vocab"]["padded"]:
            out.append(f"tensor {name}: vocab.padded {m['vocab']['padded']} in the manifest, tp={m['tp']} with "
                       f"padding multiple {m['vocab'].get('padding_multiple', 1)} gives {info.padded}")
    return out


def manifest_problems(root, m: dict) -> list[str]:
    """Contradictions inside a (schema-checked) manifest and against its model config, each message naming the
    manifest and the tensor, stage or file entry. Reads no shard file."""
    from tpzoo.models.config import ModelConfig

    cfg = ModelConfig.from_dict(m["model_config"])  # read_manifest has checked that it builds
    path = Path(root) / MANIFEST_NAME
    problems = []
    if m["vocab"]["size"] != cfg.vocab_size:
        problems.append(f"vocab.size {m['vocab']['size']} but the model config has {cfg.vocab_size}")
    problems += _stage_problems(m, cfg)
    problems += _file_problems(m)
    if not problems:  # a model build from contradictory stages would only repeat them
        problems += _model_problems(m, cfg)
    return [f"{path}: {p}" for p in problems]


def unlisted_shard_files(root, m: dict) -> list[Path]:
    """Shard-named files the manifest does not list (readers ignore them; they suggest two layouts mixed)."""
    listed = {Path(f["path"]).name for f in m["files"] if Path(f["path"]).parent == Path(".")}
    return sorted(p for p in Path(root).glob(_SHARD_PATTERN) if p.name not in listed)


def missing_aux_files(root, m: dict) -> list[str]:
    return [f"{Path(root) / name}: listed in {MANIFEST_NAME} (aux_files) but missing"
            for name in m.get("aux_files", []) if not safe_path(root, name, "auxiliary file").is_file()]


def check_structure(root, m: dict) -> None:
    """Raise CheckpointError for the first structural problem: manifest contradictions, then each shard file's
    presence, size and header, then missing auxiliary files."""
    problems = manifest_problems(root, m)
    if problems:
        more = f" (and {len(problems) - 1} more problem(s): `tpzoo inspect` lists them)" if len(problems) > 1 else ""
        raise CheckpointError(problems[0] + more)
    for f in m["files"]:
        verify_file(root, f, checksum=False)
    missing = missing_aux_files(root, m)
    if missing:
        raise CheckpointError(missing[0])


__all__ = ["check_structure", "manifest_problems", "missing_aux_files", "unlisted_shard_files"]
