"""tpzoo.data.packed + loader: windows of the stream, doc-boundary masking, DP sharding, determinism, exact
resume, prefetch."""
import time

import numpy as np
import pytest
import torch

from tpzoo.data import (IGNORE_INDEX, PackedDataset, ResumableLoader, micro_batches_per_step, packed_loader,
                        preprocess, single_documents_dropped)


@pytest.fixture
def store(tmp_path):
    rng = np.random.default_rng(0)
    docs = ["".join(chr(97 + c) for c in rng.integers(0, 26, n)) for n in rng.integers(1, 40, 60)]
    return preprocess(docs, "byte", tmp_path / "store")


class IndexDataset:
    """Sample i is just its own index: makes ordering and sharding visible."""

    def __init__(self, n, delay=0.0):
        self.n, self.delay = n, delay

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        if self.delay:
            time.sleep(self.delay)
        return {"idx": np.array([i])}


def _ids(batch):
    return batch["idx"][:, 0].tolist()


def _take(loader, n):
    return [next(loader) for _ in range(n)]


def _same(a, b):
    return len(a) == len(b) and all(x.keys() == y.keys() and all(torch.equal(x[k], y[k]) for k in x)
                                    for x, y in zip(a, b))


def test_every_sample_is_its_window_of_the_stream(store):
    seq = 16
    ds = PackedDataset(store, seq)
    stream = store[:].astype(np.int64)
    assert len(ds) == (len(stream) - 1) // seq
    for i in range(len(ds)):
        s = ds[i]
        window = stream[i * seq: i * seq + seq + 1]
        assert s["input_ids"].tolist() == window[:-1].tolist() and s["labels"].tolist() == window[1:].tolist()


def test_doc_boundary_masking(store):
    seq = 16
    ds = PackedDataset(store, seq, respect_doc_boundaries=True)
    stream = store[:].astype(np.int64)
    starts = set(store.doc_offsets[1:-1].tolist())
    masked = 0
    for i in range(len(ds)):
        labels = ds[i]["labels"]
        for t in range(seq):
            target = i * seq + t + 1
            if target in starts:  # a token of one document would predict the first token of the next
                assert labels[t] == IGNORE_INDEX
                assert stream[target - 1] == 256  # ... which is the previous document's EOS
                masked += 1
            else:
                assert labels[t] == stream[target]
    assert masked == sum(1 for s in starts if s <= len(ds) * seq)


def test_document_masking_ids_and_positions(store):
    """doc_ids count the documents begun so far in the window (the piece it starts in is document 0), positions
    restart at each start; labels as with respect_doc_boundaries. Without masking, no extra keys."""
    seq = 16
    ds = PackedDataset(store, seq, document_masking=True)
    plain = PackedDataset(store, seq, respect_doc_boundaries=True)
    starts = set(store.doc_offsets.tolist())
    multi = 0
    for i in range(len(ds)):
        s, ref = ds[i], plain[i]
        assert s["input_ids"].tolist() == ref["input_ids"].tolist() and s["labels"].tolist() == ref["labels"].tolist()
        doc, pos = 0, 0
        for t in range(seq):
            if t and i * seq + t in starts:
                doc, pos = doc + 1, 0
            assert (s["doc_ids"][t], s["position_ids"][t]) == (doc, pos), (i, t)
            pos += 1
        multi += doc > 0
    assert multi > len(ds) // 2 and set(plain[0]) == {"input_ids", "labels"}
    batch = {k: torch.from_numpy(np.stack([ds[i][k] for i in range(len(ds))])) for k in ds[0]}
    single = [i for i in range(len(ds)) if ds[i]["doc_ids"][-1] == 0]
    assert single and set(single_documents_dropped(batch)) == set(batch)  # some row holds several: kept
    one_each = {k: v[single] for k, v in batch.items()}
    assert set(single_documents_dropped(one_each)) == {"input_ids", "labels"}  # positions were 0 .. s-1
    assert (one_each["position_ids"] == torch.arange(seq)).all()


def test_packed_loader_batches_are_long_tensors(store):
    loader = packed_loader(store.path, seq_len=8, micro_batch_size=4, respect_doc_boundaries=True)
    batch = next(loader)
    assert set(batch) == {"input_ids", "labels"}
    assert batch["input_ids"].dtype == torch.long and batch["input_ids"].shape == (4, 8)
    assert batch["labels"].shape == (4, 8)
    loader.close()


def test_dp_ranks_are_disjoint_and_cover_the_epoch():
    n, mbs, dp = 48, 2, 3
    per_rank = [[i for b in _take(ResumableLoader(IndexDataset(n), mbs, dp_rank=r, dp_size=dp, seed=3,
                                                  num_epochs=1), n // (mbs * dp)) for i in _ids(b)]
                for r in range(dp)]
    flat = [i for ids in per_rank for i in ids]
    assert len(flat) == len(set(flat)) == n  # disjoint, and together every sample of the epoch
    assert all(len(ids) == n // dp for ids in per_rank)
    # With a tail that does not fill a global micro-batch, every rank still gets the same number of batches.
    loaders = [ResumableLoader(IndexDataset(50), mbs, dp_rank=r, dp_size=dp, num_epochs=1) for r in range(dp)]
    counts = [sum(1 for _ in ld) for ld in loaders]
    assert counts == [8, 8, 8] and all(len(ld) == 8 for ld in loaders)


def test_order_is_deterministic_from_the_seed_and_changes_per_epoch():
    def epochs(seed):
        loader = ResumableLoader(IndexDataset(20), 5, seed=seed, num_epochs=2, prefetch=0)
        ids = [i for b in loader for i in _ids(b)]
        return ids[:20], ids[20:]

    a0, a1 = epochs(7)
    assert (a0, a1) == epochs(7)
    assert sorted(a0) == sorted(a1) == list(range(20)) and a0 != a1
    assert epochs(8)[0] != a0
    unshuffled = ResumableLoader(IndexDataset(10), 5, shuffle=False, num_epochs=1)
    assert [i for b in unshuffled for i in _ids(b)] == list(range(10))


@pytest.mark.parametrize("prefetch,masking", [(0, False), (3, False), (3, True)])
def test_exact_resume_across_an_epoch_boundary(store, prefetch, masking):
    def make():
        return packed_loader(store, seq_len=8, micro_batch_size=2, dp_rank=1, dp_size=2, seed=11,
                             respect_doc_boundaries=True, prefetch=prefetch, document_masking=masking)

    straight = make()
    per_epoch = len(straight)
    n, k = per_epoch + 5, per_epoch - 2  # resume shortly before the epoch ends, run into the next one
    expected = _take(straight, n)
    straight.close()

    first = make()
    got = _take(first, k)
    state = first.state_dict()
    first.close()
    assert state["epoch"] == 0 and state["consumed_in_epoch"] == k * 2 * 2
    resumed = make()
    resumed.load_state_dict(state)
    got += _take(resumed, n - k)
    assert _same(got, expected) and ("doc_ids" in got[0]) == masking
    assert resumed.state_dict()["epoch"] == 1 and resumed.consumed_samples == n * 4
    resumed.close()


def test_state_dict_counts_only_what_the_consumer_received():
    loader = ResumableLoader(IndexDataset(40), 2, seed=1, prefetch=4)
    _take(loader, 3)
    time.sleep(0.05)  # the prefetch thread has run ahead by now
    assert loader.state_dict()["consumed_in_epoch"] == 6
    rest = _take(loader, 4)
    loader.load_state_dict({"epoch": 0, "consumed_in_epoch": 6, "seed": 1})
    assert _same(_take(loader, 4), rest)  # load_state_dict also rewinds a live loader
    loader.close()


def test_resume_with_another_dp_size_and_state_validation():
    full = [i for b in _take(ResumableLoader(IndexDataset(24), 4, seed=5, prefetch=0), 6) for i in _ids(b)]
    two = [ResumableLoader(IndexDataset(24), 2, dp_rank=r, dp_size=2, seed=5, prefetch=0) for r in range(2)]
    for ld in two:
        ld.load_state_dict({"epoch": 0, "consumed_in_epoch": 8})
    rest = [i for _ in range(2) for ld in two for i in _ids(next(ld))]
    assert rest == full[8:16]  # the global order continues where dp=1 left it
    with pytest.raises(ValueError, match="seed"):
        two[0].load_state_dict({"epoch": 0, "consumed_in_epoch": 0, "seed": 6})
    with pytest.raises(ValueError, match="not a multiple"):
        two[0].load_state_dict({"epoch": 0, "consumed_in_epoch": 6})


def test_prefetch_yields_identical_batches_and_measures_waiting(store):
    sync = packed_loader(store, 8, 3, seed=2, prefetch=0, respect_doc_boundaries=True)
    threaded = packed_loader(store, 8, 3, seed=2, prefetch=2, respect_doc_boundaries=True)
    assert _same(_take(sync, 25), _take(threaded, 25))
    threaded.close()

    slow = ResumableLoader(IndexDataset(20, delay=0.01), 2, prefetch=2)
    _take(slow, 5)
    assert slow.wait_seconds > 0.05 and 0.3 < slow.wait_fraction <= 1.0  # the consumer was data-bound
    slow.reset_wait_stats()
    assert slow.wait_seconds == 0.0
    slow.close()


def test_errors_in_the_prefetch_thread_reach_the_consumer():
    class Broken(IndexDataset):
        def __getitem__(self, i):
            raise KeyError("bad sample")

    with pytest.raises(KeyError, match="bad sample"):
        next(ResumableLoader(Broken(10), 2))


def test_micro_batches_per_step():
    assert micro_batches_per_step(64, 4, 2) == 8
    assert micro_batches_per_step(8, 8, 1) == 1
    with pytest.raises(ValueError, match="not divisible by micro_batch_size 4 x dp_size 3 = 12"):
        micro_batches_per_step(64, 4, 3)
    with pytest.raises(ValueError, match="fewer than one global micro-batch"):
        ResumableLoader(IndexDataset(5), 3, dp_size=2)
    with pytest.raises(ValueError, match="dp_rank"):
        ResumableLoader(IndexDataset(5), 1, dp_rank=2, dp_size=2)
