"""Shared by the bad-input tests (test_faults_config.py, test_faults_data.py): run a command so that starting a
rank is impossible, check its one error line, and prove that its inputs were left untouched.

Two ways to run a command, both with tpzoo.commands.launch.run_multirank (the one way any command starts ranks)
replaced, so an error that shows up proves it was found before any rank started, and both checking that the
files named on the command line (the inputs) are byte for byte unchanged afterwards:
  - `cli(...)`: tpzoo.cli.main in this process (milliseconds; starting a rank fails the test);
  - `cli_process(...)`: a real `python` process (the exit status and stderr a user sees; a rank start exits 99).
"""
from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

# `python -m tpzoo ARGS`, except that starting ranks exits with status 99 instead.
NO_RANKS = ("import sys, tpzoo.commands.launch as launch; "
            "launch.run_multirank = lambda *a, **k: sys.exit(99); "
            "from tpzoo.cli import main; sys.exit(main(sys.argv[1:]))")


def cli(monkeypatch, capsys, *args) -> tuple[int, str]:
    """(exit status, stderr) of `tpzoo ARGS` run in this process; a rank start raises AssertionError. The files
    and directories named in ARGS (its inputs) must be byte for byte the same afterwards."""
    import tpzoo.commands.launch as launch
    from tpzoo.cli import main

    def no_ranks(*a, **k):
        raise AssertionError("a rank was started: the error was not found before spawning")

    monkeypatch.setattr(launch, "run_multirank", no_ranks)
    before = snapshot(*args)
    try:
        rc = main([str(a) for a in args])
    except SystemExit as e:  # argparse's own errors
        rc = e.code
    assert snapshot(*args) == before, "a failed run changed its input files"
    return rc, capsys.readouterr().err


def cli_process(*args, cwd) -> tuple[int, str]:
    """The same in a real `python` process (starting a rank exits 99)."""
    before = snapshot(*args)
    proc = subprocess.run([sys.executable, "-c", NO_RANKS, *map(str, args)], capture_output=True, text=True,
                          cwd=cwd, timeout=120, env={**os.environ, "TPZOO_DEBUG": ""})
    assert snapshot(*args) == before, "a failed run changed its input files"
    return proc.returncode, proc.stderr


def one_error_line(rc: int, stderr: str, command: str, *needles: str) -> str:
    """Exit status 2, exactly one `tpzoo COMMAND: error:` line holding every needle, no traceback."""
    assert rc == 2, f"exit status {rc}: {stderr}"
    lines = [line for line in stderr.splitlines() if line.startswith(f"tpzoo {command}: error: ")]
    assert len(lines) == 1, stderr
    assert "Traceback" not in stderr, stderr
    for needle in needles:
        assert needle in lines[0], lines[0]
    return lines[0]


def snapshot(*args) -> dict[str, str]:
    """sha256 of every file named by, or under a directory named by, an argument that is an existing path."""
    out = {}
    for arg in args:
        root = Path(str(arg))
        if not root.is_absolute() or not root.exists():
            continue  # a flag or a value; the tests give every input path absolute
        files = [root] if root.is_file() else sorted(p for p in root.rglob("*") if p.is_file())
        for f in files:
            out[str(f)] = hashlib.sha256(f.read_bytes()).hexdigest()
    return out


LLAMA_CONFIG = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "vocab_size": 300,
                "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2, "num_attention_heads": 8,
                "num_key_value_heads": 2, "max_position_embeddings": 128}


def hf_config_dir(path, **changes) -> Path:
    """A Hugging Face model directory holding only config.json: all that preflight reads of a --base (the
    weights are read by the ranks). Vocabulary 300, so that the byte tokenizer (259) fits."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps({**LLAMA_CONFIG, **changes}))
    return path


@pytest.fixture(scope="session")
def hf_gpt2(tmp_path_factory) -> Path:
    """A real tiny GPT-2 Hugging Face directory (4 heads, 2 layers, learned positions up to 128), for eval and
    generate, which open the checkpoint's weight headers before spawning."""
    from checkpoint_helpers import write_hf

    path = tmp_path_factory.mktemp("hf") / "gpt2"
    write_hf("gpt2", path)
    return path
