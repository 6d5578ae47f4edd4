"""tpzoo.data.tokenizer: the byte tokenizer, a locally trained BPE loaded from a directory, loading errors."""
import json

import pytest

from tpzoo.data import ByteTokenizer, HFTokenizer, load_tokenizer, train_bpe
from tpzoo.data.tokenizer import BYTE_MARKER

SAMPLES = ["", "hello world", "déjà vu — naïve café", "日本語のテキスト",
           "emoji 🙂🚀 and \x00 control \t\n\r",
           "mixed ascii/ünïcödé\nlines\n\n", "ﬁ ligature, Ω, 𝔘𝔫𝔦𝔠𝔬𝔡𝔢"]
CORPUS = ["def add(a, b):\n    return a + b\n", "the quick brown fox jumps over the lazy dog. " * 8,
          "import os\nimport sys\nprint(os.getcwd(), sys.argv)\n", "déjà vu, naïve café, 日本語 🙂"] * 4


def test_byte_tokenizer_round_trips_arbitrary_utf8():
    tok = load_tokenizer("byte")
    assert isinstance(tok, ByteTokenizer)
    assert tok.vocab_size == 259 and (tok.eos_id, tok.bos_id, tok.pad_id) == (256, 257, 258)
    for s in SAMPLES:
        ids = tok.encode(s)
        assert ids == list(s.encode("utf-8")) and all(0 <= i < 256 for i in ids)
        assert tok.decode(ids) == s
        assert tok.decode([tok.bos_id] + ids + [tok.eos_id, tok.pad_id]) == s  # special ids are dropped
    assert tok.encode_batch(SAMPLES) == [tok.encode(s) for s in SAMPLES]
    assert tok.decode([0xFF, 0x41]) == "\ufffdA"  # invalid UTF-8 decodes, with a replacement character
    assert tok.apply_chat_template([{"role": "user", "content": "hi"}]) is None


def test_byte_tokenizer_saves_a_marker_and_reloads_from_a_checkpoint_dir(tmp_path):
    ByteTokenizer().save(tmp_path / "ckpt" / "tokenizer")
    assert json.loads((tmp_path / "ckpt" / "tokenizer" / BYTE_MARKER).read_text())["type"] == "byte"
    for spec in (tmp_path / "ckpt" / "tokenizer", tmp_path / "ckpt"):  # the dir itself, or a checkpoint above
        assert isinstance(load_tokenizer(spec), ByteTokenizer)


def test_trained_bpe_loads_from_a_directory_and_round_trips(tmp_path):
    out = tmp_path / "bpe"
    trained = train_bpe(CORPUS, vocab_size=320, out_dir=out)
    assert (out / "tokenizer.json").is_file()
    tok = load_tokenizer(str(out))
    assert isinstance(tok, HFTokenizer) and tok.vocab_size == trained.vocab_size <= 320
    assert tok.vocab_size > 259  # merges were learned
    assert tok.eos_id == 0 and tok.pad_id == 1 and tok.bos_id is None
    for s in SAMPLES:
        ids = tok.encode(s)
        assert all(0 <= i < tok.vocab_size for i in ids)
        assert tok.decode(ids) == s
    assert len(tok.encode("the quick brown fox")) < len("the quick brown fox")  # merges compress
    assert tok.encode_batch(SAMPLES) == [tok.encode(s) for s in SAMPLES]
    assert tok.apply_chat_template([{"role": "user", "content": "hi"}]) is None

    tok.save(tmp_path / "ckpt")  # a checkpoint dir holding HF tokenizer files
    again = load_tokenizer(tmp_path / "ckpt")
    assert [again.encode(s) for s in SAMPLES] == [tok.encode(s) for s in SAMPLES]


def test_chat_template_survives_save_and_load(tmp_path):
    template = ("{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}"
                "{% if add_generation_prompt %}<assistant>{% endif %}")
    tok = train_bpe(CORPUS, vocab_size=300, out_dir=tmp_path / "bpe", chat_template=template)
    tok = load_tokenizer(tmp_path / "bpe")
    msgs = [{"role": "user", "content": "hi"}]
    assert tok.apply_chat_template(msgs) == "<user>hi"
    assert tok.apply_chat_template(msgs, add_generation_prompt=True) == "<user>hi<assistant>"


def test_load_errors_are_clear(tmp_path):
    with pytest.raises(FileNotFoundError, match="no tokenizer in directory"):
        load_tokenizer(tmp_path)
    (tmp_path / "f.txt").write_text("x")
    with pytest.raises(ValueError, match="is a file"):
        load_tokenizer(tmp_path / "f.txt")
    with pytest.raises(FileNotFoundError, match="never downloads"):
        load_tokenizer("surely-not-a-cached-model/xyz-123")
