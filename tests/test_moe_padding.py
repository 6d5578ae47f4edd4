"""A mixture of experts' router losses never count an SFT sample's padding.

SFT samples (padded one per row, or packed) carry `token_mask`; the router statistics count only its tokens.
- transformers as the oracle: a tiny Mixtral / Qwen3-MoE (save_pretrained) on padded SFT rows with
  `attention_mask` gives the same load-balancing loss as ours with the sample's `token_mask` (1e-6); without
  the mask ours is HF's unmasked loss, and the two differ (so the comparison can fail).
- packing: a packed micro-batch's aux and z-losses equal those of the same examples padded one per row (the same
  tokens are counted); without the mask they differ.
- context parallelism: `shard_batch` shards the sample's mask like the tokens, its own padding 0."""
import types
import warnings

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from tpzoo.checkpoint.tensors import hf_to_full, load_full_tensors
from tpzoo.data import PackedSFTDataset, PaddedSFTDataset, collate_long
from tpzoo.models import Inputs, Transformer, from_hf_config, get_config
from tpzoo.parallel.context_parallel import padded_length, shard_batch
from tpzoo.parallel.ring_attention import local_positions

from test_moe_hf_parity import VOCAB, make_hf_moe

SEQ = 12


def _examples(vocab: int, n: int = 10) -> list:
    g = np.random.default_rng(11)
    return [(g.integers(1, vocab, int(k)).tolist(), [i > 1 for i in range(int(k))]) for k in g.integers(3, 9, n)]


def _datasets(vocab: int):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (none is dropped here; the datasets warn for those)
        return PackedSFTDataset(_examples(vocab), SEQ, 0), PaddedSFTDataset(_examples(vocab), SEQ, 0)


def test_sft_samples_mark_their_padding():
    packed, padded = _datasets(VOCAB)
    for data in (packed, padded):
        for i in range(len(data)):
            s = data[i]
            real = int(s["token_mask"].sum())
            assert s["token_mask"].tolist() == [1] * real + [0] * (SEQ - real)
            assert (s["input_ids"][real:] == 0).all()  # the pad id
    assert padded[0]["token_mask"].sum() == len(padded.examples[0][0]) - 1  # the example's input tokens


@pytest.mark.parametrize("kind", ["mixtral", "qwen3_moe"])
def test_padded_aux_loss_equals_transformers_with_the_attention_mask(tmp_path, kind):
    hf = make_hf_moe(kind)
    hf.save_pretrained(tmp_path)
    cfg = from_hf_config(str(tmp_path))
    ours = Transformer(cfg)
    load_full_tensors(ours, dict(hf_to_full(cfg, load_file(tmp_path / "model.safetensors"))).__getitem__, 0, 1)
    ours.eval()
    _, padded = _datasets(VOCAB)
    batch = collate_long([padded[i] for i in range(4)])
    ids, mask = batch["input_ids"], batch["token_mask"]
    assert (mask == 0).any()
    with torch.no_grad():
        theirs_masked = hf(input_ids=ids, attention_mask=mask).aux_loss
        theirs_unmasked = hf(input_ids=ids).aux_loss
        ours(Inputs(ids, token_mask=mask))
        masked = ours.aux_reports["router_aux_loss"].clone()
        ours(ids)
        unmasked = ours.aux_reports["router_aux_loss"].clone()
    torch.testing.assert_close(masked, theirs_masked, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(unmasked, theirs_unmasked, rtol=1e-6, atol=1e-6)
    assert abs(float(theirs_masked - theirs_unmasked)) > 1e-3  # padding would change it


def test_packed_router_losses_equal_the_same_examples_padded():
    cfg = get_config("nano-mixtral").replace(output_router_logits=True, router_aux_loss_coef=0.02,
                                              router_z_loss_coef=1e-3, initializer_range=0.2)
    model = Transformer(cfg, seed=0).eval()
    packed, padded = _datasets(cfg.vocab_size)
    rows = [0, 1]
    p = collate_long([packed[i] for i in rows])
    q = collate_long([padded[j] for i in rows for j in packed.rows[i]])
    assert sum(len(packed.rows[i]) for i in rows) > len(rows)  # some row holds several examples

    def losses(batch, masked=True):
        with torch.no_grad():
            model(Inputs(batch["input_ids"], labels=batch["labels"], positions=batch.get("position_ids"),
                         doc_ids=batch.get("doc_ids"), token_mask=batch["token_mask"] if masked else None))
        return torch.stack([model.aux_reports["router_aux_loss"], model.aux_reports["router_z_loss"]])

    torch.testing.assert_close(losses(p), losses(q), rtol=1e-6, atol=1e-7)
    assert not torch.allclose(losses(p, masked=False), losses(q, masked=False), rtol=1e-4)


@pytest.mark.parametrize("cp_rank", [0, 1])
def test_context_parallel_shards_the_samples_mask(cp_rank):
    _, padded = _datasets(VOCAB)
    batch = collate_long([padded[i] for i in range(3)])
    s = batch["input_ids"].shape[1] - 2  # a length that cp = 2 pads (to 12)
    batch = {k: v[:, :s] for k, v in batch.items()}
    dims = types.SimpleNamespace(cp=2, cp_rank=cp_rank, tp=1)
    out = shard_batch(batch, dims)
    total = padded_length(s, 2)
    assert total > s
    pos = local_positions(total // 4, 2, cp_rank, "cpu")
    whole = torch.cat([batch["token_mask"], torch.zeros(3, total - s, dtype=torch.int64)], dim=1)
    assert torch.equal(out["token_mask"], whole[:, pos])
    assert out["token_mask"].shape == out["input_ids"].shape
