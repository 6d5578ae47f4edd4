"""tpzoo.data.sources: documents from text, JSONL, Parquet, directories, the hub (offline error), the stdlib."""
import json
import sys
import sysconfig
from pathlib import Path

import pytest

from tpzoo.data import SourceError, default_corpus, expand_paths, iter_documents


def _jsonl(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")
    return path


def test_text_file_is_one_whole_document(tmp_path):
    p = tmp_path / "a.txt"
    p.write_text("line one\nline two\n\nafter a blank — ünïcode\n", encoding="utf-8")
    assert list(iter_documents(p)) == [p.read_text(encoding="utf-8")]
    (tmp_path / "empty.txt").write_text("")
    assert list(iter_documents(tmp_path / "empty.txt")) == []  # empty documents are skipped


def test_jsonl_default_and_custom_field(tmp_path):
    p = _jsonl(tmp_path / "d.jsonl", [{"text": "first", "id": 1}, {"text": "second\nwith newline"},
                                      {"text": ""}, {"text": "third"}])
    with p.open("a") as f:
        f.write("\n")  # a trailing blank line is fine
    assert list(iter_documents(p)) == ["first", "second\nwith newline", "third"]
    q = _jsonl(tmp_path / "c.jsonl", [{"body": "x"}, {"body": "y"}])
    assert list(iter_documents(q, text_field="body")) == ["x", "y"]
    with pytest.raises(SourceError, match=r"c\.jsonl:1: record has no field 'text'"):
        list(iter_documents(q))
    arr = tmp_path / "arr.json"
    arr.write_text(json.dumps([{"text": "a"}, {"text": "b"}]))
    assert list(iter_documents(arr)) == ["a", "b"]


def test_parquet_column(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    texts = [f"document number {i} " * (i % 3 + 1) for i in range(2500)]  # more than one record batch
    pq.write_table(pa.table({"text": texts, "n": list(range(2500))}), tmp_path / "d.parquet", row_group_size=700)
    assert list(iter_documents(tmp_path / "d.parquet")) == texts
    with pytest.raises(SourceError, match="no column 'body'"):
        list(iter_documents(tmp_path / "d.parquet", text_field="body"))


def test_directory_is_recursive_sorted_and_skips_hidden_and_unknown(tmp_path):
    root = tmp_path / "corpus"
    (root / "b" / "nested").mkdir(parents=True)
    (root / ".hidden").mkdir()
    (root / "z.txt").write_text("Z")
    (root / "a.txt").write_text("A")
    (root / "b" / "nested" / "c.md").write_text("C")
    _jsonl(root / "b" / "d.jsonl", [{"text": "D1"}, {"text": "D2"}])
    (root / ".hidden" / "h.txt").write_text("hidden")
    (root / "b" / "image.png").write_bytes(b"\x89PNG")
    names = [p.relative_to(root).as_posix() for p in expand_paths([root])]
    assert names == ["a.txt", "b/d.jsonl", "b/nested/c.md", "z.txt"]
    assert list(iter_documents([root, root / "a.txt"])) == ["A", "D1", "D2", "C", "Z", "A"]


def test_missing_and_unsupported_paths(tmp_path):
    with pytest.raises(FileNotFoundError):
        list(iter_documents(tmp_path / "missing.txt"))
    with pytest.raises(FileNotFoundError):
        list(iter_documents("./no/such/dir"))
    (tmp_path / "x.bin").write_bytes(b"\0")
    with pytest.raises(SourceError, match="unsupported file type"):
        list(iter_documents(tmp_path / "x.bin"))


def test_hub_dataset_offline_gives_a_clear_error(monkeypatch):
    import datasets

    def offline(*args, **kwargs):
        raise ConnectionError("Couldn't reach the Hugging Face Hub (offline)")

    monkeypatch.setattr(datasets, "load_dataset", offline)
    with pytest.raises(SourceError, match="not a local file or directory.*hub dataset failed.*ConnectionError"):
        list(iter_documents("some-owner/some-dataset"))


def test_hub_dataset_records_are_read_through_datasets(monkeypatch):
    import datasets

    seen = {}

    def fake(name, config, split, streaming):
        seen.update(name=name, config=config, split=split, streaming=streaming)
        return [{"text": "one"}, {"text": ""}, {"text": "two"}]

    monkeypatch.setattr(datasets, "load_dataset", fake)
    assert list(iter_documents("hf:owner/ds:cfg@validation")) == ["one", "two"]
    assert seen == {"name": "owner/ds", "config": "cfg", "split": "validation", "streaming": True}


def test_default_corpus_is_the_stdlib_without_tests():
    files = default_corpus()
    root = Path(sysconfig.get_paths()["stdlib"])
    rel = [f.relative_to(root).as_posix() for f in files]
    assert rel == sorted(rel) and files == default_corpus()
    assert "os.py" in rel and "json/__init__.py" in rel
    assert len(files) > 100 and all(f.suffix == ".py" for f in files)
    assert not any(part in ("test", "tests", "site-packages", "idle_test") for r in rel for part in r.split("/"))
    assert sys.version_info >= (3, 10)
