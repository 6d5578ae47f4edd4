"""`tpzoo preprocess` end to end, in a subprocess like a user would run it."""
import json
import os
import re
import subprocess
import sys
from pathlib import Path

from tpzoo.cli import main
from tpzoo.data import ByteTokenizer, TokenStore, iter_documents

ROOT = Path(__file__).resolve().parents[1]


def _run(*args):
    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    return subprocess.run([sys.executable, "-m", "tpzoo", "preprocess", *args], capture_output=True, text=True,
                          env=env, cwd=ROOT, timeout=120)


def test_preprocess_command_end_to_end(tmp_path, capsys):
    data = tmp_path / "data"
    (data / "sub").mkdir(parents=True)
    (data / "a.txt").write_text("alpha document\n")
    (data / "sub" / "b.txt").write_text("beta — ünïcode 🙂")
    (data / "c.jsonl").write_text("".join(json.dumps({"body": f"record {i}"}) + "\n" for i in range(3)))
    out = tmp_path / "store"

    r = _run("--data", str(data), "--tokenizer", "byte", "--out", str(out), "--text-field", "body")
    assert r.returncode == 0, r.stderr
    store = TokenStore(out)
    docs = list(iter_documents(data, text_field="body"))
    tok = ByteTokenizer()
    assert store.num_docs == len(docs) == 5
    assert store[:].tolist() == [t for d in docs for t in tok.encode(d) + [tok.eos_id]]
    summary = r.stdout.strip().splitlines()[-1]
    m = re.fullmatch(r"preprocess: (\d+) docs, (\d+) tokens, (\d+) bytes \(uint16\), [\d.]+ s -> .*", summary)
    assert m and (int(m[1]), int(m[2]), int(m[3])) == (5, len(store), 2 * len(store)), summary
    assert "doc" in r.stderr  # the progress bar

    # The rest in-process (the same code path, without paying for another interpreter start).
    assert main(["preprocess", "--data", str(data), "--tokenizer", "byte", "--out", str(out)]) == 2
    assert "already exists" in capsys.readouterr().err
    assert main(["preprocess", "--data", str(data / "a.txt"), "--tokenizer", "byte", "--out", str(out),
                 "--force", "--quiet"]) == 0
    assert TokenStore(out).num_docs == 1
