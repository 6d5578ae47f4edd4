"""tpzoo.data.token_store: preprocess round trip, memmap access, dtype choice, streaming, atomic output."""
import json

import numpy as np
import pytest

from tpzoo.data import ByteTokenizer, TokenStore, load_tokenizer, preprocess, train_bpe

DOCS = ["first document\n", "", "second — ünïcode 🙂", "x", "a much longer third document " * 20]


class BigVocabTokenizer(ByteTokenizer):
    """Byte ids shifted past 65536, to force a uint32 store."""

    spec = "big-test"
    vocab_size = 70_000
    eos_id = 69_999

    def encode(self, text):
        return [65_600 + b for b in text.encode("utf-8")]


def test_round_trip_equals_direct_tokenization(tmp_path):
    tok = ByteTokenizer()
    store = preprocess(DOCS, "byte", tmp_path / "store", sources=["inline"])
    expected = [tok.encode(d) + [tok.eos_id] for d in DOCS if d]
    assert store.num_docs == len(expected) == len(store.doc_offsets) - 1
    assert [store.doc(i).tolist() for i in range(store.num_docs)] == expected
    stream = [t for doc in expected for t in doc]
    assert len(store) == len(stream) and store[:].tolist() == stream and store[5] == stream[5]
    assert store.doc_offsets[0] == 0 and store.doc_offsets[-1] == len(stream)
    assert store.doc_index(0) == 0 and store.doc_index(len(stream) - 1) == store.num_docs - 1
    assert store.doc_index(int(store.doc_offsets[2])) == 2 and store.doc_index(int(store.doc_offsets[2]) - 1) == 1

    assert isinstance(store.tokens, np.memmap) and store.tokens.mode == "r"  # never loaded whole
    assert store.dtype == np.dtype("<u2") and (tmp_path / "store" / "tokens.bin").stat().st_size == 2 * len(stream)
    index = json.loads((tmp_path / "store" / "index.json").read_text())
    assert index["dtype"] == "uint16" and index["num_tokens"] == len(stream) and index["sources"] == ["inline"]
    assert index["tokenizer"]["spec"] == "byte" and index["tokenizer"]["vocab_size"] == 259
    assert isinstance(store.load_tokenizer(), ByteTokenizer)
    assert isinstance(load_tokenizer(tmp_path / "store"), ByteTokenizer)  # the store carries its tokenizer
    assert "".join(tok.decode(store.doc(i)) for i in range(store.num_docs)) == "".join(DOCS)


def test_options_bos_and_no_eos(tmp_path):
    store = preprocess(["ab", "c"], "byte", tmp_path / "s", append_eos=False, prepend_bos=True)
    assert store[:].tolist() == [257, 97, 98, 257, 99]


def test_uint32_when_the_vocabulary_needs_it(tmp_path):
    store = preprocess(["hi", "there"], BigVocabTokenizer(), tmp_path / "s", save_tokenizer=False)
    assert store.dtype == np.dtype("<u4")
    assert store.doc(1).tolist() == [65_600 + b for b in b"there"] + [69_999]


def test_bpe_store_matches_the_tokenizer(tmp_path):
    tok = train_bpe(DOCS * 3, vocab_size=300, out_dir=tmp_path / "bpe")
    store = preprocess(DOCS, tmp_path / "bpe", tmp_path / "s")
    assert [store.doc(i).tolist() for i in range(store.num_docs)] == [tok.encode(d) + [tok.eos_id] for d in DOCS if d]
    assert store.load_tokenizer().encode("document") == tok.encode("document")


def test_streams_documents_in_batches(tmp_path):
    pulled = []

    def docs():
        for i in range(50):
            pulled.append(i)
            yield f"doc {i} " * 3

    seen_at_first_progress = []
    store = preprocess(docs(), "byte", tmp_path / "s", batch_docs=8,
                       on_progress=lambda d, t: seen_at_first_progress.append(len(pulled)))
    assert seen_at_first_progress[0] <= 9  # the first batch was written before the rest was read
    assert store.num_docs == 50 and len(seen_at_first_progress) == 7


def test_refuses_an_existing_dir_and_force_replaces_it(tmp_path):
    out = tmp_path / "s"
    preprocess(["old"], "byte", out)
    with pytest.raises(FileExistsError, match="already exists"):
        preprocess(["new"], "byte", out)
    assert TokenStore(out).doc(0).tolist()[:3] == list(b"old")
    preprocess(["new!"], "byte", out, force=True)
    assert TokenStore(out).doc(0).tolist()[:4] == list(b"new!")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["s"]  # no temp or old dirs left behind


def test_a_failure_leaves_nothing_behind(tmp_path):
    def docs():
        yield "fine"
        raise RuntimeError("source broke")

    with pytest.raises(RuntimeError, match="source broke"):
        preprocess(docs(), "byte", tmp_path / "s", batch_docs=1)
    assert list(tmp_path.iterdir()) == []


def test_empty_corpus_gives_an_empty_store(tmp_path):
    store = preprocess([], "byte", tmp_path / "s")
    assert len(store) == 0 and store.num_docs == 0 and store.doc_offsets.tolist() == [0]
