"""Shared experts of the mixture-of-experts channel mixer (models/kinds/moe.py: moe.shared_expert_ffn,
moe.shared_expert_gate) against transformers, fp32: Qwen3-Next's whole sparse block (softmax top-k router, routed
experts, one shared expert gated by sigmoid(shared_expert_gate(x))) and DeepSeek-V3's shared experts beside its
routed ones (the block's output minus its routed experts' share): the output, the input's gradient and every
weight's gradient, in one process and at tp 2 and tp 2 + SP on 2 gloo ranks (each rank's sequence shard and its
weight shards against the same reference). The comparisons can fail: the gate left out, or gate|up swapped in the
shared experts' fused weight, each change the output beyond the tolerance."""
import functools

import pytest
import torch

import tpzoo
from tpzoo.models import AttentionConfig, Context, MLPConfig, ModelConfig, ModelLayout, MoEConfig, Transformer
from tpzoo.parallel import finish_tp_grads, gather_tp_param, param_spec, shard
from tpzoo.testing import run_on_ranks

H, E, K, FFN, SHARED, B, S = 16, 4, 2, 8, 12, 2, 6


@functools.lru_cache(maxsize=None)
def _hf(kind: str):
    """(our config, our full tensors by name, x, grad_out, {name: want}) for a random HF block."""
    import transformers as tf

    torch.manual_seed(0)
    if kind == "qwen3_next":
        from transformers.models.qwen3_next.modeling_qwen3_next import Qwen3NextSparseMoeBlock

        hf_cfg = tf.Qwen3NextConfig(hidden_size=H, num_experts=E, num_experts_per_tok=K, moe_intermediate_size=FFN,
                                    shared_expert_intermediate_size=SHARED, norm_topk_prob=True)
        block = Qwen3NextSparseMoeBlock(hf_cfg)
        shared, prefix = block.shared_expert, "shared_expert"
    else:
        from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3MoE

        hf_cfg = tf.DeepseekV3Config(hidden_size=H, n_routed_experts=E, num_experts_per_tok=K, n_group=1,
                                     topk_group=1, moe_intermediate_size=FFN // 2, n_shared_experts=3)
        block = DeepseekV3MoE(hf_cfg)
        shared, prefix = block.shared_experts, "shared_experts"
    with torch.no_grad():
        for p in block.parameters():
            p.normal_(std=0.5)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(B, S, H, generator=g, requires_grad=True)
    grad_out = torch.randn(B, S, H, generator=g)
    if kind == "qwen3_next":
        out = block(x)
    else:  # the shared experts' share of DeepseekV3MoE: the block minus its routed experts
        flat = x.view(-1, H)
        _, weights, index = block.gate(flat)
        out = block(x) - block.experts(flat, index, weights).view(B, S, H)
    out.backward(grad_out)
    ffn = SHARED if kind == "qwen3_next" else 3 * FFN // 2
    cfg = ModelConfig(family="mixtral", vocab_size=32, hidden_size=H, num_layers=1,
                      attention=AttentionConfig(num_heads=2), mlp=MLPConfig(20),
                      moe=MoEConfig(num_experts=E, num_experts_per_tok=K, ffn_hidden_size=FFN,
                                    shared_expert_ffn=ffn, shared_expert_gate=kind == "qwen3_next"))
    full, want = {}, {"out": out.detach(), "x": x.grad}
    for ours, theirs in (("shared_experts.fc_in.weight", (f"{prefix}.gate_proj", f"{prefix}.up_proj")),
                         ("shared_experts.fc_out.weight", (f"{prefix}.down_proj",))):
        mods = [block.get_submodule(t) for t in theirs]
        full[ours] = torch.cat([m.weight.detach() for m in mods])
        want[ours] = torch.cat([m.weight.grad for m in mods])
    if kind == "qwen3_next":
        pairs = {"router.weight": block.gate.weight, "gate_up": block.experts.gate_up_proj,
                 "down": block.experts.down_proj, "shared_expert_gate.weight": block.shared_expert_gate.weight}
        for ours, p in pairs.items():
            full[ours], want[ours] = p.detach(), p.grad
    return cfg, full, x.detach(), grad_out, want


def _moe(cfg, full, layout):
    """Our mixture-of-experts layer at `layout` with the HF weights (this rank's shards)."""
    model = Transformer(cfg, layout)
    mlp = model.layers["0"].mlp
    dims = layout.dims
    with torch.no_grad():
        for name, p in mlp.named_parameters():
            if name in full:
                p.copy_(shard(full[name], param_spec(p), dims.tp_rank, dims.tp))
    return mlp


def _run(kind, ref, layout, broken=None):
    """(output rows of this rank, x's gradient rows, {name: full gradient}) of our layer on the HF inputs."""
    cfg, full, x, grad_out, _ = ref
    mlp = _moe(cfg, full, layout)
    if broken == "no gate":
        del mlp.shared_expert_gate
    dims = layout.dims
    rows = slice(None)
    if layout.split_sequence:
        n = S // dims.tp
        rows = slice(dims.tp_rank * n, (dims.tp_rank + 1) * n)
    x = x[:, rows].clone().requires_grad_()
    out = mlp(x, Context(S))
    out.backward(grad_out[:, rows])
    finish_tp_grads(mlp, dims)
    grads = {n: gather_tp_param(p, grad=True, dims=dims) for n, p in mlp.named_parameters() if p.grad is not None}
    if kind == "deepseek_v3":  # our layer routes otherwise (softmax router): compare the shared experts' share
        with torch.no_grad():
            out = mlp._shared(x)
    return rows, out.detach(), x.grad, grads


def _check(kind, ref, layout):
    want = ref[-1]
    rows, out, x_grad, grads = _run(kind, ref, layout)
    torch.testing.assert_close(out, want["out"][:, rows], rtol=1e-5, atol=1e-5)
    if kind == "qwen3_next":
        torch.testing.assert_close(x_grad, want["x"][:, rows], rtol=1e-5, atol=1e-5)
    for name, g in want.items():  # (DeepSeek's: the shared experts' weights; they see only their own share)
        if name not in ("out", "x"):
            torch.testing.assert_close(grads[name], g, rtol=1e-5, atol=1e-5, msg=lambda m: f"{name}: {m}")
    return True


@pytest.mark.parametrize("kind", ["qwen3_next", "deepseek_v3"])
def test_shared_experts_equal_transformers(kind):
    assert _check(kind, _hf(kind), ModelLayout(tpzoo.parallel.local_dims()))


def test_the_comparison_can_fail():
    ref = _hf("qwen3_next")
    cfg, full, x, _, want = ref
    layout = ModelLayout(tpzoo.parallel.local_dims())
    _, out, _, _ = _run("qwen3_next", ref, layout, broken="no gate")
    assert (out - want["out"]).abs().max() > 1e-2
    swapped = dict(full)  # up|gate instead of gate|up
    swapped["shared_experts.fc_in.weight"] = torch.cat(full["shared_experts.fc_in.weight"].chunk(2)[::-1])
    mlp = _moe(cfg, swapped, layout)
    with torch.no_grad():
        assert (mlp(x, Context(S)) - want["out"]).abs().max() > 1e-2


def _tp2(refs: dict):
    dims = tpzoo.init_parallel(tp=2)
    try:
        return all(_check(kind, ref, ModelLayout(dims, sequence_parallel=sp))
                   for kind, ref in refs.items() for sp in (False, True))
    finally:
        tpzoo.destroy_parallel()


def test_shared_experts_at_tp2_with_and_without_sequence_parallelism():
    # the references are computed here: the ranks never import transformers
    assert all(run_on_ranks(2, _tp2, {kind: _hf(kind) for kind in ("qwen3_next", "deepseek_v3")}))
