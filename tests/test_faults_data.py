"""Bad data files: a bad JSONL record names the file and line, invalid UTF-8 the file, line and byte offset, an
empty file says "empty file"; the SFT file and the named data paths are checked before any rank starts.

CLI cases: exit status 2, one line `tpzoo <command>: error: ...`, no traceback, the inputs untouched, no rank
started (preflight_helpers). Reader cases: the pretraining sources raise the same messages (rank 0 reads them
while tokenizing, after spawning, so they are tested on the reader).
"""
import json
import os
import shutil
import warnings
from pathlib import Path

import pytest

from preflight_helpers import cli, cli_process, hf_config_dir, one_error_line  # noqa: F401

pytestmark = pytest.mark.faults

GOOD = json.dumps({"prompt": "What is 2+2?", "response": "4"})


def finetune(monkeypatch, capsys, tmp_path, data):
    return cli(monkeypatch, capsys, "finetune", "--base", tmp_path / "base", "--data", data)


def sft_file(tmp_path, content: bytes):
    """The SFT file, and next to it the --base every finetune case uses (a config.json-only HF directory)."""
    hf_config_dir(tmp_path / "base")
    path = tmp_path / "sft.jsonl"
    path.write_bytes(content)
    return path


# -- SFT, through `tpzoo finetune` -----------------------------------------------------------------------------

def test_sft_bad_json_names_file_line_and_column_in_a_real_process(tmp_path):
    path = sft_file(tmp_path, f'{GOOD}\n{GOOD}\n{{"prompt": "x", "response": }}\n'.encode())
    one_error_line(*cli_process("finetune", "--base", tmp_path / "base", "--data", path, cwd=tmp_path), "finetune",
                   f"{path}:3:29: invalid JSON: Expecting value")


def test_sft_invalid_utf8_names_file_line_and_byte_offset(tmp_path, monkeypatch, capsys):
    first = f"{GOOD}\n".encode()
    second = b'{"prompt": "caf\xe9", "response": "ok"}\n'  # latin-1, not UTF-8
    path = sft_file(tmp_path, first + second)
    offset = len(first) + second.index(b"\xe9")
    one_error_line(*finetune(monkeypatch, capsys, tmp_path, path), "finetune",
                   f"{path}:2: invalid UTF-8 (byte 0xe9 at byte offset {offset})")


def test_an_empty_sft_file_says_empty_file(tmp_path, monkeypatch, capsys):
    path = sft_file(tmp_path, b"")
    one_error_line(*finetune(monkeypatch, capsys, tmp_path, path), "finetune", f"{path}: empty file")
    path.write_bytes(b"\n  \n\n")
    one_error_line(*finetune(monkeypatch, capsys, tmp_path, path), "finetune",
                   f"{path}: empty file (only blank lines, no records)")


@pytest.mark.parametrize("record,says", [
    ({"prompt": "x"}, "expected {'prompt', 'response'} strings or 'messages'; got keys ['prompt']"),
    ({"messages": [{"role": "user", "content": "hi"}]}, "no assistant message"),
    ({"messages": [{"role": "bot", "content": "hi"}]}, "each message needs 'role' in"),
    (["not", "an", "object"], "expected a JSON object, got list"),
])
def test_an_sft_record_missing_fields_names_file_and_line(tmp_path, monkeypatch, capsys, record, says):
    path = sft_file(tmp_path, f"{GOOD}\n\n{json.dumps(record)}\n".encode())
    one_error_line(*finetune(monkeypatch, capsys, tmp_path, path), "finetune", f"{path}:3: {says}")


def test_a_missing_sft_file_and_raw_template_with_messages(tmp_path, monkeypatch, capsys):
    hf_config_dir(tmp_path / "base")
    one_error_line(*finetune(monkeypatch, capsys, tmp_path, tmp_path / "nope.jsonl"), "finetune",
                   f"SFT data file does not exist: {tmp_path / 'nope.jsonl'}")
    path = sft_file(tmp_path, (json.dumps({"messages": [{"role": "assistant", "content": "a"}]}) + "\n").encode())
    one_error_line(*cli(monkeypatch, capsys, "finetune", "--base", tmp_path / "base", "--data", path, "--template",
                        "raw"),
                   "finetune", f"{path}: template 'raw' takes prompt/response records")


# -- pretraining data paths, through `tpzoo pretrain` ----------------------------------------------------------

def test_pretrain_data_paths_missing_empty_or_without_data_files(tmp_path, monkeypatch, capsys):
    (tmp_path / "empty.txt").write_bytes(b"")
    (tmp_path / "nodata").mkdir()
    (tmp_path / "nodata" / "notes.csv").write_text("a,b\n")
    (tmp_path / "blank").mkdir()
    (tmp_path / "blank" / "a.txt").write_bytes(b"")
    cases = [(tmp_path / "nope.txt", f"data path does not exist: {tmp_path / 'nope.txt'}"),
             (tmp_path / "empty.txt", f"{tmp_path / 'empty.txt'}: empty file"),
             (tmp_path / "nodata", f"{tmp_path / 'nodata'}: no data files under it"),
             (tmp_path / "blank", "no text to train on: every data file is empty (1 files")]
    for data, says in cases:
        one_error_line(*cli(monkeypatch, capsys, "pretrain", "--data", data), "pretrain", says)


# -- the pretraining readers (rank 0 reads them while tokenizing) ----------------------------------------------

def test_pretrain_jsonl_bad_record_names_file_and_line(tmp_path):
    from tpzoo.data import iter_documents
    from tpzoo.errors import DataError

    path = tmp_path / "c.jsonl"
    path.write_text('{"text": "a"}\n\n{"text": "b"\n')
    with pytest.raises(DataError, match=rf"^{path}:3:13: invalid JSON: Expecting ',' delimiter$"):
        list(iter_documents(path))
    array = tmp_path / "d.json"
    array.write_text('[{"text": "a"},\n {"text": }]\n')
    with pytest.raises(DataError, match=rf"^{array}:2:11: invalid JSON: Expecting value$"):
        list(iter_documents(array))


def test_pretrain_jsonl_invalid_utf8_names_file_line_and_byte_offset(tmp_path):
    from tpzoo.data import iter_documents
    from tpzoo.errors import DataError

    path = tmp_path / "c.jsonl"
    head = b'{"text": "one"}\n{"text": "two"}\n'
    path.write_bytes(head + b'{"text": "\xff"}\n')
    with pytest.raises(DataError, match=rf"^{path}:3: invalid UTF-8 \(byte 0xff at byte offset {len(head) + 10}\)$"):
        list(iter_documents(path))


def test_a_jsonl_byte_order_mark_is_accepted(tmp_path):
    from tpzoo.data import iter_documents

    path = tmp_path / "bom.jsonl"
    path.write_bytes(b'\xef\xbb\xbf{"text": "a"}\n{"text": "b"}\n')
    assert list(iter_documents(path)) == ["a", "b"]


def test_pretrain_text_invalid_utf8_warns_with_file_line_and_offset(tmp_path):
    """Text corpora keep their documented policy (undecodable bytes become U+FFFD, one stray byte does not stop
    a corpus), now with a warning that says where."""
    from tpzoo.data import iter_documents

    path = tmp_path / "a.txt"
    path.write_bytes(b"line one\nline \xfe two\n")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        docs = list(iter_documents(path))
    assert docs == ["line one\nline \ufffd two\n"]
    assert [str(w.message) for w in caught] == [
        f"{path}:2: invalid UTF-8 (byte 0xfe at byte offset 14); undecodable bytes replaced with U+FFFD"]


# -- eval's text file ----------------------------------------------------------------------------------------

def test_eval_text_file_empty_or_not_utf8_fails_before_spawning(tmp_path, monkeypatch, capsys):
    ckpt = hf_config_dir(tmp_path / "ckpt")  # never opened: the text file is checked first
    text = tmp_path / "t.txt"
    text.write_bytes(b"")
    one_error_line(*cli(monkeypatch, capsys, "eval", ckpt, "--text-file", text), "eval", f"{text}: empty file")
    text.write_bytes(b"ok\n\x80")
    one_error_line(*cli(monkeypatch, capsys, "eval", ckpt, "--text-file", text), "eval",
                   f"{text}:2: invalid UTF-8 (byte 0x80 at byte offset 3)")
    one_error_line(*cli(monkeypatch, capsys, "eval", ckpt, "--text-file", tmp_path / "nope.txt"), "eval",
                   f"--text-file does not exist: {tmp_path / 'nope.txt'}")


# -- weighted mixtures and Megatron datasets, through `tpzoo pretrain` ------------------------------------------

def test_pretrain_bad_mixtures_and_megatron_files_are_one_line_with_nothing_written(tmp_path, monkeypatch, capsys):
    fixture = str(Path(__file__).parent / "fixtures" / "megatron" / "tiny_text_document")
    (tmp_path / "web.txt").write_text("some web text\n")
    (tmp_path / "code.txt").write_text("def f(): pass\n")
    web, code = tmp_path / "web.txt", tmp_path / "code.txt"
    shutil.copy(fixture + ".bin", tmp_path / "noidx.bin")
    for ext in (".bin", ".idx"):
        shutil.copy(fixture + ext, tmp_path / f"short{ext}")
    size = (tmp_path / "short.bin").stat().st_size
    os.truncate(tmp_path / "short.bin", size - 2)
    save = tmp_path / "run"
    cases = [(["0", web, "1", code], f"--data: the weight '0' of {web} is not a positive number"),
             (["-1", web, "1", code], f"--data: the weight '-1' of {web} is not a positive number"),
             (["0.7", web, "0.3"], "--data: the last weight 0.3 has no path (WEIGHT PATH pairs"),
             (["0.7", web, code], f"--data: '{code}' stands where a weight should (item 3)"),
             ([tmp_path / "noidx"], f"Megatron dataset index {tmp_path / 'noidx.idx'} is missing"),
             (["0.5", web, "0.5", tmp_path / "short"], f"{tmp_path / 'short.bin'}: {size - 2} bytes, but "
                                                      f"{tmp_path / 'short.idx'} describes {size}"),
             ([web, fixture], f"{fixture} is already tokenized and cannot be concatenated with other data")]
    for data, says in cases:
        one_error_line(*cli(monkeypatch, capsys, "pretrain", "--data", *data, "--save", save), "pretrain", says)
    toml = tmp_path / "run.toml"
    toml.write_text(f'[data.mix]\n"{web}" = 0.7\n"{code}" = "much"\n')
    one_error_line(*cli(monkeypatch, capsys, "pretrain", toml, "--save", save), "pretrain",
                   f"[data] mix: the weight 'much' of {code} is not a positive number")
    assert not save.exists() and sorted(p.name for p in tmp_path.iterdir()) == [
        "code.txt", "noidx.bin", "run.toml", "short.bin", "short.idx", "web.txt"]
