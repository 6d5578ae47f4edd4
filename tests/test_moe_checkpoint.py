"""Mixture-of-experts checkpoints: a tpzoo checkpoint holds every expert (expert parallelism is a runtime split,
not part of the on-disk layout), so HF -> tpzoo -> HF is bit-exact, and a model saved at (tp, ep) = (2, 2) loads
bit-exactly at (1, 4), (2, 1) and (1, 1): each rank reads only its experts' rows. At (tp, ep) = (1, 4) the
evaluation loss over 5 windows (4 replicas: three of them run a filler forward, the dispatch being collective)
equals transformers' on the same windows, and greedy generation equals transformers' generate."""
import torch
from safetensors.torch import load_file

import tpzoo
from tpzoo.checkpoint import convert_from_hf, convert_to_hf, load_model, save_model_shards
from tpzoo.checkpoint.tensors import expert_slice, hf_to_full
from tpzoo.evaluation import evaluate
from tpzoo.generation import generate
from tpzoo.models import from_hf_config
from tpzoo.parallel import ShardSpec, shard
from tpzoo.testing import run_on_ranks

from test_moe_hf_parity import make_hf_moe


def _same_as_hf(model, hf_path) -> int:
    """Every parameter of this rank equals its shard of the HF tensors, bit for bit; returns how many."""
    cfg = from_hf_config(hf_path)
    full = dict(hf_to_full(cfg, load_file(f"{hf_path}/model.safetensors")))
    dims = model.dims
    for name, p in model.named_parameters():
        want = expert_slice(full[name], p, dims)
        spec = getattr(p, "tp_spec", ShardSpec(None))
        if spec.dim is not None and name not in ("embed.weight", "lm_head.weight"):
            want = shard(want, spec, dims.tp_rank, dims.tp)
        if name in ("embed.weight", "lm_head.weight"):
            want = want.chunk(dims.tp)[dims.tp_rank] if want.shape[0] % dims.tp == 0 else None
            if want is None:
                continue  # vocab padding: covered by the dense checkpoint tests
        assert torch.equal(p.detach(), want), (name, dims.tp, dims.ep)
    return len(list(model.parameters()))


def _save_and_reload(hf_path, out_dir, layouts, stream, eval_loss, prompt, greedy):
    for i, (tp, ep) in enumerate(layouts):
        tpzoo.init_parallel(tp=tp, ep=ep)
        try:
            src = hf_path if i == 0 else out_dir
            model = load_model(src).eval()
            _same_as_hf(model, hf_path)
            if i == 0:
                save_model_shards(model, out_dir)
            if ep == 4:
                result = evaluate(model, stream, SEQ)
                assert abs(result["loss"] - eval_loss) <= 1e-5 * eval_loss, (result, eval_loss)
                out = generate(model, prompt, greedy.shape[1] - prompt.shape[1], greedy=True)
                assert torch.equal(out.cpu(), greedy)
        finally:
            tpzoo.destroy_parallel()


SEQ = 8


def _hf_eval_loss(model, stream) -> float:
    """transformers' causal-LM loss window by window (its cross-entropy of the SEQ inputs' next tokens, without
    the router loss: evaluation reports the language model's), weighted by predicted tokens."""
    total, n = 0.0, 0
    for s in range(0, len(stream) - 1, SEQ):
        w = stream[s:s + SEQ + 1][None]
        with torch.no_grad():
            out = model(input_ids=w[:, :-1])
        loss = torch.nn.functional.cross_entropy(out.logits[0], w[0, 1:])
        total, n = total + loss.item() * (w.shape[1] - 1), n + w.shape[1] - 1
    return total / n


def test_moe_checkpoint_round_trip_and_reshard_over_ep(tmp_path):
    hf = tmp_path / "hf"
    model = make_hf_moe("mixtral")
    model.save_pretrained(hf)
    stream = torch.randint(0, 101, (5 * SEQ + 1,), generator=torch.Generator().manual_seed(2))
    prompt = stream[None, :5]
    greedy = model.generate(prompt, max_new_tokens=6, min_new_tokens=6, do_sample=False)
    original = load_file(f"{hf}/model.safetensors")
    # Offline conversion at tp=2, pp=2 and back: bit-exact, every expert tensor by its HF name.
    convert_from_hf(hf, tmp_path / "tz", tp=2, pp=2)
    convert_to_hf(tmp_path / "tz", tmp_path / "back")
    back = load_file(f"{tmp_path}/back/model.safetensors")
    assert back.keys() == original.keys()
    assert all(torch.equal(back[k], original[k]) for k in original)
    # Saved by 4 ranks at (tp, ep) = (2, 2), loaded at other ep and tp, and exported: still bit-exact.
    saved = tmp_path / "ep2"
    saved.mkdir()
    run_on_ranks(4, _save_and_reload, str(hf), str(saved), [(2, 2), (1, 4), (2, 1), (1, 1)], stream,
                 _hf_eval_loss(model, stream), prompt, greedy)
    convert_to_hf(saved, tmp_path / "back2")
    back2 = load_file(f"{tmp_path}/back2/model.safetensors")
    assert all(torch.equal(back2[k], original[k]) for k in original)
