"""Megatron-LM's indexed dataset (PREFIX.bin + PREFIX.idx): the .idx layout byte for byte, a dataset written by
Megatron-Core's own IndexedDatasetBuilder (committed fixture, sentence-split documents) read as a token store and
trained on by `tpzoo pretrain` exactly as the same tokens in tpzoo's store, bad files refused in one line, and,
with megatron-core installed, tpzoo's output read by its IndexedDataset unchanged."""
import json
import os
import struct
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from tpzoo.data import ByteTokenizer, MegatronStore, PackedDataset, open_store, preprocess
from tpzoo.errors import DataError
from tpzoo.testing import run_on_ranks
from tpzoo.train import load_config
from tpzoo.train.metrics import read_metrics

ROOT = Path(__file__).resolve().parents[1]
FIXTURES = ROOT / "tests" / "fixtures" / "megatron"
FIXTURE = FIXTURES / "tiny_text_document"  # made by make_fixture.py with Megatron-Core's IndexedDatasetBuilder
DOCS = [json.loads(line)["text"] for line in (FIXTURES / "docs.jsonl").read_text().splitlines()]


def test_idx_layout_byte_for_byte(tmp_path):
    """Two documents ("ab", "c") with EOD: the bytes Megatron-Core writes, spelled out from its layout."""
    preprocess(["ab", "c"], "byte", tmp_path / "d", format="megatron")
    expected = (b"MMIDIDX\x00\x00"                         # magic
                + (1).to_bytes(8, "little")                 # version
                + bytes([8])                                # dtype code 8: uint16 (a vocabulary under 65500)
                + (2).to_bytes(8, "little")                 # 2 sequences
                + (3).to_bytes(8, "little")                 # 3 document-index entries
                + struct.pack("<2i", 3, 2)                  # sequence lengths: a b EOD | c EOD
                + struct.pack("<2q", 0, 6)                  # byte offsets into the .bin
                + struct.pack("<3q", 0, 1, 2))              # document d = sequences [d, d + 1)
    assert (tmp_path / "d.idx").read_bytes() == expected
    assert (tmp_path / "d.bin").read_bytes() == struct.pack("<5H", 97, 98, 256, 99, 256)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["d.bin", "d.idx"]  # nothing else left behind


def test_a_megatron_written_dataset_reads_as_its_documents():
    store = open_store(FIXTURE)
    assert isinstance(store, MegatronStore) and store.dtype == np.dtype("<u2")
    assert store.num_sequences > store.num_docs == len(DOCS)  # sentence-split: documents of several sequences
    assert [store.doc(i).tolist() for i in range(store.num_docs)] == [list(d.encode()) + [256] for d in DOCS]
    assert isinstance(store.tokens, np.memmap) and open_store(f"{FIXTURE}.idx").num_tokens == store.num_tokens
    offsets = np.asarray(store.doc_offsets)  # the lazy offsets search like the array they stand for
    assert offsets.tolist() == np.cumsum([0] + [len(d.encode()) + 1 for d in DOCS]).tolist()
    for v in [0, 1, int(offsets[3]), int(offsets[3]) + 1, store.num_tokens, store.num_tokens + 5]:
        for side in ("left", "right"):
            assert store.doc_offsets.searchsorted(v, side) == np.searchsorted(offsets, v, side), (v, side)


def test_the_same_samples_as_the_same_tokens_in_a_tpzoo_store(tmp_path):
    ours = preprocess(DOCS, "byte", tmp_path / "store")
    theirs = open_store(FIXTURE)
    a = PackedDataset(ours, 16, document_masking=True)
    b = PackedDataset(theirs, 16, document_masking=True, check_tokenizer=ByteTokenizer())
    assert len(a) == len(b) > 100
    for i in range(len(a)):
        assert all(np.array_equal(a[i][k], b[i][k]) for k in a[i]), i


def test_bad_files_are_one_line_errors(tmp_path):
    import shutil

    def copy(name):
        for ext in (".bin", ".idx"):
            shutil.copy(f"{FIXTURE}{ext}", tmp_path / f"{name}{ext}")
        return tmp_path / name

    p = copy("noidx")
    os.remove(f"{p}.idx")
    cases = [(p, f"{p}: Megatron dataset index {p}.idx is missing ({p}.bin exists)")]
    p = copy("nobin")
    os.remove(f"{p}.bin")
    cases.append((p, f"{p}: Megatron dataset data file {p}.bin is missing ({p}.idx exists)"))
    p = copy("short")
    size = os.path.getsize(f"{p}.bin")
    os.truncate(f"{p}.bin", size - 10)
    cases.append((p, f"{p}.bin: {size - 10} bytes, but {p}.idx describes {size} ({size // 2} tokens of uint16): "
                     f"truncated"))
    p = copy("shortidx")
    os.truncate(f"{p}.idx", os.path.getsize(f"{p}.idx") - 8)
    cases.append((p, f"{p}.idx: {os.path.getsize(f'{p}.idx')} bytes, but its header"))
    p = copy("magic")
    raw = bytearray(Path(f"{p}.idx").read_bytes())
    raw[:7] = b"NOTMMID"
    Path(f"{p}.idx").write_bytes(raw)
    cases.append((p, f"{p}.idx: not a Megatron indexed dataset index (no MMIDIDX header)"))
    p = copy("float")
    raw[:7] = b"MMIDIDX"
    raw[17] = 6  # float64 tokens
    Path(f"{p}.idx").write_bytes(raw)
    cases.append((p, f"{p}.idx: token dtype code 6 is not an integer type"))
    for prefix, says in cases:
        with pytest.raises(DataError) as e:
            open_store(prefix)
        assert str(e.value).startswith(says) and "\n" not in str(e.value), str(e.value)


def test_a_mismatched_tokenizer_is_refused_naming_both(tmp_path):
    from tpzoo.data.megatron import write_index
    from tpzoo.train.data import token_store_for

    ids = np.array([5, 300, 2, 7], dtype="<u2")  # made with a bigger vocabulary than the byte tokenizer's 259
    ids.tofile(tmp_path / "big.bin")
    write_index(tmp_path / "big.idx", ids.dtype, np.array([0, 2, 4]))
    with pytest.raises(DataError, match=r"big: token id 300 is outside the vocabulary of the tokenizer 'byte' "
                                        r"\(vocab_size 259\)"):
        token_store_for([str(tmp_path / "big")], ByteTokenizer(), str(tmp_path / "cache"))
    window = PackedDataset(MegatronStore(tmp_path / "big"), 2, check_tokenizer=ByteTokenizer())
    with pytest.raises(DataError, match="token id 300 is outside"):  # and every window read is checked too
        window[0]

    class Bigger(ByteTokenizer):
        spec, vocab_size = "bigger", 512

    store = preprocess(["ab"], "byte", tmp_path / "store")
    with pytest.raises(DataError, match=r"store was tokenized with 'byte' \(vocab_size 259\), but this run's "
                                        r"tokenizer is 'bigger' \(vocab_size 512\)"):
        token_store_for([str(store.path)], Bigger(), str(tmp_path / "cache"))


def _train(cfg):
    from tpzoo.train import train

    return train(cfg)


def test_pretrain_on_a_megatron_dataset_equals_the_same_tokens_in_tpzoo_format(tmp_path):
    """`tpzoo pretrain --data PREFIX` (the command as typed) and a run on the tpzoo store of the same documents:
    the same per-step losses, bit for bit."""
    store = preprocess(DOCS, "byte", tmp_path / "store")
    args = dict(model="nano-gpt", tp=1, seq_len=16, global_batch_size=4, micro_batch_size=2, steps=4, seed=0,
                warmup_steps=2, eval_fraction=0.0, sample_prompt="", document_masking=True)
    flags = [x for k, v in args.items() for x in ((f"--{k.replace('_', '-')}",) if v is True
                                                  else (f"--{k.replace('_', '-')}", str(v)))]
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE")}
    r = subprocess.run([sys.executable, "-m", "tpzoo", "pretrain", "--data", str(FIXTURE), "--save", "",
                        "--log-dir", str(tmp_path / "log"), *flags], cwd=tmp_path, env=env, capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    assert f"data {FIXTURE}" in r.stdout
    ref = run_on_ranks(1, _train, load_config(None, dict(args, data=[str(store.path)], save="", quiet=True)))[0]
    assert [row["loss"] for row in read_metrics(str(tmp_path / "log"))] == ref["losses"]


# -- with Megatron-Core itself (pip install megatron-core; in the dev extra) ------------------------------------

@pytest.fixture(scope="module")
def megatron_core():
    return pytest.importorskip("megatron.core.datasets.indexed_dataset")


def test_megatron_core_reads_what_tpzoo_writes(tmp_path, megatron_core):
    """What `preprocess --format megatron` writes (2 workers; the command itself: test_data_preprocess.py) opens
    with IndexedDataset, every document's tokens equal; a vocabulary past 65500 gives int32 tokens, as Megatron's
    preprocessing writes them."""
    preprocess(DOCS, "byte", tmp_path / "docs_text_document", format="megatron", workers=2, batch_docs=3)
    ds = megatron_core.IndexedDataset(str(tmp_path / "docs_text_document"))
    assert len(ds) == len(DOCS) and ds.index.dtype == np.uint16
    assert ds.document_indices.tolist() == list(range(len(DOCS) + 1))
    assert [ds[i].tolist() for i in range(len(ds))] == [list(d.encode()) + [256] for d in DOCS]

    class Wide(ByteTokenizer):  # ids past 65535: Megatron's int32
        spec, vocab_size, eos_id = "wide", 70_000, 69_999

        def encode(self, text):
            return [65_600 + b for b in text.encode()]

    preprocess(DOCS[:3], Wide(), tmp_path / "wide", format="megatron", save_tokenizer=False)
    wide = megatron_core.IndexedDataset(str(tmp_path / "wide"))
    assert wide.index.dtype == np.int32
    assert [wide[i].tolist() for i in range(3)] == [[65_600 + b for b in d.encode()] + [69_999] for d in DOCS[:3]]


def test_the_committed_fixture_is_what_megatron_core_writes(tmp_path, megatron_core):
    sys.path.insert(0, str(FIXTURES))
    try:
        import make_fixture
    finally:
        sys.path.remove(str(FIXTURES))
    make_fixture.build(tmp_path / "again")
    for ext in (".bin", ".idx"):
        assert (tmp_path / f"again{ext}").read_bytes() == Path(f"{FIXTURE}{ext}").read_bytes()
    ds = megatron_core.IndexedDataset(str(FIXTURE))
    store = MegatronStore(FIXTURE)
    for d in range(store.num_docs):  # a document = its sequences, in Megatron's reading too
        first, last = ds.document_indices[d], ds.document_indices[d + 1]
        assert np.concatenate([ds[s] for s in range(first, last)]).tolist() == store.doc(d).tolist()
