"""The plan advisor sees layer kinds, not families (tpzoo/plan/kinds): the costs of multi-head latent attention,
Gated DeltaNet and shared experts against whole tpzoo models built from main's building blocks (tests/plan_kinds.py
registers them as test kinds under the plan's costs for "mla", "gated_deltanet" and "moe"), on CPU:
- parameters per rank, exactly (tp 1 and 2, both end ranks, pp 1 and 2, the replicated latent projections marked
  partial under SP, Gated DeltaNet's head norm partial at any layout, shared experts beside main's MoE);
- activations a forward keeps, exactly (bf16, torch kernels: MLA's math SDPA for v != qk and its fused path for
  v == qk, q_lora_rank set and null; Gated DeltaNet over two chunks of 64 tokens; recompute none and full; a
  hybrid stack of three DeltaNet layers to one attention layer; a dense layer then MoE + shared experts), at tp 1
  and at tp 2 with and without SP;
- the tp collectives of a training step (SP on and off, recompute none and full) equal count_collectives(), and so
  do Gated DeltaNet's all-to-alls and MLA's ring sends at cp 2;
- the matmul FLOPs equal what torch's FLOP counter sees, and the cores' what its matmuls count;
- the generation caches (KV, latent, Gated DeltaNet's fixed state) equal what the layers keep after a prompt;
- a kind with no plan costs plans anyway (derived from its num_parameters), and the comparisons can fail.
"""
import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

import tpzoo
from tpzoo.models import Inputs, ModelLayout, Stage, Transformer, apply_recompute
from tpzoo.models.kinds import register_token_mixer
from tpzoo.parallel import count_collectives, finish_tp_grads
from tpzoo.plan import (ClusterSpec, Layout, RankLayout, TrainingSpec, chunk_activation_bytes, cost_of, estimate,
                        layer_cost, layer_flops, stage_params, tp_step_volume)
from tpzoo.plan.measure import forward_activation_bytes
from tpzoo.plan.volume import layer_volume, ring_layer_volume
from tpzoo.testing import run_on_ranks

from tpzoo.models.kinds.mla import LatentAttention

from plan_kinds import hybrid_model, mla_model, shared_moe_model
from test_plan_memory import build_stage, unique_params

B, S = 2, 128  # two chunks of the delta rule
MODELS = {"mla": lambda: mla_model(), "mla-q-null-v-eq-qk": lambda: mla_model(False, 24),
          "hybrid": lambda: hybrid_model(), "shared-moe": lambda: shared_moe_model()}
MIDDLE = Stage(pre_process=False, post_process=False)


@pytest.mark.parametrize("name", sorted(MODELS))
def test_parameters_exact(name):
    check_parameters(MODELS[name]())


def check_parameters(cfg) -> None:
    """The plan's parameters per rank against the built stages' (tests/test_plan_kimi_delta.py's model too)."""
    for tp, pp in [(1, 1), (2, 1), (2, 2)]:
        for stage in range(pp):
            count = stage_params(cfg, Layout(tp=tp, pp=pp), stage)
            for rank in {0, tp - 1}:
                params = unique_params(build_stage(cfg, tp, rank, pp, stage, sp=True))
                what = f"{cfg.name} tp={tp}/{rank} pp={pp}/{stage}"
                assert count.numel == sum(p.numel() for p in params), what
                assert count.tensors == len(params), what
                assert count.sequence_parallel == sum(p.numel() for p in params if p.sequence_parallel), what
                assert count.replicated_kv == 0, what
    assert cfg.num_parameters() == stage_params(cfg, Layout(), 0).numel  # the kinds' own count agrees


def _chunk(cfg, mode, pre=False, post=False, sp=False):
    torch.manual_seed(0)
    return apply_recompute(Transformer(cfg, ModelLayout(sequence_parallel=sp, dtype=torch.bfloat16),
                                       Stage(None, pre, post)), mode)


def _estimate(cfg, mode, tp=1, sp=False, pre=False, post=False):
    at = RankLayout(tp=tp, sequence_parallel=sp, recompute=mode, kernels="reference")
    return sum(chunk_activation_bytes(cfg, at, range(cfg.num_layers), B, S, pre, post).values())


def test_activations_tp1_exact():
    for name, mode in (("mla", "none"), ("mla-q-null-v-eq-qk", "none"), ("hybrid", "full"), ("shared-moe", "none")):
        cfg = MODELS[name]()
        got = forward_activation_bytes(_chunk(cfg, mode), B, S)
        assert got == _estimate(cfg, mode), (name, mode)
    cfg = hybrid_model()  # embedding, head and loss too
    assert forward_activation_bytes(_chunk(cfg, "none", True, True), B, S) == _estimate(cfg, "none", 1, False,
                                                                                       True, True)
    # the comparison can fail: the delta rule's chunk states, one d_k x d_v fp32 state per chunk and value head
    state = 4 * B * 2 * 4 * 8 * 6 * 3  # per chunk: B x 4 heads x 8 x 6, 2 chunks, 3 DeltaNet layers
    assert abs(forward_activation_bytes(_chunk(cfg, "none"), B, S) - (_estimate(cfg, "none") - state)) >= state


def test_flops_are_the_matmuls_torch_counts():
    """Forward at tp 1: every linear layer's FLOPs (aten.mm / addmm) equal the kinds' matmuls x tokens; the cores'
    matmuls (bmm) what their formulas say: MLA's math attention computes every score (the plan counts the causal
    half: keys (s+1)/2 of s), Gated DeltaNet's chunked rule adds two triangular solves (C^2 per column and chunk)
    and the conv (2 K per channel) that the counter does not see."""
    for name, make in MODELS.items():
        cfg = make()
        model = _chunk(cfg, "none")
        x = torch.randn(B, S, cfg.hidden_size, dtype=torch.bfloat16)
        with FlopCounterMode(display=False) as counter, sdpa_kernel(SDPBackend.MATH):
            model(Inputs(hidden=x))  # the math path: its matmuls are what the counter sees (no CPU fused formula)
        by_op = {str(op): n for op, n in counter.get_flop_counts()["Global"].items()}
        linear = by_op.get("aten.mm", 0) + by_op.get("aten.addmm", 0)
        at = RankLayout()
        want = sum(layer_cost(cfg, i, at).matmul_flops(B * S, 1) for i in range(cfg.num_layers))
        assert linear == want, (name, linear, want)
        core = by_op.get("aten.bmm", 0)
        plan = 0.0
        for i in range(cfg.num_layers):
            flops = B * S * layer_flops(cfg, i, at, S)
            if cfg.token_mixer(i) == "mla":
                plan += flops * S / ((S + 1) / 2)
            elif cfg.token_mixer(i) == "test_gdn":
                g = cfg.gated_deltanet
                solves = B * g.num_value_heads * (S // 64) * 64 * 64 * (g.key_head_dim + g.value_head_dim)
                conv = B * S * 2 * g.conv_kernel * (2 * g.num_key_heads * g.key_head_dim
                                                     + g.num_value_heads * g.value_head_dim)
                plan += flops - solves - conv
            else:  # SDPA: the counter counts every score (non-causal)
                plan += flops * S / ((S + 1) / 2)
        assert core == pytest.approx(plan, rel=1e-9), (name, core, plan)


def _ranks(cases):
    """On 2 ranks: at tp 2 the live bytes of middle chunks and the tp collectives of a step; at cp 2 the collectives
    of one Gated DeltaNet and one latent attention layer's forward + backward."""
    out = {"acts": [], "steps": []}
    tpzoo.init_parallel(tp=2)
    for name, mode, sp in cases:
        cfg = MODELS[name]()
        out["acts"].append(forward_activation_bytes(_chunk(cfg, mode, sp=sp), B, S))
        torch.manual_seed(0)
        model = apply_recompute(Transformer(cfg, ModelLayout(sequence_parallel=sp)), mode)
        ids = torch.randint(0, cfg.vocab_size, (B, S), generator=torch.Generator().manual_seed(1))
        with count_collectives() as counter:
            model(Inputs(ids, labels=ids.roll(-1, 1))).sum().backward()
            finish_tp_grads(model)
        out["steps"].append({k: {f: v[f] for f in ("calls", "payload_bytes", "sent_bytes")}
                             for k, v in counter.summary().items()})
    tpzoo.destroy_parallel()
    dims = tpzoo.init_parallel(cp=2)
    out["cp"] = {}
    for name, kind in (("hybrid", "gdn"), ("mla", "mla")):
        cfg = MODELS[name]()
        torch.manual_seed(0)
        if kind == "mla":  # one latent attention layer in a chunk (the model places each cp rank's positions)
            model = Transformer(cfg.replace(num_layers=1, token_mixers=["mla"]), ModelLayout(dims), MIDDLE)
        else:
            layer = Transformer(cfg, ModelLayout(dims), MIDDLE).layers["0"].attn
        x = torch.randn(B, S // 2, cfg.hidden_size, requires_grad=True)
        with count_collectives() as counter:
            if kind == "mla":
                from tpzoo.parallel.ring_attention import local_positions

                pos = local_positions(S // 4, 2, dims.cp_rank, "cpu").expand(B, -1)
                y = model(Inputs(hidden=x, positions=pos))
            else:
                y = layer.inner(x)
            y.sum().backward()
        out["cp"][kind] = counter.summary()
    tpzoo.destroy_parallel()
    return out


def test_tp2_activations_and_collectives_cp2_exchanges():
    cases = [("mla", "none", False), ("mla", "none", True), ("mla", "full", True), ("mla-q-null-v-eq-qk", "none", True),
             ("hybrid", "full", True), ("shared-moe", "none", True)]
    per_rank = run_on_ranks(2, _ranks, cases)
    for r in per_rank:
        for (name, mode, sp), got, step in zip(cases, r["acts"], r["steps"]):
            cfg = MODELS[name]()
            assert got == _estimate(cfg, mode, 2, sp), (name, mode, sp)
            layout = Layout(tp=2, micro_batch_size=B, recompute=mode, sequence_parallel=sp)
            assert tp_step_volume(cfg, layout, 0, 1, S, act_bytes=4, grad_bytes=4).summary() == step, (name, mode)
        gdn = layer_volume(hybrid_model(), 0, Layout(cp=2, micro_batch_size=B), S // 2, 4, "cp").summary()
        assert {k: {f: v[f] for f in ("calls", "payload_bytes")} for k, v in gdn.items()} == {
            k: {f: v[f] for f in ("calls", "payload_bytes")} for k, v in r["cp"]["gdn"].items()}
        ring = ring_layer_volume(mla_model(), Layout(cp=2, micro_batch_size=B), S, 4)
        sends = r["cp"]["mla"]["send@cp"]
        assert (sends["calls"], sends["payload_bytes"]) == (ring["forward"][0] + ring["backward"][0],
                                                           ring["forward"][1] + ring["backward"][1])


@register_token_mixer("test_mla_plain")
class PlainMLA(LatentAttention):
    """The same latent attention, with no plan costs of its own or registered."""


def test_a_kind_without_costs_plans_from_its_parameter_count():
    exact = mla_model()
    plain = mla_model().replace(token_mixers=["test_mla_plain"] * 2)
    cost = cost_of(PlainMLA)
    assert "weights" in cost.derived and "activations" in cost.derived
    assert not cost_of(LatentAttention).derived  # the registered costs cover every method
    cluster, run = ClusterSpec(gpus=2, gpu_memory_gib=80), TrainingSpec(seq_len=S, global_batch_size=4)
    a, b = (estimate(c, Layout(tp=2, sequence_parallel=True), cluster, run) for c in (exact, plain))
    assert a.fits and b.fits and 0.5 < b.memory.params / a.memory.params < 1.5
    assert 0.25 < b.memory.activations / a.memory.activations < 4
    assert 0.5 < b.time.compute / a.time.compute < 2


def test_generation_caches_are_what_the_layers_keep():
    """plan_cache_bytes (tpzoo.plan.cache_bytes) against the caches after a prompt, at tp 1 in bf16: attention's
    KV buffers (max_length tokens, preallocated), the latent cache (the latent and the rotary key of each token),
    Gated DeltaNet's fixed state (the conv's last inputs, the fp32 recurrent state: the same at any length)."""
    from tpzoo.plan import cache_bytes

    at, b, prompt, room = RankLayout(), 2, 8, 12
    cfg = hybrid_model()
    torch.manual_seed(0)
    model = Transformer(cfg, ModelLayout(dtype=torch.bfloat16))
    cache = model.new_cache(b, room)
    model(Inputs(torch.randint(0, cfg.vocab_size, (b, prompt))), cache=cache)
    kv = sum(c.k.nbytes + c.v.nbytes for c in cache.layers.values() if hasattr(c, "k"))
    assert kv == cache_bytes(cfg, 3, at, b, room) > 0
    gdn = model.layers["0"].attn.inner
    for length in (prompt, 2 * prompt):
        state = gdn.new_cache(b)
        gdn(torch.randn(b, length, cfg.hidden_size, dtype=torch.bfloat16), cache=state)
        assert state.conv.nbytes + state.state.nbytes == cache_bytes(cfg, 0, at, b, length)
    mla = mla_model()
    model = Transformer(mla, ModelLayout(dtype=torch.bfloat16))
    cache = model.new_cache(b, room)
    model(Inputs(torch.randint(0, mla.vocab_size, (b, prompt))), cache=cache)
    latent = cache.layers[0]
    assert latent.latent.nbytes + latent.k_rope.nbytes == cache_bytes(mla, 0, at, b, room)
