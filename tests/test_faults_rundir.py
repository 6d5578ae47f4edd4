"""A run directory belongs to one run; nothing is lost (docs/reliability.md): the lock, a fresh run refused in a
used directory, --overwrite moving the old run aside, other runs' temporary directories left alone, torn metrics
lines skipped, and --resume auto taking the newest intact checkpoint. Each test checks that nothing of the
previous run changed (file bytes before and after)."""
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from tpzoo.errors import ConfigError
from tpzoo.testing import run_on_ranks
from tpzoo.train import load_config, rundir
from tpzoo.train.rundir import LOCK_NAME

pytestmark = pytest.mark.faults

ROOT = Path(__file__).resolve().parents[1]
ONE_RANK = SimpleNamespace(rank=0, world_size=1)  # rundir.claim in this process, as rank 0 of one


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    """A small byte-level token store every run below reads."""
    import sysconfig

    from tpzoo.data import iter_documents, preprocess

    lib = Path(sysconfig.get_paths()["stdlib"])
    files = [str(lib / f) for f in ("textwrap.py", "shlex.py")]
    return str(preprocess(iter_documents(files), "byte", tmp_path_factory.mktemp("data") / "store").path)


def tiny(store, **kw):
    base = dict(model="nano-gpt", data=[store], seq_len=32, global_batch_size=8, micro_batch_size=2, steps=4,
                lr=3e-3, min_lr=3e-4, warmup_steps=2, tp=1, pp=1, dp=0, save="", sample_prompt="", quiet=True,
                log_interval=100, eval_fraction=0.0, seed=0, prefetch=1, save_every=2, keep_last=0)
    base.update(kw)
    return load_config(None, base)


def _train(cfg):
    from tpzoo.train import train

    return train(cfg)


def _train_error(cfg):
    """train(cfg) expected to fail: (error class name, message) on this rank (the worker pool stays up)."""
    from tpzoo.train import train

    try:
        train(cfg)
    except Exception as e:  # noqa: BLE001
        return type(e).__name__, str(e)
    return None


@pytest.fixture(scope="module")
def finished_run(store, tmp_path_factory):
    """A finished run (4 steps, checkpoints at 2 and 4, metrics.jsonl); tests copy it."""
    save = tmp_path_factory.mktemp("template") / "run"
    run_on_ranks(1, _train, tiny(store, save=str(save)))
    return save


def _copy_run(finished_run, tmp_path) -> Path:
    save = tmp_path / "run"
    shutil.copytree(finished_run, save)
    return save


def snapshot(d: Path) -> dict:
    """Every file under d (relative path -> bytes), the lock excepted."""
    return {str(p.relative_to(d)): p.read_bytes() for p in sorted(Path(d).rglob("*"))
            if p.is_file() and p.name != LOCK_NAME}


def _cli_args(store, save, *extra) -> list:
    return ["pretrain", "--model", "nano-gpt", "--data", store, "--seq-len", "32", "--global-batch-size", "8",
            "--micro-batch-size", "2", "--steps", "4", "--warmup-steps", "2", "--seed", "0", "--eval-fraction", "0",
            "--save", str(save), "--save-every", "2", "--keep-last", "0", "--sample-prompt", "", "--log-interval", "1",
            "--tp", "1", "--no-progress", *extra]


def _cli(args, cwd, env=None, popen=False):
    e = dict(os.environ, **(env or {}))
    for k in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "MASTER_PORT", "MASTER_ADDR"):
        e.pop(k, None)
    cmd = [sys.executable, "-m", "tpzoo", *args]
    if popen:
        return subprocess.Popen(cmd, cwd=cwd, env=e, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    return subprocess.run(cmd, cwd=cwd, env=e, capture_output=True, text=True, timeout=300)


def _error_lines(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.startswith("tpzoo ")]


def _dead_pid() -> int:
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


def _write_lock(d: Path, **fields) -> Path:
    info = {"format": rundir.LOCK_FORMAT, "pid": 1, "host": socket.gethostname(), "started": "2024-01-01T00:00:00",
            "proc_start": None, "token": "f" * 32}
    info.update(fields)
    d.mkdir(parents=True, exist_ok=True)
    (d / LOCK_NAME).write_text(json.dumps(info))
    return d / LOCK_NAME


# -- one owner: fresh runs, --overwrite -------------------------------------------------------------------------

def test_fresh_run_into_a_used_directory_refuses_in_one_line(store, finished_run, tmp_path):
    """No --resume, no --overwrite, into a directory holding checkpoints and metrics.jsonl: exit 2, one line
    naming the directory and both ways out, before any work (no header printed); every file unchanged."""
    save = _copy_run(finished_run, tmp_path)
    before = snapshot(save)
    out = _cli(_cli_args(store, save), tmp_path)
    assert out.returncode == 2, out.stderr[-2000:]
    lines = _error_lines(out.stderr)
    assert len(lines) == 1 and lines[0].startswith("tpzoo pretrain: error: "), out.stderr
    assert str(save) in lines[0] and "--resume" in lines[0] and "--overwrite" in lines[0]
    assert "Traceback" not in out.stderr and "tpzoo pretrain: model" not in out.stdout
    assert snapshot(save) == before
    assert not (save / LOCK_NAME).exists()  # released on the way out


def test_fresh_run_refuses_a_log_dir_holding_metrics_and_a_foreign_resume(store, finished_run, tmp_path):
    """--log-dir is a run directory too (its own lock, its metrics.jsonl guarded); resuming a checkpoint from
    elsewhere into a --save that holds another run is refused as well. Nothing changes in either."""
    logs = tmp_path / "logs"
    logs.mkdir()
    (logs / "metrics.jsonl").write_text('{"step": 1, "loss": 5.0, "lr": 0.001}\n')
    before = snapshot(logs)
    with pytest.raises(rundir.RunDirNotEmpty, match=re.escape(str(logs))):
        rundir.claim(tiny(store, save=str(tmp_path / "fresh"), log_dir=str(logs)), ONE_RANK)
    assert snapshot(logs) == before and not (logs / LOCK_NAME).exists()
    assert not (tmp_path / "fresh" / LOCK_NAME).exists()

    other = _copy_run(finished_run, tmp_path / "other")
    target = _copy_run(finished_run, tmp_path / "target")
    before = snapshot(target)
    cfg = tiny(store, save=str(target), resume=str(other / "step_00000002"))
    with pytest.raises(rundir.RunDirNotEmpty, match="is not one of its checkpoints"):
        rundir.claim(cfg, ONE_RANK)
    assert snapshot(target) == before


def test_overwrite_moves_the_old_run_aside_and_trains(store, finished_run, tmp_path):
    """--overwrite: the old checkpoints, `latest` and logs move, byte for byte, into SAVE/.replaced-<time>/;
    the new run starts at step 0 with its own metrics.jsonl; keep-last pruning never reaches the moved run."""
    save = _copy_run(finished_run, tmp_path)
    before = snapshot(save)
    r = run_on_ranks(1, _train, tiny(store, save=str(save), steps=3, save_every=1, keep_last=1, overwrite=True))[0]
    assert r["status"] == "ok" and r["start_step"] == 0 and r["steps"] == [1, 2, 3]
    (replaced,) = save.glob(".replaced-*")
    assert snapshot(replaced) == before  # everything of the old run, unchanged
    assert sorted(p.name for p in save.glob("step_*")) == ["step_00000003"]
    from tpzoo.train.metrics import read_metrics

    assert [row["step"] for row in read_metrics(str(save))] == [1, 2, 3]
    assert not (save / LOCK_NAME).exists()


def test_overwrite_with_resume_of_the_same_directory_is_refused(store, finished_run, tmp_path):
    save = _copy_run(finished_run, tmp_path)
    before = snapshot(save)
    for resume in ("auto", str(save / "step_00000002")):
        with pytest.raises(ConfigError, match="pass one of them"):
            rundir.claim(tiny(store, save=str(save), overwrite=True, resume=resume), ONE_RANK)
    assert snapshot(save) == before and not (save / LOCK_NAME).exists()


# -- the lock -------------------------------------------------------------------------------------------------------

def test_a_second_run_refuses_while_the_first_holds_the_lock(store, tmp_path):
    """Two CLI runs on one --save: the first (paused right after taking the lock) holds it; the second,
    self-spawning two ranks, exits 2 with one line naming the directory and the holder (pid, host, start) before
    any rank works; the first then completes intact and releases the lock."""
    save, go = tmp_path / "run", tmp_path / "go"
    first = _cli(_cli_args(store, save), tmp_path, {rundir.HOLD_ENV: str(go)}, popen=True)
    try:
        deadline = time.monotonic() + 120
        while not (save / LOCK_NAME).exists():
            assert first.poll() is None, first.communicate()[1][-2000:]
            assert time.monotonic() < deadline, "the first run never took the lock"
            time.sleep(0.1)
        lock = json.loads((save / LOCK_NAME).read_text())
        assert lock["pid"] == first.pid and lock["host"] == socket.gethostname()
        second = _cli(_cli_args(store, save, "--tp", "2"), tmp_path)
        assert second.returncode == 2, second.stderr[-2000:]
        lines = _error_lines(second.stderr)
        assert len(lines) == 1, second.stderr
        assert str(save) in lines[0] and "in use" in lines[0]
        assert f"pid {first.pid}" in lines[0] and socket.gethostname() in lines[0] and lock["started"] in lines[0]
        assert "tpzoo pretrain: model" not in second.stdout
    finally:
        go.touch()
        _, err = first.communicate(timeout=300)
    assert first.returncode == 0, err[-2000:]
    assert sorted(p.name for p in save.glob("step_*")) == ["step_00000002", "step_00000004"]
    from tpzoo.train.metrics import read_metrics

    assert [row["step"] for row in read_metrics(str(save))] == [1, 2, 3, 4]
    assert not (save / LOCK_NAME).exists()


def test_every_rank_refuses_a_locked_directory_with_the_same_error(store, tmp_path):
    """At tp=2 the lock is rank 0's alone; rank 1 gets rank 0's refusal by broadcast (one report per job), and
    the live holder's lock is untouched."""
    save = tmp_path / "run"
    held = rundir.acquire_lock(save)  # this test process: alive, same host
    try:
        lock_bytes = (save / LOCK_NAME).read_bytes()
        errors = run_on_ranks(2, _train_error, tiny(store, save=str(save), tp=2))
        assert errors[0] == errors[1] and errors[0][0] == "RunDirInUse", errors
        assert str(save) in errors[0][1] and f"pid {os.getpid()}" in errors[0][1]
        assert (save / LOCK_NAME).read_bytes() == lock_bytes
    finally:
        held.release()
    assert not (save / LOCK_NAME).exists()


def test_a_stale_lock_of_a_dead_process_is_taken_over_with_a_message(store, tmp_path, capsys):
    """A lock whose pid is dead on this host (or reused by another program: other start time) is taken over,
    with a message naming the old holder; a run then trains there and releases the lock at the end."""
    save = tmp_path / "run"
    dead = _dead_pid()
    _write_lock(save, pid=dead)
    lock = rundir.acquire_lock(save)
    err = capsys.readouterr().err
    assert "took over the lock" in err and f"pid {dead}" in err and "no longer running" in err
    assert json.loads((save / LOCK_NAME).read_text())["pid"] == os.getpid()
    lock.release()
    assert not (save / LOCK_NAME).exists()

    _write_lock(save, pid=os.getppid(), proc_start="1")  # a live pid, but not the process that wrote the lock
    rundir.acquire_lock(save).release()
    assert "took over the lock" in capsys.readouterr().err

    _write_lock(save, pid=_dead_pid())
    r = run_on_ranks(1, _train, tiny(store, save=str(save), steps=2))[0]
    assert r["status"] == "ok" and (save / "step_00000002").is_dir()
    assert not (save / LOCK_NAME).exists()


def test_a_lock_of_another_host_or_an_unreadable_one_is_never_taken_over(tmp_path):
    save = tmp_path / "run"
    path = _write_lock(save, host="node-elsewhere-17", pid=_dead_pid())
    before = path.read_bytes()
    with pytest.raises(rundir.RunDirInUse, match="node-elsewhere-17") as e:
        rundir.acquire_lock(save)
    assert str(save) in str(e.value) and f"delete {path}" in str(e.value)  # how to get out once it is gone
    assert path.read_bytes() == before
    path.write_text("{half a lock")
    with pytest.raises(rundir.RunDirInUse, match="unreadable lock file"):
        rundir.acquire_lock(save)
    assert path.read_text() == "{half a lock"


def test_the_lock_is_released_when_a_run_fails_to_start(store, tmp_path):
    """A run that fails after taking the lock (a config error found while building the model) releases it: the
    next run in that directory starts normally."""
    save = tmp_path / "run"
    name, text = run_on_ranks(1, _train_error, tiny(store, save=str(save), seq_len=128))[0]
    assert name == "ConfigError" and "max_position_embeddings" in text
    assert not (save / LOCK_NAME).exists()
    r = run_on_ranks(1, _train, tiny(store, save=str(save), steps=2))[0]
    assert r["status"] == "ok" and not (save / LOCK_NAME).exists()


# -- temporary directories ----------------------------------------------------------------------------------------

def test_only_temporary_directories_of_gone_writers_are_deleted(store, finished_run, tmp_path, capsys):
    """A starting run deletes the temporary save directory of a dead writer on this host, and leaves those of a
    live writer, of another host and of an unknown writer in place, byte for byte, saying so."""
    from tpzoo.checkpoint.atomic import OWNER_FILE

    save = _copy_run(finished_run, tmp_path)

    def fake_tmp(name, owner):
        d = save / name
        (d / "optim").mkdir(parents=True)
        (d / "optim" / "part.bin").write_bytes(b"half a save")
        if owner:
            (d / OWNER_FILE).write_text(json.dumps(owner))
        return d

    host = socket.gethostname()
    dead = fake_tmp(".step_00000006.tmp-1-0123abcd", {"pid": _dead_pid(), "host": host})
    live = fake_tmp(f".step_00000006.tmp-{os.getpid()}-4567abcd", {"pid": os.getppid(), "host": host})
    remote = fake_tmp(".step_00000006.tmp-2-89abcdef", {"pid": 2, "host": "node-elsewhere-17"})
    unknown = fake_tmp(".step_00000006.tmp-abcdefgh", None)
    kept = {p: snapshot(p) for p in (live, remote, unknown)}
    rundir.claim(tiny(store, save=str(save), resume="auto"), ONE_RANK).release()
    err = capsys.readouterr().err
    assert not dead.exists()
    for p, files in kept.items():
        assert snapshot(p) == files and f"left {p} in place" in err
    run_on_ranks(1, _train, tiny(store, save=str(save), steps=6, resume="auto"))  # a whole run leaves them too
    assert all(snapshot(p) == files for p, files in kept.items())


# -- metrics.jsonl -------------------------------------------------------------------------------------------------

def _write_rows(log_dir, steps, torn=b""):
    from tpzoo.train.metrics import MetricsLogger

    log = MetricsLogger(True, str(log_dir), total_steps=10, start_step=0, progress=False, quiet=True)
    for step in steps:
        log.step({"step": step, "loss": 5.0 - 0.1 * step, "lr": 1e-3, "grad_norm": 1.0, "tokens_per_s": 1.0})
    log.close()
    with open(Path(log_dir) / "metrics.jsonl", "ab") as f:
        f.write(torn)


def test_a_torn_last_metrics_line_is_skipped_by_readers_and_plot(tmp_path, capsys):
    """A crash (or a run still writing) leaves half a line: read_metrics and `tpzoo plot` skip it with a
    warning naming the file and line, and do not touch the file."""
    from tpzoo.train.metrics import read_metrics

    _write_rows(tmp_path, [1, 2, 3], torn=b'{"step": 4, "loss": 4.6, "l')
    path = tmp_path / "metrics.jsonl"
    before = path.read_bytes()
    assert [r["step"] for r in read_metrics(str(tmp_path))] == [1, 2, 3]
    err = capsys.readouterr().err
    assert f"{path} line 4: a torn last line" in err
    pytest.importorskip("matplotlib")
    out = _cli(["plot", str(tmp_path), "--out", str(tmp_path / "c.png")], tmp_path)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "torn last line" in out.stderr and "Traceback" not in out.stderr
    assert (tmp_path / "c.png").read_bytes()[:4] == b"\x89PNG"
    assert path.read_bytes() == before


def test_appending_after_a_torn_line_keeps_every_byte_and_starts_a_new_line(tmp_path, capsys):
    """A resumed run's logger, opened on a file whose last line is torn, ends that line first: the old bytes
    stay a prefix of the file, the new rows parse, the torn bytes are skipped with a warning."""
    from tpzoo.train.metrics import read_metrics

    _write_rows(tmp_path, [1, 2], torn=b'{"step": 3, "lo')
    before = (tmp_path / "metrics.jsonl").read_bytes()
    _write_rows(tmp_path, [3, 4])
    after = (tmp_path / "metrics.jsonl").read_bytes()
    assert after.startswith(before) and after.endswith(b"\n")
    assert [r["step"] for r in read_metrics(str(tmp_path))] == [1, 2, 3, 4]
    assert "line 3: not a metrics row" in capsys.readouterr().err


# -- resume from the newest intact checkpoint ------------------------------------------------------------------

def test_resume_auto_skips_a_truncated_newest_checkpoint_and_appends(store, finished_run, tmp_path):
    """CLI --resume auto with the newest checkpoint's shard truncated: a warning names it and why, the run
    resumes from the previous one, and appends to metrics.jsonl (the old bytes stay its prefix)."""
    save = _copy_run(finished_run, tmp_path)
    shard = save / "step_00000004" / "model-tp00-pp00.safetensors"
    with open(shard, "r+b") as f:
        f.truncate(shard.stat().st_size // 2)
    older = snapshot(save / "step_00000002")
    metrics_before = (save / "metrics.jsonl").read_bytes()
    out = _cli(_cli_args(store, save, "--resume", "auto", "--steps", "6", "--save-every", "0"), tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    skipped = [line for line in out.stderr.splitlines() if "skipping" in line]
    assert len(skipped) == 1 and str(save / "step_00000004") in skipped[0] and "truncated" in skipped[0]
    assert f"resumed from {save / 'step_00000002'} at step 2" in out.stdout
    assert snapshot(save / "step_00000002") == older
    metrics = (save / "metrics.jsonl").read_bytes()
    assert metrics.startswith(metrics_before) and len(metrics) > len(metrics_before)
    from tpzoo.train.metrics import read_metrics

    assert [r["step"] for r in read_metrics(str(save))] == [1, 2, 3, 4, 5, 6]
    assert not (save / LOCK_NAME).exists()


def test_resume_auto_skips_corrupt_state_and_missing_optimizer_state_then_refuses(store, finished_run, tmp_path):
    """Damaged train_state.json, a missing optimizer-state manifest: each skipped checkpoint is reported with its
    reason; with none intact --resume fails with one line naming the directory; an explicit damaged --resume DIR
    is refused with its reason. Nothing is modified."""
    from tpzoo.checkpoint import CheckpointError
    from tpzoo.train import checkpointing as ckpt

    save = _copy_run(finished_run, tmp_path)
    (save / "step_00000004" / "train_state.json").write_text('{"format": "tpzoo-train-state", "st')
    said = []
    assert ckpt.resolve_resume(tiny(store, save=str(save), resume="auto"), say=said.append) == save / "step_00000002"
    assert len(said) == 1 and "step_00000004" in said[0] and "train_state.json: corrupt" in said[0]

    (save / "step_00000002" / "optim" / "exp_avg" / "manifest.json").unlink()
    before = snapshot(save)
    said.clear()
    with pytest.raises(CheckpointError, match="no intact checkpoint under") as e:
        ckpt.resolve_resume(tiny(store, save=str(save), resume="latest"), say=said.append)
    assert str(save) in str(e.value) and "\n" not in str(e.value)
    assert [s.split(":")[1].strip() for s in said] == ["skipping " + str(save / "step_00000004"),
                                                       "skipping " + str(save / "step_00000002")]
    assert "exp_avg" in said[1]
    with pytest.raises(CheckpointError, match="exp_avg"):
        ckpt.resolve_resume(tiny(store, save=str(save), resume=str(save / "step_00000002")), say=said.append)
    assert snapshot(save) == before


def test_resume_auto_before_any_checkpoint_appends_to_the_metrics(store, tmp_path):
    """A run that crashed before its first save leaves only metrics.jsonl: --resume auto starts at step 0 and
    appends (the old rows are superseded, not truncated away)."""
    save = tmp_path / "run"
    save.mkdir()
    _write_rows(save, [1, 2, 3])
    before = (save / "metrics.jsonl").read_bytes()
    r = run_on_ranks(1, _train, tiny(store, save=str(save), steps=2, resume="auto"))[0]
    assert r["start_step"] == 0 and r["steps"] == [1, 2]
    after = (save / "metrics.jsonl").read_bytes()
    assert after.startswith(before) and after.count(b"\n") == 5


def test_a_full_disk_during_a_save_keeps_the_previous_checkpoint(store, tmp_path):
    """ENOSPC while writing the second checkpoint (the test hook raises it where a real disk would run out): one
    error line naming the directory, exit 2, the first checkpoint and `latest` intact, no temporary directory
    left, and the lock released so that --resume continues from the first checkpoint."""
    import os

    save = tmp_path / "run"
    args = ["--model", "nano-gpt", "--tp", "1", "--data", store, "--seq-len", "32", "--global-batch-size", "8",
            "--micro-batch-size", "2", "--steps", "6", "--warmup-steps", "2", "--seed", "0", "--eval-fraction", "0",
            "--save", str(save), "--save-every", "2", "--sample-prompt", "", "--quiet", "--device", "cpu"]
    env = {**os.environ, "TPZOO_TEST_FULL_DISK_DURING_SAVE": "2"}
    full = subprocess.run([sys.executable, "-m", "tpzoo", "pretrain", *args], capture_output=True, text=True,
                          cwd=tmp_path, env=env, timeout=300)
    assert full.returncode == 2 and "Traceback" not in full.stderr, full.stderr[-3000:]
    errors = [line for line in full.stderr.splitlines() if line.startswith("tpzoo pretrain: error:")]
    assert len(errors) == 1 and "No space left on device" in errors[0] and ".step_00000004.tmp-" in errors[0]
    assert sorted(p.name for p in save.iterdir() if not p.name.startswith((".", "events.out"))) == [
        "latest", "metrics.jsonl", "step_00000002"]
    assert (save / "latest").read_text().strip() == "step_00000002"
    assert not any(".tmp-" in p.name or p.name == ".tpzoo.lock" for p in save.iterdir())
    before = {p.name: p.read_bytes() for p in (save / "step_00000002").iterdir() if p.is_file()}
    resumed = subprocess.run([sys.executable, "-m", "tpzoo", "pretrain", *args, "--resume"], capture_output=True,
                             text=True, cwd=tmp_path, timeout=300)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert {p.name: p.read_bytes() for p in (save / "step_00000002").iterdir() if p.is_file()} == before
