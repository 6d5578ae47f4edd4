"""Damaged checkpoints and killed conversions (issue 11, items 2 and 5): every reader runs the cheap structural
check first, every failure is one line naming the file or tensor (exit 2, no traceback), nothing is written
into the source, and a killed conversion's temporary directory is never a checkpoint and is removed by the
next conversion into the same destination (never while its process lives).

Most commands run in-process through tpzoo.cli.main (an exception that escapes it fails the test, which is the
"no traceback" check); eval and generate, and the killed writers, run as real processes.
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from safetensors.torch import load_file, save_file

from tpzoo.checkpoint import CheckpointError, convert_from_hf, is_checkpoint, load_model
from tpzoo.checkpoint.atomic import OWNER_FILE
from tpzoo.checkpoint.safetensors_io import file_checksum
from tpzoo.cli import main as cli

from checkpoint_helpers import TEXT, write_hf

pytestmark = pytest.mark.faults

ROOT = Path(__file__).resolve().parents[1]
SHARD0, SHARD1 = "model-tp00-pp00.safetensors", "model-tp01-pp00.safetensors"
QKV = "layers.0.attn.qkv.weight"


# --- fixtures and helpers -------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def base(tmp_path_factory):
    """A tiny llama with its tokenizer, as HF and as tpzoo checkpoints at tp=1 and tp=2."""
    root = tmp_path_factory.mktemp("faults")
    write_hf("llama", root / "hf", tokenizer=True)
    convert_from_hf(root / "hf", root / "t1", tp=1, pp=1, progress=False)
    convert_from_hf(root / "hf", root / "t2", tp=2, pp=1, progress=False)
    (root / "text.txt").write_text(TEXT)
    return root


def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def _hashes(directory: Path) -> dict:
    return {str(p.relative_to(directory)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(directory.rglob("*")) if p.is_file()}


def _edit_manifest(ckpt: Path, edit) -> None:
    m = json.loads((ckpt / "manifest.json").read_text())
    edit(m)
    (ckpt / "manifest.json").write_text(json.dumps(m))


def _rewrite_shard(ckpt: Path, name: str, change) -> None:
    """Rewrite a shard file with `change(tensors)` applied, and record its new size and checksum in the manifest:
    then only the header check can tell that it no longer matches its manifest entry."""
    path = ckpt / name
    tensors = load_file(path)
    change(tensors)
    save_file(tensors, path, metadata={"format": "pt"})

    def fix(m):
        entry = next(f for f in m["files"] if f["path"] == name)
        entry["bytes"] = path.stat().st_size
        entry["checksum"] = file_checksum(path, "crc32")
    _edit_manifest(ckpt, fix)


def _run(capsys, *argv) -> tuple[int, str, str]:
    rc = cli([str(a) for a in argv])
    out, err = capsys.readouterr()
    return rc, out, err


def _assert_one_line_error(rc: int, err: str, command: str, *names: str) -> str:
    """Exit status 2, exactly one `tpzoo <command>: error: ...` line naming every one of `names`, no traceback."""
    assert "Traceback" not in err, err
    lines = [line for line in err.splitlines() if line.startswith("tpzoo ")]
    assert rc == 2 and len(lines) == 1, (rc, err)
    assert lines[0].startswith(f"tpzoo {command}: error: "), lines
    for name in names:
        assert name in lines[0], (name, lines[0])
    return lines[0]


def _subprocess(args, cwd: Path, timeout: int = 240) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    env.pop("TPZOO_DEBUG", None)
    return subprocess.run([sys.executable, *map(str, args)], cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=timeout)


def _reader_commands(ckpt: Path, out: Path) -> list[tuple[str, list]]:
    """(command name in the error line, argv) of every in-process command that reads a tpzoo checkpoint."""
    return [("convert to-hf", ["convert", "to-hf", ckpt, out / "hf", "--quiet"]),
            ("convert to-hf", ["convert", "to-hf", ckpt, out / "hf", "--quiet", "--no-verify"]),
            ("reshard", ["reshard", ckpt, out / "re", "--tp", "1", "--quiet"])]


def _assert_readers_fail(capsys, ckpt: Path, out: Path, *names: str) -> None:
    """convert to-hf (with and without checksums) and reshard each end in one line naming `names`, write no
    output, and leave every file of the source as it was."""
    before = _hashes(ckpt)
    for command, argv in _reader_commands(ckpt, out):
        rc, _, err = _run(capsys, *argv)
        _assert_one_line_error(rc, err, command, *names)
    assert not (out / "hf").exists() and not (out / "re").exists()
    assert not [p for p in out.iterdir() if ".tmp-" in p.name]  # the failed writes left nothing
    assert _hashes(ckpt) == before


# --- manifest against its shards -------------------------------------------------------------------------------

def test_full_shape_contradicting_the_shards_fails_verify_and_every_reader(base, tmp_path, capsys):
    """The issue's case: `inspect --verify` reported every file ok and `convert to-hf` died with IndexError."""
    bad = _copy(base / "t2", tmp_path / "bad")
    _edit_manifest(bad, lambda m: m["tensors"]["layers.0.mlp.fc_out.weight"].update(shape=[64, 200]))
    for argv in (["inspect", bad, "--verify", "--no-tensors"], ["inspect", bad, "--no-tensors"]):
        rc, out, _ = _run(capsys, *argv)
        failed = [line for line in out.splitlines() if "FAILED" in line]
        assert rc == 1 and len(failed) == 1, out
        assert "layers.0.mlp.fc_out.weight" in failed[0] and "contradicts the shards" in failed[0]
    _assert_readers_fail(capsys, bad, tmp_path, "manifest.json", "layers.0.mlp.fc_out.weight")
    with pytest.raises(CheckpointError, match="layers.0.mlp.fc_out.weight"):
        load_model(bad, verify=False)


def test_full_shape_against_the_model_config(base, tmp_path, capsys):
    """Full shape and file entries changed together: still caught, against what the model config builds."""
    bad = _copy(base / "t1", tmp_path / "bad")

    def edit(m):
        m["tensors"]["final_norm.weight"]["shape"] = [32]
        m["files"][0]["tensors"]["final_norm.weight"]["shape"] = [32]
    _edit_manifest(bad, edit)
    _assert_readers_fail(capsys, bad, tmp_path, "manifest.json", "final_norm.weight", "[32]")


@pytest.mark.parametrize("command", ["eval", "generate"])
@pytest.mark.parametrize("damage", ["full shape", "wrong type", "bit flip"])
def test_eval_and_generate_on_a_damaged_checkpoint_end_in_one_line(base, tmp_path, command, damage):
    bad = _copy(base / "t1", tmp_path / "bad")
    if damage == "full shape":  # found by the structural check before any rank starts
        _edit_manifest(bad, lambda m: m["tensors"][QKV].update(shape=[80, 64]))
        names = ("manifest.json", QKV)
    elif damage == "wrong type":  # was a KeyError/TypeError traceback from deep in the reader
        _edit_manifest(bad, lambda m: m["files"][0].update(bytes="143KB"))
        names = ("manifest.json", "files[0].bytes")
    else:  # found by the checksum, inside the rank, while loading
        data = bytearray((bad / SHARD0).read_bytes())
        data[-3] ^= 0x01
        (bad / SHARD0).write_bytes(bytes(data))
        names = (SHARD0, "checksum")
    before = _hashes(bad)
    args = ["--text-file", base / "text.txt"] if command == "eval" else ["--prompt", "x", "--max-new-tokens", "2"]
    r = _subprocess(["-m", "tpzoo", command, bad, *args, "--device", "cpu"], tmp_path)
    _assert_one_line_error(r.returncode, r.stderr, command, *names)
    assert r.stdout == "" and _hashes(bad) == before


# --- shard headers against the manifest ------------------------------------------------------------------------

def test_header_dtype_differs_from_the_manifest(base, tmp_path, capsys):
    bad = _copy(base / "t2", tmp_path / "bad")
    _rewrite_shard(bad, SHARD1, lambda t: t.update({QKV: t[QKV].half()}))
    rc, out, _ = _run(capsys, "inspect", bad, "--no-tensors")  # the header checks run without --verify too
    assert rc == 1 and f"{SHARD1}: tensor {QKV} is torch.float16 in its header, torch.float32" in out
    _assert_readers_fail(capsys, bad, tmp_path, SHARD1, QKV, "float16")


def test_header_local_shape_differs_from_the_manifest(base, tmp_path, capsys):
    bad = _copy(base / "t2", tmp_path / "bad")
    _rewrite_shard(bad, SHARD0, lambda t: t.update({QKV: t[QKV][:40].contiguous()}))
    rc, out, _ = _run(capsys, "inspect", bad, "--no-tensors")
    assert rc == 1 and f"{SHARD0}: tensor {QKV} has shape [40, 64] in its header, [48, 64]" in out
    _assert_readers_fail(capsys, bad, tmp_path, SHARD0, QKV, "[40, 64]")


def test_shard_missing_a_tensor(base, tmp_path, capsys):
    bad = _copy(base / "t2", tmp_path / "bad")
    _rewrite_shard(bad, SHARD1, lambda t: t.pop("layers.1.mlp.fc_in.weight"))
    _assert_readers_fail(capsys, bad, tmp_path, SHARD1, "no tensor layers.1.mlp.fc_in.weight")
    with pytest.raises(CheckpointError, match="no tensor layers.1.mlp.fc_in.weight"):
        load_model(bad, verify=False)


def test_file_entry_missing_a_tensor(base, tmp_path, capsys):
    """The manifest's own file entry drops a tensor that the header still has."""
    bad = _copy(base / "t2", tmp_path / "bad")
    _edit_manifest(bad, lambda m: m["files"][1]["tensors"].pop("final_norm.weight"))
    _assert_readers_fail(capsys, bad, tmp_path, "manifest.json", SHARD1, "final_norm.weight")


def test_unknown_files_are_ignored_but_an_unlisted_shard_fails_verify(base, tmp_path, capsys):
    ckpt = _copy(base / "t2", tmp_path / "ckpt")
    (ckpt / "notes.txt").write_text("readers ignore files the manifest does not list\n")
    (ckpt / "optim").mkdir()  # what training keeps next to the weights
    rc, out, _ = _run(capsys, "inspect", ckpt, "--verify", "--no-tensors")
    assert rc == 0 and "FAILED" not in out
    shutil.copyfile(ckpt / SHARD1, ckpt / "model-tp02-pp00.safetensors")  # a leftover of another layout
    rc, out, _ = _run(capsys, "inspect", ckpt, "--verify", "--no-tensors")
    failed = [line for line in out.splitlines() if "FAILED" in line]
    assert rc == 1 and len(failed) == 1 and "model-tp02-pp00.safetensors" in failed[0], out
    before = _hashes(ckpt)
    rc, _, err = _run(capsys, "convert", "to-hf", ckpt, tmp_path / "hf", "--quiet")  # readers ignore it
    assert rc == 0 and "Traceback" not in err and _hashes(ckpt) == before


def test_truncated_shard(base, tmp_path, capsys):
    bad = _copy(base / "t2", tmp_path / "bad")
    data = (bad / SHARD1).read_bytes()
    (bad / SHARD1).write_bytes(data[: len(data) // 2])
    rc, out, _ = _run(capsys, "inspect", bad, "--no-tensors")
    assert rc == 1 and SHARD1 in out and "truncated" in out
    _assert_readers_fail(capsys, bad, tmp_path, SHARD1, "truncated")


def test_missing_shard_file(base, tmp_path, capsys):
    bad = _copy(base / "t2", tmp_path / "bad")
    (bad / SHARD0).unlink()
    _assert_readers_fail(capsys, bad, tmp_path, f"missing shard file {bad / SHARD0}")


def test_bit_flip_is_found_by_the_checksum(base, tmp_path, capsys):
    """Same size, valid header, one flipped data byte: only the checksum (verify, the default) can tell."""
    bad = _copy(base / "t2", tmp_path / "bad")
    data = bytearray((bad / SHARD1).read_bytes())
    data[-7] ^= 0x10
    (bad / SHARD1).write_bytes(bytes(data))
    rc, out, _ = _run(capsys, "inspect", bad, "--no-tensors")
    assert rc == 0  # the header checks pass
    rc, out, _ = _run(capsys, "inspect", bad, "--verify", "--no-tensors")
    assert rc == 1 and f"{SHARD1}: checksum" in out and f"verified {SHARD0}: ok" in out
    before = _hashes(bad)
    for command, argv in (("convert to-hf", ["convert", "to-hf", bad, tmp_path / "hf", "--quiet"]),
                          ("reshard", ["reshard", bad, tmp_path / "re", "--tp", "1", "--quiet"])):
        rc, _, err = _run(capsys, *argv)
        _assert_one_line_error(rc, err, command, SHARD1, "checksum")
    assert _hashes(bad) == before and not (tmp_path / "hf").exists()


# --- manifest.json itself ----------------------------------------------------------------------------------------

@pytest.mark.parametrize("content", [b'{"format": "tpzoo-checkpoint", "tp": ', b"\xff\xfe\x00garbage", b"[1, 2]"],
                         ids=["truncated-json", "not-utf8", "json-list"])
def test_manifest_that_is_not_json(base, tmp_path, capsys, content):
    bad = _copy(base / "t2", tmp_path / "bad")
    (bad / "manifest.json").write_bytes(content)
    rc, _, err = _run(capsys, "inspect", bad, "--verify")
    _assert_one_line_error(rc, err, "inspect", str(bad / "manifest.json"))
    _assert_readers_fail(capsys, bad, tmp_path, str(bad / "manifest.json"))


@pytest.mark.parametrize("edit,field", [
    (lambda m: m.pop("stages"), "'stages'"),
    (lambda m: m["files"][0].pop("bytes"), "files[0]: missing key 'bytes'"),
    (lambda m: m["tensors"][QKV].pop("split"), f"tensors['{QKV}']: missing key 'split'"),
    (lambda m: m["model_config"].pop("hidden_size"), "model_config: missing key 'hidden_size'"),
    (lambda m: m.update(tp="2"), "tp: expected an integer"),
    (lambda m: m["files"][1].update(tp_rank=1.0), "files[1].tp_rank: expected an integer"),
    (lambda m: m["tensors"][QKV].update(shape="96x64"), f"tensors['{QKV}'].shape: expected a list"),
    (lambda m: m["vocab"].update(padded=None), "vocab.padded: expected an integer"),
    (lambda m: m["model_config"].update(num_heads="8"), "model_config.num_heads: expected an integer"),
    (lambda m: m["files"][0]["tensors"]["embed.weight"].update(dtype="float32"),
     "files[0].tensors['embed.weight'].dtype: expected a safetensors dtype"),
], ids=["missing-stages", "missing-files.bytes", "missing-tensors.split", "missing-model_config.hidden_size",
        "type-tp", "type-tp_rank", "type-shape", "type-vocab.padded", "type-num_heads", "type-dtype"])
def test_manifest_missing_a_key_or_with_a_field_of_the_wrong_type(base, tmp_path, capsys, edit, field):
    bad = _copy(base / "t2", tmp_path / "bad")
    _edit_manifest(bad, edit)
    rc, _, err = _run(capsys, "inspect", bad)
    _assert_one_line_error(rc, err, "inspect", "manifest.json", field)
    _assert_readers_fail(capsys, bad, tmp_path, "manifest.json", field)


# --- Hugging Face sources --------------------------------------------------------------------------------------

def _hf_copy(base, tmp_path, sharded: bool) -> Path:
    if not sharded:
        return _copy(base / "hf", tmp_path / "hf_src")
    hf = tmp_path / "hf_src"
    write_hf("llama", hf, max_shard_size="100KB")
    assert (hf / "model.safetensors.index.json").is_file()
    return hf


def _assert_from_hf_fails(capsys, hf: Path, tmp_path: Path, *names: str) -> None:
    before = _hashes(hf)
    rc, _, err = _run(capsys, "convert", "from-hf", hf, tmp_path / "out", "--tp", "2", "--quiet")
    _assert_one_line_error(rc, err, "convert from-hf", *names)
    assert _hashes(hf) == before and not (tmp_path / "out").exists()
    assert not [p for p in tmp_path.iterdir() if ".tmp-" in p.name]


# A reader whose __init__ failed must not print "Exception ignored ... Traceback" when collected.
@pytest.mark.filterwarnings("error::pytest.PytestUnraisableExceptionWarning")
def test_hf_dir_with_a_corrupt_safetensors_file(base, tmp_path, capsys):
    hf = _hf_copy(base, tmp_path, sharded=False)
    data = (hf / "model.safetensors").read_bytes()
    (hf / "model.safetensors").write_bytes(data[:-1000])
    _assert_from_hf_fails(capsys, hf, tmp_path, str(hf / "model.safetensors"), "truncated or corrupt")


def test_hf_dir_with_a_corrupt_config(base, tmp_path, capsys):
    hf = _hf_copy(base, tmp_path, sharded=False)
    (hf / "config.json").write_text('{"architectures": ["LlamaForCausalLM"], ')
    _assert_from_hf_fails(capsys, hf, tmp_path, str(hf / "config.json"), "not valid JSON")


@pytest.mark.parametrize("damage", ["missing-file", "not-json", "no-weight-map", "tensor-not-in-file"])
def test_hf_index_json_damage(base, tmp_path, capsys, damage):
    hf = _hf_copy(base, tmp_path, sharded=True)
    index_path = hf / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    name = "model.layers.1.mlp.down_proj.weight"
    if damage == "missing-file":
        index["weight_map"][name] = "model-00009-of-00009.safetensors"
        names = (str(index_path), name, "model-00009-of-00009.safetensors", "missing")
    elif damage == "tensor-not-in-file":
        others = sorted(set(index["weight_map"].values()) - {index["weight_map"][name]})
        index["weight_map"][name] = others[0]
        names = (others[0], name)
    elif damage == "no-weight-map":
        index = {"metadata": {}}
        names = (str(index_path), "weight_map")
    index_path.write_text(json.dumps(index) if damage != "not-json" else '{"weight_map": {')
    if damage == "not-json":
        names = (str(index_path), "not valid JSON")
    _assert_from_hf_fails(capsys, hf, tmp_path, *names)


# --- killed conversions and their temporary directories ---------------------------------------------------------

KILLED_CONVERSION = """
import os, signal, sys
import tpzoo.checkpoint.convert as c
write = c.write_checkpoint
def write_then_die(*a, **k):   # the worst moment: everything written, the rename not done
    write(*a, **k)
    os.kill(os.getpid(), signal.SIGKILL)
c.write_checkpoint = write_then_die
c.convert_from_hf(sys.argv[1], sys.argv[2], tp=2, progress=False)
"""

LIVE_WRITER = """
import sys
from tpzoo.checkpoint import atomic_dir
with atomic_dir(sys.argv[1]) as tmp:
    print(tmp, flush=True)
    sys.stdin.readline()   # writing, until the test lets it go (or kills it)
"""


def _temp_dirs(dst: Path) -> list[Path]:
    return sorted(p for p in dst.parent.iterdir() if p.name.startswith(f".{dst.name}.tmp-"))


def test_killed_conversion_is_cleaned_up_by_the_next_one(base, tmp_path, capsys):
    dst = tmp_path / "dst"
    r = _subprocess(["-c", KILLED_CONVERSION, base / "hf", dst], tmp_path)
    assert r.returncode == -signal.SIGKILL, r.stderr[-2000:]
    [tmp] = _temp_dirs(dst)
    assert (tmp / "manifest.json").is_file() and not dst.exists()  # complete-looking, but never a checkpoint
    assert not is_checkpoint(tmp)
    rc, _, err = _run(capsys, "convert", "from-hf", base / "hf", dst, "--tp", "1", "--quiet")
    assert rc == 0 and "Traceback" not in err
    assert f"removed {tmp}" in err and str(dst) in err  # says what it removed, and why
    assert _temp_dirs(dst) == [] and is_checkpoint(dst)
    rc, _, _ = _run(capsys, "inspect", dst, "--verify")
    assert rc == 0


def test_a_live_writers_temp_dir_is_left_alone(base, tmp_path, capsys):
    dst = tmp_path / "dst"
    live = subprocess.Popen([sys.executable, "-c", LIVE_WRITER, str(dst)], cwd=tmp_path, text=True,
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            env={**os.environ, "PYTHONPATH": str(ROOT)})
    try:
        tmp = Path(live.stdout.readline().strip())
        assert tmp.is_dir() and (tmp / OWNER_FILE).is_file()
        rc, _, err = _run(capsys, "convert", "from-hf", base / "hf", dst, "--quiet")
        assert rc == 0 and "removed" not in err and tmp.is_dir()  # its writer is alive: untouched
        # A writer recorded on another host sharing this file system is never judged from here.
        foreign = tmp.with_name(f".{dst.name}.tmp-999999-0123abcd")
        foreign.mkdir()
        (foreign / OWNER_FILE).write_text(json.dumps({"pid": 999999, "host": "another-host", "final": dst.name}))
        live.kill()
        live.wait(timeout=30)
        rc, _, err = _run(capsys, "convert", "from-hf", base / "hf", dst, "--quiet", "--force")
        assert rc == 0 and f"removed {tmp}" in err and not tmp.exists()  # now its writer is gone
        assert foreign.is_dir() and "another-host" not in err
    finally:
        live.kill()
        live.wait(timeout=30)


@pytest.mark.parametrize("how", ["marker", "name"])
def test_a_temp_dir_is_never_accepted_as_a_checkpoint(base, tmp_path, capsys, how):
    """A finished-looking copy in a temporary directory: refused by every reader, naming it."""
    if how == "marker":  # the marker of an unfinished write, whatever the directory is called
        tmp = _copy(base / "t1", tmp_path / "looks_fine")
        (tmp / OWNER_FILE).write_text(json.dumps({"pid": 1, "host": "h", "final": "x"}))
    else:  # killed after the marker was removed, before the rename
        tmp = _copy(base / "t1", tmp_path / "src" / f".dst.tmp-{os.getpid()}-0a1b2c3d")
    assert not is_checkpoint(tmp)
    with pytest.raises(CheckpointError, match="did not finish"):
        load_model(tmp)
    rc, _, err = _run(capsys, "inspect", tmp)
    _assert_one_line_error(rc, err, "inspect", str(tmp), "did not finish")
    _assert_readers_fail(capsys, tmp, tmp_path, str(tmp), "did not finish")
    if how == "marker":  # also what it holds: a checkpoint nested inside an unfinished write
        with pytest.raises(CheckpointError, match="did not finish"):
            load_model(_copy(base / "t1", tmp / "optim" / "exp_avg"))
