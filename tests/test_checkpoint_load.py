"""load_model at the current layout (resharding on load) gives transformers' logits and loss; save_model_shards
(collective) writes a checkpoint that converts back to the original HF weights bit for bit."""
import pytest
import torch

import tpzoo
from tpzoo.checkpoint import atomic_dir, convert_from_hf, convert_to_hf, load_model, read_manifest, save_model_shards
from tpzoo.models import Inputs
from tpzoo.pipeline import pipeline_forward
from tpzoo.testing import run_on_ranks

from checkpoint_helpers import KINDS, assert_bit_exact, ids, safetensors_dir, write_hf


@pytest.fixture(scope="module")
def stores(tmp_path_factory):
    """Per kind: the HF dir, a tpzoo checkpoint at tp2pp1 converted from it (sharded HF input for llama) and at
    tp1pp2, and transformers' logits and loss on a fixed batch."""
    root = tmp_path_factory.mktemp("load")
    x = ids()
    out = {}
    for kind in KINDS:
        model = write_hf(kind, root / kind, max_shard_size="40KB" if kind == "llama" else None)
        convert_from_hf(root / kind, root / f"{kind}-t2p1", tp=2, pp=1, progress=False)
        convert_from_hf(root / kind, root / f"{kind}-t1p2", tp=1, pp=2, progress=False)
        with torch.no_grad():
            res = model(input_ids=x, labels=x)
        out[kind] = (str(root / kind), str(root / f"{kind}-t2p1"), str(root / f"{kind}-t1p2"), res.logits, res.loss)
    return x, out


def _parity_at_tp(x, cases, tps):
    for tp in tps:
        tpzoo.init_parallel(tp=tp)
        for paths, ref_logits in cases:
            for path in paths:
                model = load_model(path, device="cpu").eval()
                with torch.no_grad():
                    logits = model.full_logits(model(x))
                torch.testing.assert_close(logits, ref_logits, rtol=1e-4, atol=1e-4, msg=f"{path} at tp={tp}")
        tpzoo.destroy_parallel()


def test_logits_match_transformers_at_tp_1_2_4(stores):
    x, out = stores
    cases = [((hf, t2, t1p2), logits) for hf, t2, t1p2, logits, _ in out.values()]
    run_on_ranks(4, _parity_at_tp, x, cases, (1, 2, 4))


def _pipeline_parity(x, path, ref_logits, ref_loss):
    tpzoo.init_parallel(tp=2, pp=2)
    model = load_model(path, device="cpu").eval()
    labels = torch.cat([x[:, 1:], torch.full_like(x[:, :1], -100)], dim=1)
    with torch.no_grad():
        logits = pipeline_forward(model, x)
        per_token = pipeline_forward(model, x, labels)
    if model.post_process:
        torch.testing.assert_close(model.full_logits(logits), ref_logits, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(per_token.sum() / (labels != -100).sum(), ref_loss, rtol=1e-5, atol=1e-5)
    return model.stage.layers.start, model.stage.layers.stop


@pytest.mark.parametrize("kind", ["llama31-tied", "gpt2"])
def test_pipeline_stages_from_a_tp_only_checkpoint(stores, kind):
    x, out = stores
    hf, t2, _, logits, loss = out[kind]
    ranges = run_on_ranks(4, _pipeline_parity, x, t2, logits, loss)
    assert ranges == [(0, 1), (0, 1), (1, 2), (1, 2)]


def _save_collectively(src, final, tokenizer_dir):
    tpzoo.init_parallel(tp=2, pp=2)
    model = load_model(src, device="cpu")
    with atomic_dir(final) as tmp:
        save_model_shards(model, tmp, tokenizer=tokenizer_dir, metadata={"step": 7})


def test_save_model_shards_round_trip(stores, tmp_path):
    _, out = stores
    hf, _, t1p2, _, _ = out["llama"]
    run_on_ranks(4, _save_collectively, t1p2, str(tmp_path / "saved"), hf)
    m = read_manifest(tmp_path / "saved")
    assert (m["tp"], m["pp"], m["metadata"], m["layer_to_stage"]) == (2, 2, {"step": 7}, [0, 1])
    assert [f for f in (tmp_path / "saved").iterdir() if f.name.startswith(".")] == []
    convert_to_hf(tmp_path / "saved", tmp_path / "hf", progress=False)
    assert_bit_exact(safetensors_dir(hf), safetensors_dir(tmp_path / "hf"))


def test_virtual_stages_load_as_chunks(stores, tmp_path):
    x, out = stores
    hf, _, _, logits, _ = out["mistral"]
    convert_from_hf(hf, tmp_path / "v2", tp=1, pp=1, virtual_stages=2, progress=False)
    first, last = load_model(tmp_path / "v2", device="cpu")
    assert [(c.stage.layers.start, c.stage.layers.stop) for c in (first, last)] == [(0, 1), (1, 2)]
    with torch.no_grad():
        got = last.full_logits(last(Inputs(hidden=first(x))))
    torch.testing.assert_close(got, logits, rtol=1e-4, atol=1e-4)
    single = load_model(tmp_path / "v2", device="cpu", virtual_stages=1, dtype=torch.bfloat16, sequence_parallel=True)
    assert single.stage.layers == range(0, 2) and single.embed.weight.dtype == torch.bfloat16
    # the parallel layers' parameter attributes survive loading (trainers rely on them)
    assert all(hasattr(p, "tp_spec") for p in single.parameters())
    assert single.layers["1"].mlp_norm.weight.sequence_parallel and not single.embed.weight.sequence_parallel


def _save_into_missing_dir(src, where):
    tpzoo.init_parallel(tp=2, pp=2)
    model = load_model(src, device="cpu")
    try:
        save_model_shards(model, where)
    except Exception as e:  # noqa: BLE001 - every rank must see the failure, none may hang
        return str(e)
    return "no error"


def test_save_failure_reaches_every_rank(stores, tmp_path):
    _, out = stores
    errors = run_on_ranks(4, _save_into_missing_dir, out["gpt2"][2], str(tmp_path / "no" / "such" / "dir"))
    assert all("saving the checkpoint failed" in e and "No such file" in e for e in errors), errors


def test_load_weights_into_existing_model(stores):
    from tpzoo.checkpoint import load_weights_into
    from tpzoo.models import Transformer

    x, out = stores
    hf, t2, _, logits, _ = out["qwen2"]
    loaded = load_model(t2, device="cpu")
    model = Transformer(loaded.cfg, seed=123)  # random weights, then overwritten from a HF weights file
    load_weights_into(model, f"{hf}/model.safetensors")
    for (name, a), (_, b) in zip(loaded.named_parameters(), model.named_parameters()):
        assert torch.equal(a, b), name
    with torch.no_grad():
        torch.testing.assert_close(model.full_logits(model.eval()(x)), logits, rtol=1e-4, atol=1e-4)
