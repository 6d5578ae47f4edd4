"""Megatron-LM's legacy format (ckpt_format "torch"): one pickled state dict per model-parallel rank.

`mp_rank_TT[_PPP][_EEE]/model_optim_rng.pt` holds {"args", "iteration", "checkpoint_version", "model" (or
"model0", "model1", ... one per virtual pipeline chunk), "optimizer", "rng_state", ...}; "model" is
`state_dict_for_save_checkpoint()` of that rank's GPTModel: local shards under local names, its decoder layers
numbered from 0 on every pipeline stage. Each file is loaded with torch.load(weights_only=True, mmap=True)
(pickles.load_weights_only: the safety check, and the arguments), its tensors located in the file
(pickles.archive_layout) and read with positioned reads, like torch_dist's chunks: a memory map would keep every
page read resident (the whole checkpoint, measured: docs/benchmarks.md). Every local tensor is placed in the
global tensor torch_dist would store (store.py), so that everything downstream sees one format:

- decoder layers stack on a leading axis (a stage's layer j is global layer offset + j; the offsets are the layer
  counts of the chunks before it, in model order chunk = virtual index * pp + pp rank, which is how Megatron
  assigns layers, uneven first / last stages included), experts on the next one (expert e of ep rank r is
  r * experts per rank + e);
- tensor-parallel shards: column-parallel weights and biases (linear_qkv, linear_fc1, the word embeddings and
  output layer) split their rows, row-parallel weights (linear_proj, linear_fc2) their columns; a SwiGLU rank's
  linear_fc1 is [its gate | its up], i.e. two pieces of torch_dist's [all gates | all ups]; the rest is
  replicated (tp rank 0's copy is read).
"""
from __future__ import annotations

import os
import re
from pathlib import Path

from ..format import CheckpointError
from ..safetensors_io import TensorFile
from .locate import LEGACY_FILE, legacy_rank_dirs
from .pickles import TensorLoc, archive_layout, load_weights_only
from .store import Chunk, GlobalTensor, MegatronStore

COLUMN = ("self_attention.linear_qkv.weight", "self_attention.linear_qkv.bias", "mlp.linear_fc1.weight",
          "mlp.linear_fc1.bias", "mlp.experts.experts.linear_fc1.weight", "mlp.experts.experts.linear_fc1.bias",
          "embedding.word_embeddings.weight", "output_layer.weight")
ROW = ("self_attention.linear_proj.weight", "mlp.linear_fc2.weight", "mlp.experts.experts.linear_fc2.weight")
_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.(.+)$")
_SEQUENTIAL_EXPERT = re.compile(r"^mlp\.experts\.local_experts\.(\d+)\.(.+)$")
_GROUPED_EXPERT = re.compile(r"^mlp\.experts\.(linear_fc[12])\.(weight|bias)(\d+)$")


def _ranks(dirs: dict, args: dict) -> dict[tuple[int, int, int], Path]:
    """{(tp, pp, ep): directory}; two numbers mean (tp, pp) when pipeline-parallel, else (tp, ep)."""
    pipelined = (args.get("pipeline_model_parallel_size") or 1) > 1
    out = {}
    for nums, path in dirs.items():
        if len(nums) == 2 and not pipelined:
            nums = (nums[0], 0, nums[1])
        out[(nums + (0, 0))[:3]] = path
    return out


def _model_dicts(state: dict, what: str) -> list[dict]:
    if "model" in state:
        models = [state["model"]]
    else:
        models = [state[k] for k in sorted((k for k in state if re.fullmatch(r"model\d+", k)), key=lambda k: int(k[5:]))]
    if not models or not all(isinstance(m, dict) for m in models):
        raise CheckpointError(f"{what}: no 'model' state dict")
    version = state.get("checkpoint_version") or 0
    if version < 3.0 or any("language_model" in m for m in models):
        raise CheckpointError(f"{what}: checkpoint_version {version}: Megatron-LM checkpoints older than version 3.0 "
                              f"(before Megatron-Core: 'language_model' keys) are not read; load and save it once "
                              f"with a Megatron-LM of 2024 or later")
    return models


def _layer_count(model: dict) -> int:
    return 1 + max((int(m.group(1)) for k in model if (m := _LAYER.match(k))), default=-1)


def _place(key: str, args: dict, ep_rank: int, experts_per_rank: int):
    """(global key, layer or None, expert or None) of a local state-dict key."""
    m = _LAYER.match(key)
    if not m:
        return key, None, None, None
    j, rest = int(m.group(1)), m.group(2)
    expert = None
    if (e := _SEQUENTIAL_EXPERT.match(rest)):
        expert, rest = int(e.group(1)), f"mlp.experts.experts.{e.group(2)}"
    elif (e := _GROUPED_EXPERT.match(rest)):
        expert, rest = int(e.group(3)), f"mlp.experts.experts.{e.group(1)}.{e.group(2)}"
    elif rest.startswith("mlp.experts.weight"):
        raise CheckpointError(f"{key}: the legacy GroupedMLP layout (moe_use_legacy_grouped_gemm) is not read; "
                              f"save the checkpoint in the torch_dist format")
    if expert is not None:
        expert += ep_rank * experts_per_rank
    return f"decoder.layers.{rest}", j, expert, rest


def _piece(tf: TensorFile, name: str, lead: int, row0: int) -> tuple:
    """(read, runs) of a chunk that is rows row0.. of the local tensor `name` of rank file `tf`, behind `lead`
    leading axes of size 1 (layer, expert) in the global picture."""
    def local(box):
        inner = list(box[lead:])
        if inner:
            inner[0] = (inner[0][0] + row0, inner[0][1])
        return inner

    def read(box):
        return tf.read_box(name, local(box)).reshape([n for _, n in box])

    def runs(box):
        return [(tf.fd, off, n) for off, n in tf.byte_runs(name, local(box))]

    return read, runs


def open_legacy(d: Path, overrides: dict, is_model_key) -> MegatronStore:
    dirs = legacy_rank_dirs(d)
    loaded, files = {}, {}

    def state_of(path: Path) -> dict:
        """The file's state, loaded with weights_only (its check and its arguments; the tensors it maps are never
        touched: their bytes are read through `layout_of`)."""
        if path not in loaded:
            state = load_weights_only(str(path / LEGACY_FILE), str(path / LEGACY_FILE), mmap=True)
            if not isinstance(state, dict):
                raise CheckpointError(f"{path / LEGACY_FILE}: not a state dict")
            loaded[path] = state
        return loaded[path]

    def layout_of(path: Path) -> tuple[TensorFile, dict]:
        """The same state with every tensor a TensorLoc: positioned reads of exactly the bytes wanted, where a
        memory map would leave every page read resident."""
        tf = files[path] = TensorFile(path / LEGACY_FILE, {})
        return tf, archive_layout(tf.fd, 0, os.fstat(tf.fd).st_size, str(path / LEGACY_FILE))

    def close():
        loaded.clear()
        for tf in files.values():
            tf.close()

    first = state_of(dirs[min(dirs)])
    saved = first.get("args")
    args = {**(vars(saved) if hasattr(saved, "__dict__") else dict(saved or {})), **overrides}
    ranks = _ranks(dirs, args)
    tp, pp, ep = (1 + max(r[i] for r in ranks) for i in range(3))
    missing = [r for r in ((t, p, e) for t in range(tp) for p in range(pp) for e in range(ep)) if r not in ranks]
    if missing:
        raise CheckpointError(f"{d}: no mp_rank directory for (tp, pp, ep) rank(s) {missing[:4]} (tp={tp} pp={pp} "
                              f"ep={ep} from the directory names)")
    etp = args.get("expert_tensor_parallel_size")
    if args.get("num_experts") and etp not in (None, tp):
        raise CheckpointError(f"{d}: expert_tensor_parallel_size={etp} differs from tp={tp}: the legacy format's "
                              f"expert shards are then not placed by their directory; use the torch_dist format")
    experts = args.get("num_experts") or args.get("num_moe_experts") or 0
    gated = bool(args.get("swiglu") or args.get("gated_linear_unit"))
    models = {}
    for r, path in sorted(ranks.items()):
        _model_dicts(state_of(path), str(path / LEGACY_FILE))  # checked as loaded by torch
        tf, layout = layout_of(path)
        models[r] = [(tf, m) for m in _model_dicts(layout, str(path / LEGACY_FILE))]
    vp = len(models[(0, 0, 0)])
    counts = {(v, p): _layer_count(models[(0, p, 0)][v][1]) for p in range(pp) for v in range(vp)}
    offsets, total = {}, 0
    for v in range(vp):  # model order: chunk v * pp + p
        for p in range(pp):
            offsets[(v, p)], total = total, total + counts[(v, p)]
    tensors, ignored = {}, []
    for (t, p, e), dicts in models.items():
        for v, (tf, model) in enumerate(dicts):
            for key, value in model.items():
                if key.endswith("_extra_state") or not isinstance(value, TensorLoc):
                    continue
                gkey, j, expert, rest = _place(key, args, e, experts // ep if experts else 0)
                if not is_model_key(gkey):
                    ignored.append(gkey)
                    continue
                short = rest or gkey
                split = 0 if short in COLUMN else 1 if short in ROW else None
                if (split is None and t) or (expert is None and e):
                    continue  # a copy another rank's file already gives
                lead = [(offsets[(v, p)] + j, total)] if j is not None else []
                if expert is not None:
                    lead.append((expert, experts))
                name = f"{v}:{key}"
                tf.tensors[name] = (value.dtype, value.shape, value.start, value.start + value.nbytes)
                rows = value.shape[0] if value.shape else 1
                pieces = [(0, rows, 0)]  # (first local row, rows, global start along the split dim)
                if split == 0 and gated and short.endswith(("linear_fc1.weight", "linear_fc1.bias")):
                    half = rows // 2  # [its gate | its up] -> rows t*half and F + t*half of [gates | ups]
                    pieces = [(0, half, t * half), (half, half, tp * half + t * half)]
                elif split is not None:
                    pieces = [(0, rows, t * value.shape[split])]
                shape = [n for _, n in lead] + list(value.shape)
                if split is not None:
                    shape[len(lead) + split] *= tp
                g = tensors.setdefault(gkey, GlobalTensor(gkey, tuple(shape), value.dtype))
                if g.shape != tuple(shape) or g.dtype != value.dtype:
                    raise CheckpointError(f"{d}: {key} of rank (tp={t}, pp={p}, ep={e}) is {value.dtype} "
                                          f"{list(value.shape)}, which does not fit {gkey} {list(g.shape)} {g.dtype} "
                                          f"of the other ranks")
                for row0, n, start in pieces:
                    sizes = list(value.shape)
                    if sizes:
                        sizes[0] = n
                    offs = [i for i, _ in lead] + [0] * len(sizes)
                    if split is not None:
                        offs[len(lead) + split] = start
                    read, runs = _piece(tf, name, len(lead), row0)
                    g.chunks.append(Chunk(tuple(offs), tuple([1] * len(lead) + sizes), read, runs))
    listing = [(str(path.relative_to(d) / LEGACY_FILE), (path / LEGACY_FILE).stat().st_size) for path in ranks.values()]
    layout = {"tp": tp, "pp": pp, "ep": ep, "virtual_stages": vp}
    return MegatronStore(d, "legacy", tensors, first, layout, listing, close, sorted(set(ignored)))
