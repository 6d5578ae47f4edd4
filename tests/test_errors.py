"""User errors end in one line `tpzoo <command>: error: ...` and exit status 2, once per job however many ranks
hit them; --debug adds the traceback; a bug keeps its traceback."""
import subprocess
import sys

import pytest

from checkpoint_helpers import write_hf

pytestmark = pytest.mark.faults


def tpzoo(*args, cwd, env=None):
    import os

    return subprocess.run([sys.executable, "-m", "tpzoo", *args], capture_output=True, text=True, cwd=cwd,
                          timeout=300, env={**os.environ, **(env or {})})


def one_error_line(proc, command: str, *needles: str) -> str:
    assert proc.returncode == 2, proc.stdout + proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.startswith(f"tpzoo {command}: error: ")]
    assert len(lines) == 1, proc.stderr
    assert "Traceback" not in proc.stderr, proc.stderr
    for n in needles:
        assert n in lines[0], lines[0]
    return lines[0]


def test_an_unknown_model_is_one_line(tmp_path):
    one_error_line(tpzoo("plan", "--model", "no-such-model", "--gpus", "8", "--gpu-memory", "80", "--seq-len", "8",
                         "--global-batch-size", "8", cwd=tmp_path), "plan", "unknown model 'no-such-model'")


def test_an_error_on_every_rank_is_reported_once_and_debug_shows_the_traceback(tmp_path):
    """A damage only the ranks can see (a checksum, checked as they load their slices): both ranks of tp=2 read
    the one tp=1 shard, both fail, one line is printed."""
    from tpzoo.checkpoint import convert_from_hf

    write_hf("llama", tmp_path / "hf")
    convert_from_hf(tmp_path / "hf", tmp_path / "ckpt", tp=1, pp=1, progress=False)
    shard = tmp_path / "ckpt" / "model-tp00-pp00.safetensors"
    data = bytearray(shard.read_bytes())
    data[-3] ^= 0x01
    shard.write_bytes(bytes(data))
    args = ("generate", str(tmp_path / "ckpt"), "--prompt", "x", "--tp", "2", "--device", "cpu")
    one_error_line(tpzoo(*args, cwd=tmp_path), "generate", "model-tp00-pp00.safetensors", "checksum")
    debug = tpzoo(*args, "--debug", cwd=tmp_path)
    assert debug.returncode == 2 and "Traceback" in debug.stderr and "CheckpointError" in debug.stderr


def test_an_unknown_flag_names_the_closest_known_one(tmp_path):
    one_error_line(tpzoo("pretrain", "--learning-rate", "1e-3", cwd=tmp_path), "pretrain",
                   "unrecognized argument --learning-rate; did you mean --lr?")
    one_error_line(tpzoo("convert", "from-hf", "a", "b", "--tpp", "2", cwd=tmp_path), "convert",
                   "unrecognized argument --tpp; did you mean --tp?")


def test_a_reader_that_leaves_early_is_no_error(tmp_path):
    """`tpzoo plan ... | head -1`: the pipe closes under the command; no BrokenPipeError traceback."""
    proc = subprocess.Popen([sys.executable, "-m", "tpzoo", "plan", "--model", "llama-3-8b", "--gpus", "8",
                             "--gpu-memory", "80", "--seq-len", "8192", "--global-batch-size", "128", "--top", "1000",
                             "--json"],  # more than a pipe holds: the command is still writing when the pipe closes
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=tmp_path)
    proc.stdout.readline()
    proc.stdout.close()
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=120) == 0 and "Traceback" not in err and "BrokenPipe" not in err, err
