"""Evaluation loss equals transformers' loss on the same token windows, at tp/pp/dp/cp layouts and via the CLI
(self-spawned ranks, the checkpoint's own tokenizer)."""
import json
import math
import subprocess
import sys

import pytest
import torch

import tpzoo
from tpzoo.checkpoint import convert_from_hf, load_model
from tpzoo.evaluation import evaluate, token_windows
from tpzoo.testing import run_on_ranks

from checkpoint_helpers import TEXT, ids, write_hf

SEQ = 16


def _hf_loss(model, tokens, seq_len):
    total, count = 0.0, 0
    with torch.no_grad():
        for w in token_windows(tokens, seq_len):
            n = len(w) - 1
            total += model(input_ids=w[None], labels=w[None]).loss.item() * n
            count += n
    return total / count, count


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    root = tmp_path_factory.mktemp("eval")
    model = write_hf("qwen2", root / "hf", tokenizer=True)
    convert_from_hf(root / "hf", root / "ckpt", tp=2, pp=1, progress=False)
    return root, model


def _eval_layouts(path, tokens):
    out = []
    # (1, 1, 1) on 4 ranks: 4 data-parallel replicas; cp: context parallel (the short last window padded to whole
    # chunks), with sequence parallelism inside each cp rank, and the all-to-all mode.
    for tp, pp, cp, mode, sp in ((2, 2, 1, "ring", False), (4, 1, 1, "ring", False), (1, 1, 1, "ring", False),
                                 (2, 1, 2, "ring", True), (1, 1, 4, "a2a", False)):
        tpzoo.init_parallel(tp=tp, pp=pp, cp=cp)
        model = load_model(path, device="cpu", sequence_parallel=sp, cp_mode=mode).eval()
        out.append(evaluate(model, tokens, SEQ, batch_size=2))
        tpzoo.destroy_parallel()
    return out


def test_eval_loss_matches_transformers(ckpt):
    root, model = ckpt
    tokens = ids(batch=1, seq=75, seed=2)[0]  # 74 predictions: 4 full windows of 16 and a short one
    ref_loss, count = _hf_loss(model, tokens, SEQ)
    for result in run_on_ranks(4, _eval_layouts, str(root / "ckpt"), tokens)[0]:
        assert result["tokens"] == count == 74
        assert math.isclose(result["loss"], ref_loss, rel_tol=1e-5)
        assert math.isclose(result["perplexity"], math.exp(ref_loss), rel_tol=1e-5)


def test_eval_command_self_spawns(ckpt, tmp_path):
    from transformers import AutoTokenizer

    root, model = ckpt
    text = tmp_path / "valid.txt"
    text.write_text(TEXT)
    proc = subprocess.run([sys.executable, "-m", "tpzoo", "eval", str(root / "ckpt"), "--text-file", str(text),
                           "--seq-len", str(SEQ), "--batch-size", "3", "--pp", "2"],
                          capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    tokens = torch.tensor(AutoTokenizer.from_pretrained(root / "ckpt")(TEXT, add_special_tokens=False)["input_ids"])
    ref_loss, count = _hf_loss(model, tokens, SEQ)
    assert (result["tokens"], result["pp"]) == (count, 2)
    assert math.isclose(result["loss"], ref_loss, rel_tol=1e-5)
