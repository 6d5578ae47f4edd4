"""tpzoo.data.sft: prompt masking for both record formats, chat template path, packing, padding, held-out split."""
import json

import numpy as np
import pytest
import torch

from tpzoo.data import (IGNORE_INDEX, PackedSFTDataset, PaddedSFTDataset, ResumableLoader, build_sft_dataset,
                        build_sft_datasets, encode_sft_example, load_sft_records, load_tokenizer, split_records,
                        train_bpe)
from tpzoo.data.sft import pack_lengths

PR = [{"prompt": "What is 2+2? ", "response": "4"}, {"prompt": "Say hi.\n", "response": "Hi there, friend!"},
      {"prompt": "Translate 'chat': ", "response": "le chat — 🐈"}]
CHATS = [{"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a color."},
                       {"role": "assistant", "content": "Blue."}, {"role": "user", "content": "Another?"},
                       {"role": "assistant", "content": "Green."}]},
         {"messages": [{"role": "user", "content": "Hello"}, {"role": "assistant", "content": "Hi! How can I help?"}]}]
TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
            "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def _trained(ids, mask):
    return [t for t, m in zip(ids, mask) if m]


def _responses(record):
    if "messages" in record:
        return [m["content"] for m in record["messages"] if m["role"] == "assistant"]
    return [record["response"]]


@pytest.fixture(scope="module")
def chat_tok(tmp_path_factory):
    out = tmp_path_factory.mktemp("bpe")
    texts = [json.dumps(r) for r in PR + CHATS] * 5
    train_bpe(texts, vocab_size=320, out_dir=out, chat_template=TEMPLATE)
    return load_tokenizer(out)


@pytest.mark.parametrize("records", [PR, CHATS], ids=["prompt_response", "messages"])
def test_fallback_format_trains_exactly_on_responses_and_eos(records):
    tok = load_tokenizer("byte")
    for r in records:
        ids, mask = encode_sft_example(r, tok)
        assert len(ids) == len(mask) and ids[-1] == tok.eos_id
        expected = [t for resp in _responses(r) for t in tok.encode(resp) + [tok.eos_id]]
        assert _trained(ids, mask) == expected  # every response token and its EOS, nothing else
        assert tok.decode(ids).startswith("<|")  # role headers are text in the fallback format
    ids, mask = encode_sft_example(PR[0], tok, template="raw")
    assert ids == tok.encode(PR[0]["prompt"]) + tok.encode(PR[0]["response"]) + [tok.eos_id]
    assert mask == [False] * len(tok.encode(PR[0]["prompt"])) + [True] * (len(tok.encode("4")) + 1)


def test_chat_template_path_masks_prompts_exactly(chat_tok):
    assert chat_tok.chat_template is not None
    for r in CHATS + PR:
        ids, mask = encode_sft_example(r, chat_tok)
        msgs = r.get("messages") or [{"role": "user", "content": r["prompt"]},
                                     {"role": "assistant", "content": r["response"]}]
        rendered = chat_tok.apply_chat_template(msgs)
        assert chat_tok.decode(ids[:-1]) == rendered and ids[-1] == chat_tok.eos_id  # EOS appended once
        trained_text = chat_tok.decode(_trained(ids, mask)[:-1])
        assert trained_text == "".join(c + "<|im_end|>\n" for c in _responses(r))  # the template's turn text
        assert "user" not in trained_text and "system" not in trained_text


def test_padding_dataset():
    tok = load_tokenizer("byte")
    seq = 40
    ds = build_sft_dataset(PR, tok, seq, packing=False, template="raw")
    assert isinstance(ds, PaddedSFTDataset) and len(ds) == 3
    for r, i in zip(PR, range(len(ds))):
        s = ds[i]
        p, a = tok.encode(r["prompt"]), tok.encode(r["response"]) + [tok.eos_id]
        ids = (p + a)[:seq + 1]
        n = len(ids) - 1
        assert s["input_ids"].tolist() == ids[:-1] + [tok.pad_id] * (seq - n)
        assert s["labels"].tolist() == ([IGNORE_INDEX] * (len(p) - 1) + a)[:n] + [IGNORE_INDEX] * (seq - n)
    with pytest.warns(UserWarning, match="dropped"):
        short = build_sft_dataset([{"prompt": "x" * 50, "response": "y"}] + PR, tok, 20, packing=False,
                                  template="raw")
    assert short.num_dropped == 1 and len(short) == 3 and short.num_truncated >= 1
    for packing in (False, True):  # nothing left to train: one line naming seq_len, not an empty loader later
        with pytest.raises(ValueError, match=r"none of the 3 SFT examples .* seq_len \+ 1 = 4 tokens"):
            build_sft_dataset(PR, tok, 3, packing=packing, template="raw")


def test_packing_keeps_whole_examples_with_their_documents_and_positions():
    """Each trainable example sits whole in exactly one packed sample: its slots hold exactly what its padded
    sample holds (inputs, labels), with one document id and positions 0, 1, ...; the padding is the last
    document; no sample was opened while an earlier one had room."""
    tok = load_tokenizer("byte")
    seq = 64
    records = (PR + CHATS) * 3 + [{"prompt": "x", "response": "y" * i} for i in range(12)]
    ds = build_sft_dataset(records, tok, seq, packing=True)
    padded = build_sft_dataset(records, tok, seq, packing=False)
    assert isinstance(ds, PackedSFTDataset) and len(ds.examples) == len(padded)
    assert (ds.num_dropped, ds.num_truncated) == (padded.num_dropped, padded.num_truncated) and ds.num_truncated
    assert sorted(j for row in ds.rows for j in row) == list(range(len(padded)))  # every example, once
    lengths = [len(ids) - 1 for ids, _ in ds.examples]
    assert len(ds) < len(padded) and len(ds) <= 1 + sum(lengths) // seq + sum(n > seq // 2 for n in lengths)
    for i in range(len(ds)):
        s = ds[i]
        assert set(s) == {"input_ids", "labels", "token_mask", "doc_ids", "position_ids"}
        at = 0
        for d, j in enumerate(ds.rows[i]):
            n, ref = lengths[j], padded[j]
            seg = slice(at, at + n)
            assert s["input_ids"][seg].tolist() == ref["input_ids"][:n].tolist()
            assert s["labels"][seg].tolist() == ref["labels"][:n].tolist()
            assert s["doc_ids"][seg].tolist() == [d] * n and s["position_ids"][seg].tolist() == list(range(n))
            at += n
        rest = seq - at
        assert s["input_ids"][at:].tolist() == [tok.pad_id] * rest and (s["labels"][at:] == IGNORE_INDEX).all()
        assert s["doc_ids"][at:].tolist() == [len(ds.rows[i])] * rest
        assert s["position_ids"][at:].tolist() == list(range(rest))
        assert s["token_mask"].tolist() == [1] * at + [0] * rest
    free = [seq - sum(lengths[j] for j in row) for row in ds.rows]
    for i, row in enumerate(ds.rows):  # a sample is only opened for an example that no earlier one had room for
        assert all(f < lengths[row[0]] for f in free[:i])


def test_pack_lengths_is_best_fit_decreasing():
    assert pack_lengths([5, 3, 7, 2, 4, 1], 10) == [[2, 1], [0, 4, 5], [3]]
    assert pack_lengths([10, 10], 10) == [[0], [1]] and pack_lengths([], 4) == []
    assert pack_lengths([6, 4, 5, 5], 10) == [[0, 1], [2, 3]]  # 5 goes to the fullest bin it fits


def test_held_out_split_is_deterministic_and_disjoint(tmp_path):
    records = [{"prompt": f"q{i} ", "response": f"a{i}"} for i in range(50)]
    train, held = split_records(records, 0.2, seed=3)
    assert len(held) == 10 and len(train) == 40
    assert {r["prompt"] for r in train}.isdisjoint({r["prompt"] for r in held})
    assert (train, held) == split_records(records, 0.2, seed=3) and held != split_records(records, 0.2, seed=4)[1]
    assert split_records(records[:3], 0.01)[1] != []  # at least one held out
    path = tmp_path / "sft.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    sets = build_sft_datasets(path, "byte", 64, packing=False, eval_fraction=0.2, seed=3)
    assert len(sets.train) == 40 and len(sets.eval) == 10
    assert build_sft_datasets(path, "byte", 64).eval is None


def test_sft_batches_through_the_resumable_loader():
    ds = build_sft_dataset((PR + CHATS) * 6, "byte", 64, packing=True)
    straight = ResumableLoader(ds, 2, seed=0, prefetch=0)
    expected = [next(straight) for _ in range(6)]
    first = ResumableLoader(ds, 2, seed=0)
    got = [next(first) for _ in range(2)]
    resumed = ResumableLoader(ds, 2, seed=0)
    resumed.load_state_dict(first.state_dict())
    first.close()
    got += [next(resumed) for _ in range(4)]
    resumed.close()
    keys = ("input_ids", "labels", "token_mask", "doc_ids", "position_ids")
    assert all(set(a) == set(keys) and torch.equal(a[k], b[k]) for a, b in zip(got, expected) for k in keys)
    assert expected[0]["labels"].dtype == torch.long and expected[0]["labels"].shape == (2, 64)


def test_invalid_records_name_the_line(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text(json.dumps(PR[0]) + "\n" + json.dumps({"messages": [{"role": "user", "content": "hi"}]}) + "\n")
    with pytest.raises(ValueError, match=r"bad\.jsonl:2: no assistant message"):
        load_sft_records(path)
    path.write_text(json.dumps({"question": "x"}) + "\n")
    with pytest.raises(ValueError, match=r"bad\.jsonl:1: expected"):
        load_sft_records(path)
    with pytest.raises(ValueError, match="raw"):
        encode_sft_example(CHATS[0], "byte", template="raw")
