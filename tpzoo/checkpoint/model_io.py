"""Model <-> checkpoint at run time: every rank saves its own shard collectively, and loads its own part of a
checkpoint written at any layout (or of a Hugging Face checkpoint) at the current layout.

    with atomic_dir("ckpt/step-1000", force=True) as tmp:     # every rank enters; renamed when all succeeded
        save_model_shards(model, tmp, tokenizer="data/tok")  # rank 0 writes manifest.json
        ...  # optimizer state next to it (tmp / f"optim-rank{rank:05d}.safetensors", say)
    model = load_model("ckpt/step-1000", ModelLayout(dims, sequence_parallel=True))   # this rank's Transformer
"""
from __future__ import annotations

import dataclasses

from pathlib import Path

import torch

from tpzoo.parallel.layers import padded_vocab_size
from tpzoo.pipeline.partition import as_chunks, build_model_chunks, tie_chunks

from .format import CheckpointError, aux_files_in, copy_aux_files, make_manifest, shard_file_name, write_manifest
from .lora_io import is_base_param, is_lora_param, lora_config_of, lora_of_manifest, resolve_base
from .layout import infer_padding_multiple, param_infos, partition, spec_to_json, stages_from_ranges, state_tensors
from .safetensors_io import dtype_name
from .st_writer import SafetensorsWriter
from .sources import check_source, fill_params, open_source

SAFETENSORS_META = {"format": "pt"}


def _stages_for(source, cfg, pp: int, virtual_stages: int | None) -> list[dict]:
    """The stored partition when the pipeline layout is unchanged (a resumed run keeps its stages), else the
    current partition for pp * virtual_stages chunks."""
    stored = getattr(source, "stages", None)
    if stored and source.pp == pp and (virtual_stages is None or len(stored) == pp * virtual_stages):
        return stored
    return stages_from_ranges(partition(cfg, pp, virtual_stages or 1), pp)


def load_model(ckpt, layout=None, *, recompute: str = "none", virtual_stages: int | None = None,
               stages: list[dict] | None = None, verify: bool = True, **layout_fields):
    """This rank's part of the model in `ckpt` at `layout` (a tpzoo.models.ModelLayout, or a ParallelDims;
    default: the default dims; `layout_fields`, ModelLayout's fields such as sequence_parallel=True or
    device="cpu", set on it): a Transformer, or a list of chunks when this pipeline rank holds several (virtual
    stages). `ckpt` is a tpzoo checkpoint at any (tp, pp) (only the slices this rank needs are read) or a Hugging
    Face checkpoint (converted on the fly). The chunks are built by build_model_chunks (the path training takes)
    on meta and filled straight into their device shards (no random init, no CPU copy of the model). The
    layout's dtype and vocab_padding_multiple default to the checkpoint's, its device to dims.device."""
    from tpzoo.models import ModelLayout, Stage

    layout = ModelLayout.of(layout).replace(**layout_fields)
    dims = layout.dims
    source, base = open_source(ckpt, verify=verify, dtype=layout.dtype), None
    try:
        # A LoRA checkpoint: the base's weights, then these adapters.
        lora = lora_of_manifest(getattr(source, "manifest", None))
        base = open_source(resolve_base(lora, ckpt), verify=verify, dtype=layout.dtype) if lora else None
        cfg = source.cfg
        stages = stages or _stages_for(source, cfg, dims.pp, virtual_stages)
        device = layout.device if layout.device is not None else dims.device
        layout = layout.replace(
            vocab_padding_multiple=layout.vocab_padding_multiple or (base or source).padding_multiple,
            dtype=layout.dtype or (base or source).dtype("embed.weight"), device="meta")
        mine = [Stage.from_manifest(s) for s in stages if s["pp_rank"] == dims.pp_rank]
        chunks = build_model_chunks(cfg, layout, stages=mine, recompute=recompute)
        for model in chunks:
            parts = [(source, None)]
            if lora:
                from tpzoo.models.lora import add_lora

                add_lora([model], lora_config_of(lora))
                parts = [(base, is_base_param), (source, is_lora_param)]
            filled = [(src, param_infos(model, cfg, dims.tp, select)) for src, select in parts]
            for src, infos in filled:
                check_source(src, infos)
            model.materialize(device)
            for src, infos in filled:
                fill_params(model, src, infos, dims.tp_rank, dims.tp)
            model.checkpoint_stages = stages  # how the layers were split, for the caller's pipeline schedule
    finally:
        source.close()
        if base is not None:
            base.close()
    tie_chunks(chunks)
    return chunks[0] if len(chunks) == 1 else chunks


def load_weights_into(model_or_chunks, ckpt, *, verify: bool = True, select=None) -> None:
    """Overwrite the parameters of existing model chunks (this rank's, at their layout) from `ckpt`; only those
    whose name `select(name)` accepts, when given (the base of a LoRA model, or its adapters)."""
    chunks = as_chunks(model_or_chunks)
    source = open_source(ckpt, verify=verify, dtype=chunks[0].layout.dtype)  # (a quantized HF one dequantized so)
    try:
        for chunk in chunks:
            dims = chunk.dims
            infos = param_infos(chunk, chunk.cfg, dims.tp, select)
            check_source(source, infos)
            with torch.no_grad():
                fill_params(chunk, source, infos, dims.tp_rank, dims.tp)
    finally:
        source.close()


def _gather_experts(chunks, select=None) -> dict:
    """Every expert of this rank's expert weights (all_gather over the ep group, dim 0): a checkpoint holds the
    experts whole, so it loads at any ep. Collective over the ep group; only the ranks of the first
    expert-data-parallel slice holding the writers (edp_rank 0 for the writers dp = cp = 0) call it."""
    from tpzoo.parallel import comm

    out = {}
    for chunk in chunks:
        dims = chunk.dims
        for name, p in chunk.named_parameters():
            if getattr(p, "expert_parallel", False) and (select is None or select(name)):
                out[name] = comm.all_gather(p.detach(), dims.group("ep"), dim=0)
    return out


def _write_own_shard(chunks, cfg, out_dir: Path, dtype, tp: int, tp_rank: int, pp_rank: int, checksum: str,
                     select=None, experts: dict | None = None) -> dict:
    """Write this rank's file; return what rank 0 needs for the manifest. `experts`: whole expert tensors
    (gathered over ep) to write instead of this rank's share."""
    items = []
    for chunk in chunks:
        params = dict(state_tensors(chunk))
        for info in param_infos(chunk, cfg, tp, select):
            p = params[info.name]
            if info.rows is not None:
                p = experts[info.name]
                info = dataclasses.replace(info, local_shape=tuple(p.shape), rows=None)
            items.append((info, p, dtype if dtype is not None and p.is_floating_point() else p.dtype))
    entries = [(info.name, dt, info.local_shape) for info, _, dt in items]
    path = out_dir / shard_file_name(tp_rank, pp_rank)
    writer = SafetensorsWriter(path, entries, SAFETENSORS_META, checksum)
    try:
        for info, p, dt in items:
            writer.write(info.name, p.detach().to("cpu", dt))  # one parameter at a time off the device
        size, digest = writer.close()
    finally:
        writer.abort()
    mine = {"file": {"path": path.name, "tp_rank": tp_rank, "pp_rank": pp_rank, "bytes": size, "checksum": digest,
                     "tensors": {n: {"shape": list(s), "dtype": dtype_name(dt)} for n, dt, s in entries}}}
    if tp_rank == 0:  # the layout-independent facts, once per pipeline rank
        mine["stages"] = [{"pp_rank": pp_rank, "layers": [c.stage.layers.start, c.stage.layers.stop],
                           "pre_process": c.pre_process, "post_process": c.post_process} for c in chunks]
        mine["tensors"] = {info.name: {"shape": list(info.full_shape), "dtype": dtype_name(dt),
                                       "split": spec_to_json(info.spec), "vocab_dim": info.vocab_dim,
                                       "pp_rank": pp_rank} for info, _, dt in items}
        # A LoRA checkpoint holds no vocabulary tensor: record the plain padding (nothing depends on it).
        mine["padded"] = next((i.padded for i, _, _ in items if i.padded), None) or padded_vocab_size(
            cfg.vocab_size, tp)
    return mine


def _write_manifest(gathered: list[dict], cfg, out_dir: Path, tp: int, pp: int, tokenizer, metadata) -> dict:
    stages = sorted((s for g in gathered for s in g.get("stages", [])),
                    key=lambda s: (s["layers"][0], s["layers"][1], not s["pre_process"], s["post_process"]))
    tensors = {k: v for g in gathered for k, v in g.get("tensors", {}).items()}
    padded = next(g["padded"] for g in gathered if g.get("padded"))
    if tokenizer is not None and hasattr(tokenizer, "save"):
        tokenizer.save(out_dir)
        aux = aux_files_in(out_dir)
    else:
        aux = copy_aux_files(tokenizer, out_dir) if tokenizer is not None else []
    manifest = make_manifest(cfg, tp=tp, pp=pp, stages=stages, tensors=tensors,
                             files=[g["file"] for g in gathered if g.get("file")], vocab_padded=padded,
                             padding_multiple=infer_padding_multiple(cfg.vocab_size, padded, tp),
                             aux_files=aux, metadata=metadata)
    write_manifest(out_dir, manifest)
    return manifest


def save_model_shards(chunks_or_model, out_dir, cfg=None, *, tokenizer=None, metadata: dict | None = None,
                      dtype=None, checksum: str = "crc32", select=None, dp_writer: int = 0) -> dict | None:
    """Write this rank's shard file into `out_dir` (an existing directory, e.g. from `atomic_dir`); collective
    when torch.distributed is initialized: one rank per (tp, pp) position (dp = `dp_writer`, cp = 0; another
    dp_writer saves another replica's weights, tpzoo.train.diloco_state) writes, rank 0 writes
    manifest.json and the tokenizer files (`tokenizer`: a directory to copy them from, or an object with
    `save(dir)`). A failure on any rank is raised on every rank (no rank is left waiting in a collective).
    `select(name)`: save only the parameters it accepts (a LoRA checkpoint: the adapters). Returns the manifest
    on rank 0, None elsewhere."""
    import torch.distributed as dist

    chunks = as_chunks(chunks_or_model)
    cfg = cfg or chunks[0].cfg
    dims = chunks[0].dims
    out_dir = Path(out_dir)
    tp, tp_rank, pp, pp_rank = dims.tp, dims.tp_rank, dims.pp, dims.pp_rank
    distributed = dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1
    rank = dist.get_rank() if distributed else 0
    mine: dict = {}
    # the experts are gathered over the writer's ep group (edp slice of the rank dp = dp_writer, cp = 0)
    writers_edp = dims.cp * dp_writer // dims.ep
    experts = _gather_experts(chunks, select) if dims.ep > 1 and dims.edp_rank == writers_edp else None
    try:
        if dims.dp_rank == dp_writer and dims.cp_rank == 0:
            mine = _write_own_shard(chunks, cfg, out_dir, dtype, tp, tp_rank, pp_rank, checksum, select, experts)
    except Exception as e:  # noqa: BLE001 - reported to every rank below
        if not distributed:
            raise
        mine = {"error": f"rank {rank}: {type(e).__name__}: {e}"}
    gathered = [None] * dist.get_world_size() if distributed and rank == 0 else None
    if distributed:
        dist.gather_object(mine, gathered, dst=0)
    else:
        gathered = [mine]
    manifest, error = None, None
    if rank == 0:
        errors = [g["error"] for g in gathered if g.get("error")]
        try:
            if errors:
                raise CheckpointError("saving the checkpoint failed: " + "; ".join(errors))
            manifest = _write_manifest(gathered, cfg, out_dir, tp, pp, tokenizer, metadata)
        except Exception as e:  # noqa: BLE001
            if not distributed:
                raise
            error = str(e)
    if distributed:
        box = [error]
        dist.broadcast_object_list(box, src=0)
        if box[0]:
            raise CheckpointError(box[0])
    return manifest
