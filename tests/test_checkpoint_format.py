"""The on-disk pieces: streaming safetensors I/O, shard ranges, manifest safety, verification, atomic output."""
import json
import os

import pytest
import torch
from safetensors.torch import load_file, save_file

from tpzoo.checkpoint import CheckpointError, atomic_dir, convert_from_hf, load_model, read_manifest
from tpzoo.checkpoint.layout import local_segments
from tpzoo.checkpoint.safetensors_io import SafetensorsReader, read_header
from tpzoo.checkpoint.st_writer import SafetensorsWriter
from tpzoo.checkpoint.sources import CheckpointSource
from tpzoo.cli import main as cli
from tpzoo.parallel.sharding import ShardSpec, shard

from checkpoint_helpers import write_hf


def test_streaming_writer_is_read_by_safetensors(tmp_path):
    g = torch.Generator().manual_seed(0)
    tensors = {"a": torch.randn(7, 5, generator=g), "b": torch.randn(3, 4, generator=g).bfloat16(),
               "c": torch.arange(6, dtype=torch.int64), "empty": torch.zeros(0, 3), "scalar": torch.tensor(2.5),
               "h": torch.randn(4, generator=g).half()}
    w = SafetensorsWriter(tmp_path / "x.safetensors", [(k, v.dtype, tuple(v.shape)) for k, v in tensors.items()],
                          {"format": "pt"})
    for k, v in tensors.items():
        if k == "a":  # in pieces of rows, as the converters write
            for rows in v.split(3):
                w.write(k, rows)
        elif k != "empty":
            w.write(k, v)
    size, digest = w.close()
    assert size == os.path.getsize(tmp_path / "x.safetensors") and digest.startswith("crc32:")
    back = load_file(tmp_path / "x.safetensors")
    for k, v in tensors.items():
        assert back[k].dtype == v.dtype and torch.equal(back[k], v), k


def test_reader_boxes_match_slicing(tmp_path):
    t = torch.randn(6, 10, 4, generator=torch.Generator().manual_seed(1))
    save_file({"t": t, "u": t[0].bfloat16().contiguous()}, tmp_path / "y.safetensors")
    with SafetensorsReader(tmp_path / "y.safetensors") as r:
        assert torch.equal(r.read("u"), t[0].bfloat16())
        for box in ([(0, 6), (0, 10), (0, 4)], [(2, 3), (0, 10), (0, 4)], [(0, 6), (3, 5), (0, 4)],
                    [(1, 2), (4, 3), (1, 2)], [(5, 1), (9, 1), (3, 1)]):
            want = t[tuple(slice(s, s + n) for s, n in box)]
            assert torch.equal(r.read_box("t", box), want), box


@pytest.mark.parametrize("spec,full,tp", [
    (ShardSpec(0), 12, 4), (ShardSpec(1), 12, 3), (ShardSpec(None), 5, 2),
    (ShardSpec(0, parts=(6, 6)), 12, 3),                                    # gate|up
    (ShardSpec(0, parts=(8, 4, 4), replicas=(1, 2, 2), block=2), 16, 4),     # 2 kv heads at tp=4
    (ShardSpec(0, parts=(16, 2, 2), replicas=(1, 8, 8), block=2), 20, 8),    # multi-query at tp=8
    (ShardSpec(0, parts=(8, 8, 8), replicas=(1, 1, 1), block=2), 24, 2)])
def test_local_segments_describe_shards(spec, full, tp):
    x = torch.arange(full * 3).reshape(full, 3) if spec.dim != 1 else torch.arange(full * 3).reshape(3, full)
    d = 0 if spec.dim is None else spec.dim
    for rank in range(tp):
        pieces = [x.narrow(d, s, n) for s, n in local_segments(spec, full, rank, tp)]
        assert torch.equal(torch.cat(pieces, dim=d), shard(x, spec, rank, tp))


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    root = tmp_path_factory.mktemp("fmt")
    write_hf("llama", root / "hf")
    convert_from_hf(root / "hf", root / "t2", tp=2, pp=1, progress=False)
    return root


def _copy_ckpt(src, dst):
    import shutil

    shutil.copytree(src, dst)
    return dst


def test_corrupt_truncated_and_missing_shards_are_named(ckpt, tmp_path, capsys):
    bad = _copy_ckpt(ckpt / "t2", tmp_path / "bad")
    shard_file = bad / "model-tp01-pp00.safetensors"
    data = bytearray(shard_file.read_bytes())
    data[-5] ^= 0xFF  # same size, one flipped byte: only the checksum can tell
    shard_file.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match="model-tp01-pp00.safetensors.*checksum"):
        load_model(bad)
    assert cli(["inspect", str(bad), "--verify", "--no-tensors"]) == 1
    assert "verify FAILED" in capsys.readouterr().out
    shard_file.write_bytes(bytes(data[:-100]))  # truncated
    with pytest.raises(CheckpointError, match="model-tp01-pp00.safetensors.*truncated"):
        load_model(bad, verify=False)
    with pytest.raises(Exception, match="truncated"):
        read_header(shard_file)
    shard_file.unlink()
    with pytest.raises(CheckpointError, match="missing shard file .*model-tp01-pp00.safetensors"):
        load_model(bad)


@pytest.mark.parametrize("evil", ["/etc/passwd", "../outside.safetensors", "sub/../../x.safetensors", "link"])
def test_manifest_entries_outside_the_checkpoint_are_rejected(ckpt, tmp_path, evil):
    bad = _copy_ckpt(ckpt / "t2", tmp_path / "evil")
    if evil == "link":  # a symlink inside the directory that escapes it
        (tmp_path / "elsewhere.safetensors").write_bytes((bad / "model-tp00-pp00.safetensors").read_bytes())
        os.symlink(tmp_path / "elsewhere.safetensors", bad / "link")
    m = json.loads((bad / "manifest.json").read_text())
    m["files"][0]["path"] = evil
    (bad / "manifest.json").write_text(json.dumps(m))
    with pytest.raises(CheckpointError, match="outside the checkpoint|absolute"):
        read_manifest(bad)
    with pytest.raises(CheckpointError):
        load_model(bad)
    m["files"][0]["path"] = "model-tp00-pp00.safetensors"
    m["aux_files"] = [evil]
    (bad / "manifest.json").write_text(json.dumps(m))
    with pytest.raises(CheckpointError):
        CheckpointSource(bad)


def test_atomic_dir(tmp_path):
    final = tmp_path / "out"
    with pytest.raises(RuntimeError):
        with atomic_dir(final) as tmp:
            (tmp / "half").write_text("x")
            raise RuntimeError("boom")
    assert not final.exists() and os.listdir(tmp_path) == []  # nothing half-written left behind
    with atomic_dir(final) as tmp:
        (tmp / "v1").write_text("1")
    with pytest.raises(FileExistsError, match="already exists"):
        with atomic_dir(final):
            pass
    with pytest.raises(RuntimeError):
        with atomic_dir(final, force=True) as tmp:
            raise RuntimeError("the old one must survive a failed replacement")
    assert os.listdir(final) == ["v1"]
    with atomic_dir(final, force=True) as tmp:
        (tmp / "v2").write_text("2")
    assert os.listdir(final) == ["v2"] and os.listdir(tmp_path) == ["out"]
