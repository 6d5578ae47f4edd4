"""DeepSeek-V3.2, GLM-5, GLM-4.7-Flash and Mistral Small 4 against transformers (tests/dsa_models.py: tiny random
models written by save_pretrained, index_topk 5 below every sequence here), fp32:

- conversion: `convert from-hf` at tp 2 then `convert to-hf` gives every tensor back bit for bit (the indexers' and
  the selection biases included; GLM-5's shared layers have no indexer tensors on either side) and config.json as
  transformers wrote it;
- evaluation: `tpzoo.evaluation.evaluate`'s loss equals transformers' within 1e-4 at tp 1 (in one process) and at
  tp 2 + SP, pp 2, ep 2 and cp 2 on 2 gloo ranks (one pool call for every family and layout);
- generation: greedy `generate` (the latent cache plus the indexer's keys) equals transformers' `generate`, in one
  process and at tp 2;
- packing: a packed row's per-token losses equal those of its documents run alone (tp 1, tp 2 + SP, cp 2);
- the comparisons can fail: the sparse mask dropped (every visible key attended), the indexer's weights not loaded
  (left at their initialization), each moves the loss beyond the tolerance.
Parameter counts of the built models equal ModelConfig.num_parameters for the named configs, and those docs/models.md
sets beside the published figures."""
import json
from pathlib import Path

import pytest
import torch
from dsa_models import KINDS, TOPK, VOCAB, make_hf_model
from test_frontier_families import BATCH, SEQ, _ours_loss, _tensors, hf_runs_of

import tpzoo
from tpzoo.checkpoint import convert_from_hf, convert_to_hf, load_model
from tpzoo.generation import generate
from tpzoo.models import Inputs, from_hf_config, to_hf_config
from tpzoo.parallel import comm
from tpzoo.parallel.context_parallel import shard_batch
from tpzoo.parallel.ulysses import gathered_order
from tpzoo.testing import run_on_ranks

assert TOPK < SEQ  # the sparse mask acts
PROMPT = torch.randint(0, VOCAB, (2, 7), generator=torch.Generator().manual_seed(4))
NEW = 6
LAYOUTS = [dict(tp=2, sp=True), dict(pp=2), dict(ep=2), dict(cp=2)]
DOCS = [9, 7, 8]  # a packed row of three documents (24 tokens)


@pytest.fixture(scope="module")
def hf_runs(tmp_path_factory):
    """{kind: (HF directory, transformers' loss, transformers' greedy continuation of PROMPT)}."""
    return hf_runs_of(tmp_path_factory, KINDS, make_hf_model, PROMPT, NEW)


# -- conversion ---------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("kind", KINDS)
def test_round_trip_at_tp2_is_bit_exact(hf_runs, kind, tmp_path):
    src = hf_runs[kind][0]
    convert_from_hf(src, tmp_path / "tp2", tp=2, progress=False)
    convert_to_hf(str(tmp_path / "tp2"), tmp_path / "back", progress=False)
    original, back = _tensors(Path(src)), _tensors(tmp_path / "back")
    assert sorted(back) == sorted(original)
    for name, t in original.items():
        assert back[name].dtype == t.dtype and torch.equal(back[name], t), name
    indexers = {n.split(".")[2] for n in original if ".indexer." in n}
    want = {"deepseek_v32": {"0", "1", "2"}, "glm_moe_dsa": {"0", "2"}}.get(kind, set())  # GLM-5: F S F S
    assert indexers == want
    # the family writes transformers' config back (the export writes the source's own when nothing changed)
    config = {k: v for k, v in json.loads((Path(src) / "config.json").read_text()).items()
              if k not in ("transformers_version", "dtype")}
    written = to_hf_config(from_hf_config(src))
    assert {k: written.get(k) for k in config} == config
    assert set(written) <= set(config) | {"dtype", "transformers_version"}


# -- evaluation, generation, packing ------------------------------------------------------------------------------

def _packed_losses(model, dims=None, sp: bool = False):
    """(per-token losses of the packed row, of its documents alone concatenated) at this rank's layout, every token
    of the row gathered (cp: the rank's tokens put back in place)."""
    g = torch.Generator().manual_seed(5)
    ids = torch.randint(0, VOCAB, (1, sum(DOCS)), generator=g)
    labels = torch.cat([ids[:, 1:], torch.full((1, 1), -100)], dim=1)
    doc_ids = torch.cat([torch.full((n,), i) for i, n in enumerate(DOCS)]).unsqueeze(0)
    ends = torch.tensor(DOCS).cumsum(0) - 1
    labels[0, ends] = -100  # (a document's last token predicts nothing of the next)
    model.eval()

    def run(batch):
        cp = dims.cp if dims is not None else 1
        local = shard_batch(batch, dims, sp) if cp > 1 else batch
        with torch.no_grad():
            per_token = model(Inputs.from_batch(local, model.device))
        if cp == 1:
            return per_token
        _, natural = gathered_order(per_token.shape[1] // 2, cp, per_token.device)
        full = comm.all_gather(per_token.contiguous(), dims.cp_group, dim=1).index_select(1, natural)
        return full[:, :batch["input_ids"].shape[1]]

    packed = run({"input_ids": ids, "labels": labels, "doc_ids": doc_ids})
    alone = []
    for i, (start, n) in enumerate(zip([0, *ends[:-1] + 1], DOCS)):
        pad = 12 - n  # documents padded to one length (ignored labels at the end: causality hides them)
        d_ids = torch.cat([ids[:, start:start + n], torch.zeros(1, pad, dtype=ids.dtype)], dim=1)
        d_labels = torch.cat([labels[:, start:start + n], torch.full((1, pad), -100)], dim=1)
        alone.append(run({"input_ids": d_ids, "labels": d_labels})[:, :n])
    return packed, torch.cat(alone, dim=1)


@pytest.mark.parametrize("kind", KINDS)
def test_eval_generation_and_packing_equal_transformers(hf_runs, kind):
    path, hf_loss, hf_greedy = hf_runs[kind]
    model = load_model(path)
    assert abs(_ours_loss(model) - hf_loss) < 1e-4
    assert torch.equal(generate(model, PROMPT, NEW), hf_greedy)
    packed, alone = _packed_losses(model)
    torch.testing.assert_close(packed, alone, rtol=1e-5, atol=1e-5)


def _layouts(runs):
    """Every family at every layout of LAYOUTS on this rank: (layout, kind, loss, greedy or None, packing or None)."""
    out = []
    for layout in LAYOUTS:
        dims = tpzoo.init_parallel(tp=layout.get("tp", 1), pp=layout.get("pp", 1), cp=layout.get("cp", 1),
                                   ep=layout.get("ep", 1))
        try:
            for kind, path in runs.items():
                sp = layout.get("sp", False)
                model = load_model(path, sequence_parallel=sp)
                greedy = packing = None
                if layout.get("tp") == 2:  # decoding (no SP: a one-token step is not split over tp)
                    greedy = generate(load_model(path), PROMPT, NEW)
                if dims.pp == 1 and kind in ("deepseek_v32", "glm_moe_dsa"):
                    packing = _packed_losses(model, dims, sp)
                out.append((layout, kind, _ours_loss(model), greedy, packing))
        finally:
            tpzoo.destroy_parallel()
    return out


def test_eval_at_every_layout_equals_transformers(hf_runs):
    runs = {kind: path for kind, (path, _, _) in hf_runs.items()}
    for rank in run_on_ranks(2, _layouts, runs):
        for layout, kind, loss, greedy, packing in rank:
            assert abs(loss - hf_runs[kind][1]) < 1e-4, (layout, kind, loss, hf_runs[kind][1])
            if greedy is not None:
                assert torch.equal(greedy, hf_runs[kind][2]), (layout, kind)
            if packing is not None:
                torch.testing.assert_close(*packing, rtol=1e-5, atol=1e-5, msg=lambda m: f"{layout} {kind}: {m}")


def test_the_comparisons_can_fail(hf_runs, monkeypatch):
    from tpzoo.models.kinds import sparse_mla

    path, hf_loss, _ = hf_runs["deepseek_v32"]
    model = load_model(path)
    with torch.no_grad():  # the indexer's weights not loaded: drawn as a fresh model draws them
        for layer in model.layers.values():
            layer.attn.indexer.wq_b.reset_parameters()
            layer.attn.indexer.wk.reset_parameters()
            layer.attn.indexer.weights_proj.reset_parameters()
    assert abs(_ours_loss(model) - hf_loss) > 1e-3
    # the sparse mask dropped: every visible key attended (dense MLA)
    monkeypatch.setattr(sparse_mla, "topk_mask", lambda scores, visible, k: visible.expand_as(scores))
    for kind in ("deepseek_v32", "glm_moe_dsa"):
        assert abs(_ours_loss(load_model(hf_runs[kind][0])) - hf_runs[kind][1]) > 1e-3


# -- named configs --------------------------------------------------------------------------------------------------

# docs/models.md's counts (total, active; billions to 2 decimals), set beside the published figures there
DOCUMENTED = {"deepseek-v3.2": (671.88, 38.40), "glm-5": (743.91, 41.78), "glm-4.7-flash": (29.94, 3.90),
              "mistral-small-4": (118.97, 6.63)}


@pytest.mark.parametrize("name", ["deepseek-v3.2", "glm-5", "glm-4.7-flash", "mistral-small-4", "tiny-deepseek-v3.2"])
def test_parameter_counts_are_the_built_models(name):
    from tpzoo.models import ModelLayout, Transformer, get_config

    cfg = get_config(name)
    if name in DOCUMENTED:
        assert (round(cfg.num_parameters() / 1e9, 2), round(cfg.num_parameters(active=True) / 1e9, 2)) == \
            DOCUMENTED[name]
    model = Transformer(cfg, ModelLayout(device="meta"))
    assert sum(p.numel() for p in model.parameters()) == cfg.num_parameters()
    expert = sum(p.numel() for n, p in model.named_parameters() if n.split(".")[-1] in ("gate_up", "down"))
    moe = cfg.moe
    assert cfg.num_parameters() - cfg.num_parameters(active=True) == expert * (
        moe.num_experts - moe.num_experts_per_tok) // moe.num_experts
