"""Writing a teacher cache (the format: tpzoo.post.teacher_cache): the teacher runs forward only through the
executor at its own layout (tp, pp; extra ranks under torchrun are data parallel, each taking every dp-th packed
sequence), on the SFT examples packed as training packs them (document masking: each example's positions see
only itself, so they equal the example run alone); its last stage's tp rank 0 writes the top K of each trained
position straight into the memory-mapped arrays, at offsets every rank knows from the data alone."""
from __future__ import annotations

import numpy as np
import torch.distributed as dist

from tpzoo.data import IGNORE_INDEX, collate_long, load_tokenizer
from tpzoo.data.sft import PackedSFTDataset, load_sft_records
from tpzoo.errors import ConfigError
from tpzoo.parallel.state import get_dims
from tpzoo.parallel.vocab_topk import vocab_parallel_topk

from .objective import side_pass
from .teacher_cache import (abspath, cache_bytes_per_position, check_out_dir, encoded_records, index_of,
                            record_hash)


def _barrier() -> None:
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()


def write_teacher_cache(teacher, data, out, *, k: int, seq_len: int, template: str = "auto", tokenizer=None,
                        dims=None, dtype=None, micro_batch_size: int = 4, group: int = 8) -> dict:
    """Write the cache of `teacher` (a tpzoo checkpoint at any layout or a Hugging Face directory) for the SFT file
    `data` into `out` (collective over every rank of `dims`); returns its index."""
    from tpzoo.checkpoint import load_model
    from tpzoo.checkpoint.atomic import atomic_dir
    from tpzoo.models import ModelLayout
    from tpzoo.pipeline import as_chunks

    dims = get_dims(dims)
    check_out_dir(out)
    tok = load_tokenizer(tokenizer or teacher)
    records = load_sft_records(data)
    encoded = encoded_records(records, tok, seq_len, template)
    counts = [int(mask[1:].sum()) for _, mask in encoded]
    offsets = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
    kept = [i for i, c in enumerate(counts) if c]
    if not kept:
        raise ConfigError(f"{data}: no record has a trained token within seq_len + 1 = {seq_len + 1} tokens")
    dataset = PackedSFTDataset([encoded[i] for i in kept], seq_len, tok.pad_id)
    chunks = as_chunks(load_model(str(teacher), ModelLayout(dims, dtype=dtype), virtual_stages=1))
    for c in chunks:
        c.requires_grad_(False)
        c.eval()
    vocab = chunks[0].cfg.vocab_size
    if not 1 <= k <= vocab:
        raise ConfigError(f"--distill-topk {k}: must be in [1, {vocab}] (the teacher's vocabulary)")
    if tok.vocab_size > vocab:
        raise ConfigError(f"tokenizer has {tok.vocab_size} tokens but the teacher's vocabulary is {vocab}")
    head = next((c.lm_head for c in chunks if c.post_process), None)
    writer = head is not None and dims.tp_rank == 0
    meta = {"topk": k, "vocab_size": vocab, "seq_len": seq_len, "template": template, "tokenizer": str(tok.spec),
            "teacher": abspath(teacher), "data": abspath(data), "records": len(records),
            "positions": int(offsets[-1]), "bytes_per_position": cache_bytes_per_position(k)}
    with atomic_dir(out) as tmp:
        if dims.rank == 0:
            np.lib.format.open_memmap(tmp / "ids.npy", mode="w+", dtype=np.int32, shape=(int(offsets[-1]), k)).flush()
            np.lib.format.open_memmap(tmp / "logprobs.npy", mode="w+", dtype=np.float32,
                                      shape=(int(offsets[-1]), k)).flush()
            np.save(tmp / "offsets.npy", offsets)
            np.save(tmp / "hashes.npy", np.array([record_hash(ids) for ids, _ in encoded], dtype=np.uint64))
            index_of(tmp, **meta)
        _barrier()
        ids_out = np.load(tmp / "ids.npy", mmap_mode="r+") if writer else None
        lp_out = np.load(tmp / "logprobs.npy", mmap_mode="r+") if writer else None
        mine = list(range(dims.dp_rank, len(dataset), dims.dp))
        per_call = micro_batch_size * group
        for start in range(0, len(mine), per_call):
            rows = mine[start:start + per_call]
            calls = [rows[i:i + micro_batch_size] for i in range(0, len(rows), micro_batch_size)]
            for same in ([c for c in calls if len(c) == len(calls[0])], [c for c in calls if len(c) != len(calls[0])]):
                if same:
                    _run(chunks, dims, dataset, same, k, vocab, head, ids_out, lp_out, kept, offsets)
        if writer:
            ids_out.flush()
            lp_out.flush()
        _barrier()
    return meta


def _run(chunks, dims, dataset, calls, k, vocab, head, ids_out, lp_out, kept, offsets) -> None:
    """One executor call over micro-batches of equal shape (`calls`: their dataset rows); the writer stores the
    top K of every trained position of every example in them."""
    samples = [[dataset[i] for i in rows] for rows in calls]
    batches = [{key: v.to(dims.device) for key, v in collate_long(s).items()} for s in samples]
    found: list = [None] * len(batches)

    def last(mb, logits, batch):
        found[mb] = vocab_parallel_topk(logits, k, vocab, head.dims.tp_group)

    side_pass(chunks, batches, dims, last, labels=False)
    if ids_out is None:
        return
    for mb, rows in enumerate(calls):
        top_ids, top_lp = (t.cpu().numpy() for t in found[mb])
        for b, i in enumerate(rows):
            labels, pos = samples[mb][b]["labels"], 0
            for j in dataset.rows[i]:
                n = len(dataset.examples[j][0]) - 1
                where = pos + np.nonzero(labels[pos:pos + n] != IGNORE_INDEX)[0]
                first = offsets[kept[j]]
                ids_out[first:first + len(where)] = top_ids[b, where].astype(np.int32)
                lp_out[first:first + len(where)] = top_lp[b, where]
                pos += n
