"""Each family, built from tpzoo parallel layers at tp = 1, 2, 4 (with and without sequence parallelism),
gives the logits and loss of transformers' own implementation on the same weights."""
import pytest
import torch
from safetensors.torch import load_file

import tpzoo
from tpzoo.checkpoint.tensors import hf_to_full, load_full_tensors
from tpzoo.models import Inputs, ModelLayout, Transformer, from_hf_config
from tpzoo.parallel import get_tp_rank, get_tp_size
from tpzoo.testing import run_on_ranks

from hf_models import VOCAB, save_hf_model

KINDS = ["gpt2", "llama", "llama31-tied", "mistral", "qwen2", "qwen3", "olmo2", "gemma2", "gemma3", "smollm3", "phi3"]


@pytest.fixture(scope="module")
def hf_dirs(tmp_path_factory):
    out = {}
    ids = torch.randint(0, VOCAB, (2, 24), generator=torch.Generator().manual_seed(5))
    for kind in KINDS:
        path = tmp_path_factory.mktemp(kind)
        model = save_hf_model(kind, path)
        with torch.no_grad():
            res = model(input_ids=ids, labels=ids)
        out[kind] = (str(path), ids, res.logits, res.loss)
    return out


def _load_tpzoo(path, tp, sp):
    tpzoo.init_parallel(tp=tp)
    cfg = from_hf_config(path)
    hf = load_file(f"{path}/model.safetensors")
    full = dict(hf_to_full(cfg, hf))
    model = Transformer(cfg, ModelLayout(sequence_parallel=sp))
    load_full_tensors(model, full.__getitem__, get_tp_rank(), get_tp_size())
    return model.eval()


def _check_logits(path, ids, ref_logits, ref_loss, tp, sp):
    model = _load_tpzoo(path, tp, sp)
    with torch.no_grad():
        logits = model.full_logits(model(ids))
        torch.testing.assert_close(logits, ref_logits, rtol=1e-4, atol=1e-4)
        # HF's loss: mean next-token cross-entropy
        labels = torch.cat([ids[:, 1:], torch.full_like(ids[:, :1], -100)], dim=1)
        per_token = model(Inputs(ids, labels=labels))
        loss = per_token.sum() / (labels != -100).sum()
        torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-5)
    return model.cfg.num_kv_heads


@pytest.mark.parametrize("kind", KINDS)
def test_logits_and_loss_match_transformers(hf_dirs, kind):
    path, ids, logits, loss = hf_dirs[kind]
    for tp in (1, 2, 4):
        for sp in ((False, True) if tp > 1 else (False,)):
            run_on_ranks(4, _check_logits, path, ids, logits, loss, tp, sp)
