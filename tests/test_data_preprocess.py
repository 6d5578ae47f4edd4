"""preprocess on N worker processes: the same bytes as one worker (both formats, a BPE tokenizer), resumable after a
kill from its completed chunks, a partial run of other settings discarded, one writer at a time."""
import fcntl
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import tpzoo.data.preprocessing as pre
from tpzoo.data import TokenStore, iter_documents, preprocess, train_bpe

ROOT = Path(__file__).resolve().parents[1]
TEXTS = [f"document {i}: " + "the quick brown fox jumps over the lazy dog. " * (1 + i % 7) + "é🙂" * (i % 3)
         for i in range(300)]


@pytest.fixture(scope="module")
def bpe(tmp_path_factory):
    out = tmp_path_factory.mktemp("bpe") / "tok"
    train_bpe(TEXTS, vocab_size=400, out_dir=out)
    return str(out)


def files_of(path: Path) -> dict[str, bytes]:
    return {str(p.relative_to(path)): p.read_bytes() for p in sorted(path.rglob("*")) if p.is_file()}


def test_workers_write_the_same_bytes_as_one(tmp_path, bpe):
    for fmt in ("tpzoo", "megatron"):
        out = {w: tmp_path / f"{fmt}-{w}" for w in (1, 3)}
        for w, path in out.items():  # small chunks: many in flight, out of order in the pool
            preprocess(TEXTS, bpe, path, workers=w, format=fmt, batch_docs=7)
        if fmt == "tpzoo":
            a, b = files_of(out[1]), files_of(out[3])
            assert a.keys() == b.keys() and a == b
            assert TokenStore(out[1]).num_docs == len(TEXTS)
        else:
            for ext in (".bin", ".idx"):
                assert Path(f"{out[1]}{ext}").read_bytes() == Path(f"{out[3]}{ext}").read_bytes()
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(".")) == []  # no partial dirs, locks


def test_the_command_with_two_workers_equals_one_in_process(tmp_path, bpe):
    """`tpzoo preprocess --format megatron --workers 2` as typed, against one worker in process."""
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    for i in range(0, len(TEXTS), 50):
        (corpus / f"part{i:03d}.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in TEXTS[i:i + 50]))
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE")}
    r = subprocess.run([sys.executable, "-m", "tpzoo", "preprocess", "--data", str(corpus), "--tokenizer", bpe,
                        "--format", "megatron", "--out", str(tmp_path / "two"), "--workers", "2"],
                       capture_output=True, text=True, env=env, cwd=ROOT, timeout=300)
    assert r.returncode == 0, r.stderr
    assert "preprocess (2 workers)" in r.stderr and "tok/s" in r.stderr  # the bar counts tokens
    assert r.stdout.strip().endswith(f"-> {tmp_path / 'two'} (.bin + .idx)")
    preprocess(iter_documents(corpus), bpe, tmp_path / "one", workers=1, format="megatron")
    for ext in (".bin", ".idx"):
        assert (tmp_path / f"two{ext}").read_bytes() == (tmp_path / f"one{ext}").read_bytes()


class Interrupt(KeyboardInterrupt):
    pass


def test_a_killed_run_resumes_from_its_completed_chunks(tmp_path, bpe, monkeypatch):
    monkeypatch.setattr(pre, "_PROGRESS_EVERY_S", 0.0)  # record after every chunk
    straight = tmp_path / "straight"
    preprocess(TEXTS, bpe, straight, batch_docs=10, sources=["t"], resume=True)

    def killed_after(n):
        for i, t in enumerate(TEXTS):
            if i == n:
                raise Interrupt  # Ctrl-C (a SIGKILL leaves the same partial directory, without the traceback)
            yield t

    out = tmp_path / "store"
    with pytest.raises(Interrupt):
        preprocess(killed_after(125), bpe, out, batch_docs=10, workers=2, sources=["t"], resume=True)
    part = tmp_path / ".store.partial"
    done = json.loads((part / "progress.json").read_text())
    assert not out.exists() and done["docs"] % 10 == 0 and 0 < done["docs"] <= 125
    with (part / "tokens.bin").open("ab") as f:
        f.write(b"\x01\x02\x03")  # a chunk torn by the kill: dropped on resume

    progress = []
    preprocess(TEXTS, bpe, out, batch_docs=10, workers=2, sources=["t"], resume=True,
               on_progress=lambda d, t: progress.append(d))
    assert progress[0] == done["docs"] and sum(progress) == len(TEXTS)  # the done chunks were not encoded again
    assert files_of(out) == files_of(straight) and not part.exists()

    # a partial run of other settings (here another corpus) is not resumed but replaced
    with pytest.raises(Interrupt):
        preprocess(killed_after(125), bpe, tmp_path / "other", batch_docs=10, sources=["t"], resume=True)
    progress.clear()
    preprocess(TEXTS, bpe, tmp_path / "other", batch_docs=10, sources=["u"], resume=True,
               on_progress=lambda d, t: progress.append(d))
    assert progress == [10] * 30  # every chunk encoded, none taken from the other corpus's partial run
    assert files_of(tmp_path / "other")["tokens.bin"] == files_of(out)["tokens.bin"]


def test_one_writer_at_a_time(tmp_path):
    lock = tmp_path / ".s.partial.lock"
    fd = os.open(lock, os.O_RDWR | os.O_CREAT)
    fcntl.flock(fd, fcntl.LOCK_EX)  # another preprocess holds it
    try:
        with pytest.raises(FileExistsError, match=r"another preprocess is writing .*\.s\.partial"):
            preprocess(["x"], "byte", tmp_path / "s")
        assert lock.exists() and not (tmp_path / "s").exists()
    finally:
        os.close(fd)
    preprocess(["x"], "byte", tmp_path / "s")
    assert TokenStore(tmp_path / "s").num_docs == 1
