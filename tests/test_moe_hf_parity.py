"""Mixture of experts against transformers: tiny Mixtral and Qwen3-MoE written by save_pretrained, loaded at
(tp, ep) = (1, 1), (2, 1), (1, 2), (1, 4), (2, 2) + SP and (tp, ep, pp) = (1, 2, 2) on 4 gloo ranks (dp = 4 / tp: each data-parallel rank
feeds its own samples, so the tokens each ep rank's experts receive come from several ranks). Logits, every
layer's router logits, HF's load-balancing loss and the loss with it (output_router_logits) must equal
transformers' on the same samples to 1e-4 (1e-5 for the losses; at pp = 2 the aux loss and the loss come
from the last stage, the router statistics carried through the pipeline). The routers are drawn large so the routing is
uneven: the test checks that some expert of some rank receives no token. The expert all-to-alls of a forward
are counted: calls and bytes per MoE layer are the analytical ones."""
import pytest
import torch
from safetensors.torch import load_file

import tpzoo
from tpzoo.checkpoint import load_model
from tpzoo.checkpoint.tensors import hf_to_full, load_full_tensors
from tpzoo.models import Inputs, ModelLayout, Transformer, from_hf_config
from tpzoo.models.kinds.moe import router_logits
from tpzoo.parallel import comm, count_collectives
from tpzoo.pipeline import pipeline_forward
from tpzoo.testing import run_on_ranks

VOCAB, BATCH, SEQ = 101, 4, 8
LAYOUTS = [dict(tp=1, ep=1), dict(tp=2, ep=1), dict(tp=1, ep=2), dict(tp=1, ep=4), dict(tp=2, ep=2, sp=True),
           dict(tp=1, ep=2, pp=2)]


def make_hf_moe(kind: str):
    import transformers as tf

    common = dict(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=64, num_experts_per_tok=2,
                  output_router_logits=True, router_aux_loss_coef=0.02)
    torch.manual_seed(3)
    if kind == "mixtral":
        model = tf.MixtralForCausalLM(tf.MixtralConfig(**common, intermediate_size=48, num_local_experts=8))
    else:  # per-head q/k norms, top-k probabilities not renormalized, a dense layer (mlp_only_layers)
        model = tf.Qwen3MoeForCausalLM(tf.Qwen3MoeConfig(**common, intermediate_size=40, moe_intermediate_size=24,
                                                         num_experts=8, head_dim=16, mlp_only_layers=[0],
                                                         norm_topk_prob=False))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(".gate.weight"):  # the routers
                p.normal_(std=1.0)  # confident, uneven routing
    return model.eval()


@pytest.fixture(scope="module")
def hf_runs(tmp_path_factory):
    out = {}
    ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(7))
    labels = torch.cat([ids[:, 1:], torch.full((BATCH, 1), -100)], dim=1)
    for kind in ("mixtral", "qwen3_moe"):
        path = tmp_path_factory.mktemp(kind)
        model = make_hf_moe(kind)
        model.save_pretrained(path)
        refs = {}
        for per in (1, 2):  # one forward per data-parallel rank's samples: HF's aux loss is per forward
            for start in range(0, BATCH, per):
                with torch.no_grad():
                    r = model(input_ids=ids[start:start + per], labels=ids[start:start + per])  # HF shifts
                refs[(start, per)] = (r.logits, [t.view(per, SEQ, -1) for t in r.router_logits], r.aux_loss, r.loss)
        out[kind] = (str(path), ids, labels, refs)
    return out


def _check_pipeline(path, ids, labels, refs, dims):
    """pp = 2: logits through the pipeline executor, each stage's layers' router logits, and on the last stage
    HF's aux loss and the loss with it (the router statistics of stage 0 travel with the activations; for
    Qwen3-MoE stage 0 holds only the dense layer and passes on zeros)."""
    model = load_model(path).eval()  # this stage's layers, straight from the HF files
    per = BATCH // dims.dp
    rows = slice(dims.dp_rank * per, (dims.dp_rank + 1) * per)
    ref_logits, ref_router, ref_aux, ref_loss = refs[(dims.dp_rank * per, per)]
    with torch.no_grad():
        logits = pipeline_forward(model, ids[rows])
        per_token = pipeline_forward(model, ids[rows], labels[rows])
    if dims.is_last_stage:
        torch.testing.assert_close(model.full_logits(logits), ref_logits, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(model.aux_reports["router_aux_loss"], ref_aux, rtol=1e-5, atol=1e-6)
        loss = per_token.sum() / (labels[rows] != -100).sum()
        torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-5)
    hf_index = {layer: j for j, layer in enumerate(i for i in range(model.cfg.num_layers)
                                                   if model.cfg.is_moe_layer(i))}
    moe_layers = [int(i) for i, layer in model.layers.items() if layer.mlp.kind == "moe"]
    for layer, ours in zip(moe_layers, router_logits(model)):
        torch.testing.assert_close(ours.view(per, SEQ, -1), ref_router[hf_index[layer]], rtol=1e-4, atol=1e-4)
    return {"empty": 0, "a2a_bytes": 0, "moe": 0, "per": per}


def _check_layouts(path, ids, labels, refs, layouts):
    results = []
    for layout in layouts:
        tp, ep, sp = layout["tp"], layout["ep"], layout.get("sp", False)
        dims = tpzoo.init_parallel(tp=tp, ep=ep, pp=layout.get("pp", 1))
        if dims.pp > 1:
            try:
                results.append(_check_pipeline(path, ids, labels, refs, dims))
            finally:
                tpzoo.destroy_parallel()
            continue
        try:
            cfg = from_hf_config(path)
            full = dict(hf_to_full(cfg, load_file(f"{path}/model.safetensors")))
            model = Transformer(cfg, ModelLayout(sequence_parallel=sp))
            load_full_tensors(model, full.__getitem__, dims.tp_rank, tp)
            model.eval()
            per = BATCH // dims.dp
            rows = slice(dims.dp_rank * per, (dims.dp_rank + 1) * per)
            ref_logits, ref_router, ref_aux, ref_loss = refs[(dims.dp_rank * per, per)]
            with torch.no_grad(), count_collectives() as counted:
                logits_shard = model(ids[rows])
            moe = sum(layer.mlp.kind == "moe" for layer in model.layers.values())
            if ep > 1:  # per MoE layer: one all-to-all of E counts, then the rows there and back
                assert counted.get("all_to_all", "ep").calls == moe
                assert counted.get("all_to_all", "ep").payload_bytes == moe * cfg.num_experts * 8
                assert counted.get("all_to_all_v", "ep").calls == 2 * moe
            with torch.no_grad():
                logits = model.full_logits(logits_shard)
                torch.testing.assert_close(logits, ref_logits, rtol=1e-4, atol=1e-4, msg=lambda m: f"{layout}: {m}")
                for ours, theirs in zip(router_logits(model), ref_router):
                    ours = ours.view(per, -1, cfg.num_experts)
                    if sp and tp > 1:
                        ours = comm.all_gather(ours, dims.tp_group, dim=1)
                    torch.testing.assert_close(ours, theirs, rtol=1e-4, atol=1e-4)
                torch.testing.assert_close(model.aux_reports["router_aux_loss"], ref_aux, rtol=1e-5, atol=1e-6)
                per_token = model(Inputs(ids[rows], labels=labels[rows]))
                loss = per_token.sum() / (labels[rows] != -100).sum()
                torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-5)
                empty = max(int((layer.mlp.last_stats["counts"] == 0).sum()) for layer in model.layers.values()
                            if hasattr(layer.mlp, "router"))
            results.append({"empty": empty, "a2a_bytes": counted.get("all_to_all_v", "ep").payload_bytes,
                            "moe": moe, "per": per})
        finally:
            tpzoo.destroy_parallel()
    return results


@pytest.mark.parametrize("kind", ["mixtral", "qwen3_moe"])
def test_moe_logits_router_logits_and_aux_loss_match_transformers(hf_runs, kind):
    path, ids, labels, refs = hf_runs[kind]
    per_rank = run_on_ranks(4, _check_layouts, path, ids, labels, refs, LAYOUTS)
    # Uneven routing: with one sample per rank, some expert of some layer got no token.
    assert any(r["empty"] > 0 for rank in per_rank for r in rank)
    # The rows each rank sends (T*k of h fp32 per MoE layer) come back from the experts' ranks: over the world,
    # twice the dispatched rows (a single rank's return trip is what its experts received).
    hidden, k = 32, 2
    for i, layout in enumerate(LAYOUTS):
        if layout["ep"] > 1 and layout.get("pp", 1) == 1:
            dispatched = sum(r[i]["moe"] * r[i]["per"] * SEQ * k * hidden * 4 for r in per_rank)
            assert sum(r[i]["a2a_bytes"] for r in per_rank) == 2 * dispatched, layout
