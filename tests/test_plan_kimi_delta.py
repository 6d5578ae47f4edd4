"""The plan's costs of Kimi Delta Attention (tpzoo/plan/kinds/kimi_delta.py) against the "kimi_delta" kind itself
(models/kinds/kimi_delta.py) in a small Kimi Linear-shaped model (three KDA layers, a NoPE latent attention layer,
dense MLPs), on CPU:
- parameters per rank exactly (tp 1 and 2, pp 1 and 2, both end tp ranks; the replicated down projections partial
  under SP, the head norm partial at any layout);
- the matmul FLOPs equal what torch's FLOP counter sees of the linear layers, and the core's what its matmuls count
  (the per-channel sub-chunk factors included; the two triangular solves and the conv it does not see);
- the tp collectives of a training step (SP on and off) equal count_collectives(), and so do the all-to-alls at cp 2;
- the generation cache (KDA's state: the conv's last inputs and the fp32 recurrent state) equals what the layer keeps,
  the same at any length;
- its activations, approximate (the cost file says why), within 3% of what the layer keeps on whole chunks."""
import torch
from torch.utils.flop_counter import FlopCounterMode

import tpzoo
from tpzoo.models import Inputs, ModelLayout, Stage, Transformer, get_config
from tpzoo.models.config import KimiDeltaConfig, MoEConfig
from tpzoo.parallel import count_collectives, finish_tp_grads
from tpzoo.plan import (Layout, RankLayout, cache_bytes, chunk_activation_bytes, cost_of, layer_cost, layer_flops,
                        tp_step_volume)
from tpzoo.plan.measure import forward_activation_bytes
from tpzoo.plan.volume import layer_volume
from tpzoo.models.kinds.kimi_delta import KimiDeltaAttention
from tpzoo.testing import run_on_ranks

from test_plan_kinds import check_parameters

B, S = 2, 128  # two chunks of the rule


def model(layers: int = 4):
    """nano-kimi-linear's layers (4 KDA heads of 8; MLA at layer 3) with dense MLPs."""
    cfg = get_config("nano-kimi-linear")
    return cfg.replace(num_layers=layers, moe=MoEConfig(), channel_mixers=None,
                       token_mixers=["kimi_delta", "kimi_delta", "kimi_delta", "mla"][:layers])


def test_parameters_exact():
    check_parameters(model())


def test_flops_are_the_matmuls_torch_counts():
    cfg = model(1)
    torch.manual_seed(0)
    net = Transformer(cfg, ModelLayout(), Stage(None, False, False))
    with FlopCounterMode(display=False) as counter:
        net(Inputs(hidden=torch.randn(B, S, cfg.hidden_size)))
    by_op = {str(op): n for op, n in counter.get_flop_counts()["Global"].items()}
    at = RankLayout()
    assert by_op.get("aten.mm", 0) + by_op.get("aten.addmm", 0) == layer_cost(cfg, 0, at).matmul_flops(B * S, 1)
    g = cfg.kimi_delta
    # what the counter does not see: the conv, and the two triangular solves (C^2 per column and chunk)
    conv = B * S * 2 * g.conv_kernel * 3 * g.dim
    solves = B * g.num_heads * (S // g.chunk_size) * g.chunk_size ** 2 * 2 * g.head_dim
    assert by_op.get("aten.bmm", 0) == B * S * layer_flops(cfg, 0, at, S) - conv - solves


def _ranks():
    out = {"steps": []}
    tpzoo.init_parallel(tp=2)
    for sp in (False, True):
        cfg = model()
        torch.manual_seed(0)
        net = Transformer(cfg, ModelLayout(sequence_parallel=sp))
        ids = torch.randint(0, cfg.vocab_size, (B, S), generator=torch.Generator().manual_seed(1))
        with count_collectives() as counter:
            net(Inputs(ids, labels=ids.roll(-1, 1))).sum().backward()
            finish_tp_grads(net)
        out["steps"].append({k: {f: v[f] for f in ("calls", "payload_bytes", "sent_bytes")}
                             for k, v in counter.summary().items()})
    tpzoo.destroy_parallel()
    dims = tpzoo.init_parallel(cp=2)
    torch.manual_seed(0)
    layer = Transformer(model(1), ModelLayout(dims), Stage(None, False, False)).layers["0"].attn
    x = torch.randn(B, S // 2, model().hidden_size, requires_grad=True)
    with count_collectives() as counter:
        layer(x).sum().backward()
    out["cp"] = counter.summary()
    tpzoo.destroy_parallel()
    return out


def test_tp2_collectives_and_cp2_exchanges():
    for r in run_on_ranks(2, _ranks):
        for sp, step in zip((False, True), r["steps"]):
            layout = Layout(tp=2, micro_batch_size=B, sequence_parallel=sp)
            assert tp_step_volume(model(), layout, 0, 1, S, act_bytes=4, grad_bytes=4).summary() == step, sp
        plan = layer_volume(model(1), 0, Layout(cp=2, micro_batch_size=B), S // 2, 4, "cp").summary()
        assert {k: {f: v[f] for f in ("calls", "payload_bytes")} for k, v in plan.items()} == {
            k: {f: v[f] for f in ("calls", "payload_bytes")} for k, v in r["cp"].items()}


def test_the_cache_is_what_the_layer_keeps():
    cfg, at = model(1), RankLayout()
    torch.manual_seed(0)
    layer = Transformer(cfg, ModelLayout(dtype=torch.bfloat16), Stage(None, False, False)).layers["0"].attn
    for length in (8, 80):
        state = layer.new_cache(B)
        layer(torch.randn(B, length, cfg.hidden_size, dtype=torch.bfloat16), None, state)
        assert state.conv.nbytes + state.state.nbytes == cache_bytes(cfg, 0, at, B, length) > 0
    assert not cost_of(KimiDeltaAttention).derived  # every cost its own


def test_activations_approximate_what_the_layer_keeps():
    """The approximate count (the cost file's docstring) within 3% of the bytes a bf16 chunk keeps at tp 1 (one KDA
    layer and its MLP, exact), for head_dim 8 and 16 on sequences of whole chunks; and the count can fail: without
    the sub-chunk pair factors (3 sub d per padded token and head) it is 25% short."""
    for d in (8, 16):
        cfg = model(1).replace(kimi_delta=KimiDeltaConfig(num_heads=4, head_dim=d))
        torch.manual_seed(0)
        kept = forward_activation_bytes(Transformer(cfg, ModelLayout(dtype=torch.bfloat16), Stage(None, False, False)),
                                        B, S)
        at = RankLayout(kernels="reference")
        planned = sum(chunk_activation_bytes(cfg, at, range(1), B, S, False, False).values())
        assert abs(planned / kept - 1) < 0.03, (d, planned, kept)
        pairs = 4 * B * S * 4 * 3 * 16 * d
        assert (planned - pairs) / kept < 0.75, d
