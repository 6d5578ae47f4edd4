"""LoRA under tensor, sequence, pipeline and data parallelism against one process: a tiny GPT (fused c_attn, tied
embeddings, biases) and a tiny LLaMA with grouped-query attention (kv_heads < tp at tp=4: replicated kv heads, and
their B_k shards) train two SGD steps with only the adapters trainable. Loss, every adapter gradient of the first
step and every adapter after the last step equal the single-process model's (1e-5 of each tensor's largest entry);
the frozen base stays bit-identical on every rank. B starts random here (layout-independently drawn), else every
A gradient would be zero and prove nothing."""
import pytest
import torch

import tpzoo
from test_3d_parity import assert_close, global_batch, layout_step, local_microbatches, reference_step
from tpzoo.models import Inputs, ModelLayout, Transformer, get_config
from tpzoo.models.lora import LoRAConfig, add_lora, init_lora, sites, valid_targets
from tpzoo.models.transformer import _seeded
from tpzoo.parallel import (GradBuffer, count_collectives, gather_tp_tensor, get_dp_rank, get_pp_rank, get_tp_rank,
                            grad_of, param_spec)
from tpzoo.parallel.layers import _init_shard
from tpzoo.parallel.lora import LoRA
from tpzoo.pipeline import build_model_chunks, forward_backward
from tpzoo.testing import run_on_ranks

SEED, STEPS = 1234, 2
MODELS = {"gpt": get_config("nano-gpt").replace(num_layers=4),
          "llama": get_config("nano-llama").replace(num_layers=4)}  # 4 query heads, 2 kv heads
LORA = {"all": LoRAConfig(rank=4, alpha=8.0), "qv": LoRAConfig(rank=2, alpha=3.0, targets="q_proj,v_proj")}


def randomize_b(chunks, seed: int = 7) -> None:
    """Give every B a layout-independent random value (full tensor drawn, shard kept)."""
    for chunk in chunks:
        for name, mod in chunk.named_modules():
            if isinstance(mod, LoRA):
                for n in mod.names:
                    _, _, full_b, spec_b = mod.shapes[n]
                    with _seeded(seed + int(name.split(".")[1]), chunk.device):
                        _init_shard(mod.B[n], full_b, spec_b, lambda t: torch.nn.init.normal_(t, std=0.1),
                                    mod.tp_rank, mod.tp)


def trainable(chunks) -> list:
    return list({id(p): p for c in chunks for p in c.parameters() if p.requires_grad}.values())


def _adapters(chunks, cfg, grad: bool) -> dict:
    return {n: gather_tp_tensor(grad_of(p) if grad else p, param_spec(p), reduce="first")
            for c in chunks for n, p in c.named_parameters() if p.requires_grad}


def reference(model: str, lora: str) -> dict:
    cfg = MODELS[model]
    net = Transformer(cfg, seed=SEED)
    add_lora([net], LORA[lora])
    init_lora([net], SEED)
    randomize_b([net])
    opt = torch.optim.SGD(trainable([net]), lr=0.5, momentum=0.9)
    losses, grads = [], {}
    for step in range(STEPS):
        losses.append(reference_step(net, cfg, step, opt))
        if step == 0:
            grads = {n: p.grad.clone() for n, p in net.named_parameters() if p.requires_grad}
        opt.step()
    adapters = {n: p.detach().clone() for n, p in net.named_parameters() if p.requires_grad}
    return {"loss_sum": losses, "grads": grads, "params": adapters}


def train_layout(model: str, lora: str, layout: dict) -> dict:
    cfg = MODELS[model]
    dims = tpzoo.init_parallel(tp=layout["tp"], pp=layout.get("pp", 1), dp=layout.get("dp", 1))
    try:
        chunks = build_model_chunks(cfg, dims, sequence_parallel=layout.get("sp", False), seed=SEED,
                                    virtual_stages=layout.get("v", 1))
        add_lora(chunks, LORA[lora])
        init_lora(chunks, SEED)
        randomize_b(chunks)
        base = {n: p.detach().clone() for c in chunks for n, p in c.named_parameters() if not p.requires_grad}
        params = trainable(chunks)
        opt = torch.optim.SGD(params, lr=0.5, momentum=0.9)
        main_grads = GradBuffer(params, device=dims.device)
        losses, grads = [], {}
        for step in range(STEPS):
            out = layout_step(chunks, dims, cfg, step, params, main_grads, layout.get("schedule", "1f1b"))
            losses.append(out["loss_sum"])
            if step == 0:
                grads = _adapters(chunks, cfg, grad=True)
            opt.step()
        unchanged = all(torch.equal(p, base[n]) for c in chunks for n, p in c.named_parameters()
                        if not p.requires_grad)
        return {"coords": (get_tp_rank(), get_pp_rank(), get_dp_rank()), "loss_sum": losses, "grads": grads,
                "params": _adapters(chunks, cfg, grad=False), "base_unchanged": unchanged}
    finally:
        tpzoo.destroy_parallel()


def run_layouts(model: str, lora: str, layouts: list[dict]) -> list[dict]:
    return [train_layout(model, lora, layout) for layout in layouts]


LAYOUTS = {  # every schedule once: zero-bubble's W and the interleaved chunks meet the adapters too
    1: [dict(tp=1)],
    2: [dict(tp=2, sp=True), dict(tp=1, pp=2, schedule="zb")],
    4: [dict(tp=4, sp=True), dict(tp=2, pp=2, sp=True, schedule="gpipe")],
    8: [dict(tp=2, pp=2, dp=2, sp=True, schedule="interleaved", v=2)],
}


@pytest.fixture(scope="module")
def references():
    cache = {}

    def get(model, lora):
        if (model, lora) not in cache:
            cache[(model, lora)] = reference(model, lora)
        return cache[(model, lora)]
    return get


@pytest.mark.parametrize("world", sorted(LAYOUTS))
@pytest.mark.parametrize("model", sorted(MODELS))
def test_lora_at_every_layout_matches_one_process(references, model, world):
    lora = "qv" if model == "llama" and world == 4 else "all"  # q and v only: k's rows get no adapter
    ref = references(model, lora)
    per_rank = run_on_ranks(world, run_layouts, model, lora, LAYOUTS[world])
    for i, layout in enumerate(LAYOUTS[world]):
        merged = {}
        ranks = [per[i] for per in per_rank]
        for step, ref_loss in enumerate(ref["loss_sum"]):  # summed over data-parallel replicas
            for pp_rank in {r["coords"][1] for r in ranks}:
                total = sum(r["loss_sum"][step] for r in ranks if r["coords"][0] == 0 and r["coords"][1] == pp_rank)
                assert total == pytest.approx(ref_loss, rel=1e-5), (layout, step)
        for r in ranks:
            assert r["base_unchanged"], (layout, r["coords"])
            for name, g in r["grads"].items():
                assert_close(g, ref["grads"][name], f"{layout} rank {r['coords']} grad {name}")
                merged[name] = g
            for name, p in r["params"].items():
                assert_close(p, ref["params"][name], f"{layout} rank {r['coords']} adapter {name}")
        assert set(merged) == set(ref["grads"]), layout  # every adapter lives on some stage


def _tp_calls(model: str, lora: str | None, sp: bool) -> int:
    """TP collectives of one forward + backward at tp=2, with or without adapters."""
    cfg = MODELS[model]
    dims = tpzoo.init_parallel(tp=2)
    try:
        chunks = build_model_chunks(cfg, dims, sequence_parallel=sp, seed=SEED)
        if lora:
            add_lora(chunks, LORA[lora])
            init_lora(chunks, SEED)
        mbs, tokens = local_microbatches(cfg, 0)
        with count_collectives() as c:
            forward_backward(chunks, mbs, dims, loss_scale=1.0 / tokens)
        return c.total_calls()
    finally:
        tpzoo.destroy_parallel()


def test_adapters_add_no_collective_per_micro_batch():
    """Column adapters ride on the layer's input collectives, row adapters on its output reduction. A frozen
    base even saves some, per micro-batch (4 here): nothing needs the gradient of layer 0's input, so its entry
    collective in backward (all-reduce; under SP reduce-scatter) is skipped; under SP also the embedding's
    backward all-gather. (The fused head re-gathers nothing in backward, frozen or not: models/lm_head.py.)"""
    for sp, saved in ((False, 1), (True, 2)):
        base = run_on_ranks(2, _tp_calls, "llama", None, sp)[0]
        assert run_on_ranks(2, _tp_calls, "llama", "all", sp)[0] == base - 4 * saved, sp


def test_targets_come_from_the_families_hf_names():
    llama = Transformer(MODELS["llama"], ModelLayout(device="meta"))
    assert valid_targets(llama) == ["down_proj", "gate_proj", "k_proj", "o_proj", "q_proj", "up_proj", "v_proj"]
    assert valid_targets(Transformer(MODELS["gpt"], ModelLayout(device="meta"))) == ["c_attn", "c_fc", "c_proj"]
    assert [s.module_name for s in sites(llama)][:4] == ["layers.0.attn.qkv", "layers.0.attn.out",
                                                          "layers.0.mlp.fc_in", "layers.0.mlp.fc_out"]
    with pytest.raises(Exception, match=r"unknown lora target qq_proj for llama; valid: down_proj, .*v_proj"):
        add_lora([llama], LoRAConfig(rank=2, alpha=2, targets="q_proj,qq_proj"))
    for bad in (dict(rank=0, alpha=1), dict(rank=2, alpha=0), dict(rank=2, alpha=1, dropout=1.5)):
        with pytest.raises(Exception, match="lora"):
            LoRAConfig(**bad)


def test_fresh_adapters_leave_the_model_unchanged():
    cfg = MODELS["llama"]
    ids, labels = global_batch(cfg, 0)
    net = Transformer(cfg, seed=SEED)
    before = net(Inputs(ids, labels=labels))
    add_lora([net], LORA["all"])
    init_lora([net], SEED)
    assert torch.equal(net(Inputs(ids, labels=labels)), before)
    assert all(float(p.abs().sum()) > 0 for n, p in net.named_parameters() if ".lora.A." in n)
