"""Kimi Delta Attention: the per-channel gated delta rule (kernels/gated_delta.py) and the token-mixer kind
"kimi_delta" (models/kinds/kimi_delta.py) against transformers' Kimi Linear (the oracle: its torch functions
chunk_kimi_delta_attention / recurrent_kimi_delta_attention and its layer KimiLinearDeltaAttention), fp32, tiny
random weights, sequences longer than the chunk (64):
- the chunked and recurrent forms equal each other and transformers' recurrent function (outputs, final states,
  every gradient, 1e-5 of the largest entry), also under decays of up to -40 per token and channel (no exponent
  overflows); packed rows equal their documents run one by one, in both forms;
- fla's KDA call site (fla.ops.kda's chunk_kda / fused_recurrent_kda, kernel name "kimi_delta_rule") on CPU
  against a stand-in module with fla's documented varlen semantics (tests/test_gated_delta.py's);
- the layer equals transformers' (ours in float64, transformers' rule and gated norm in its own fp32; output, input
  gradient, every parameter's gradient mapped to the hub's names, 1e-5 of the largest entry) at tp 1 here and on
  gloo ranks at tp 2, tp 2 + SP, tp 2 + SP packed and cp 2 packed (all-to-all over heads), and
  at (tp, cp) = (2, 2) + SP (slow tier); one seed gives the same full weights at every layout; packed rows equal
  transformers' layer run on each document alone; prefill then decoding with the cache equals the full forward;
- the comparisons can fail: the decay per head instead of per channel, or the output gate dropped, move the
  output far past the tolerance."""
import inspect
import sys
import types

import pytest
import torch

import tpzoo
from tpzoo import kernels
from tpzoo.kernels import gated_delta as gd
from tpzoo.kernels import gated_delta_fla as fla_seam
from tpzoo.models import AttentionConfig, MLPConfig, ModelConfig, ModelLayout
from tpzoo.models.config import KimiDeltaConfig
from tpzoo.models.kinds import kimi_delta as kda
from tpzoo.models.kinds.kimi_delta import KimiDeltaAttention
from tpzoo.models.kinds.kimi_delta_hf import kimi_delta_tensor_maps
from tpzoo.parallel import ParallelDims, ParallelLayoutError, comm, finish_tp_grads, shard

from test_gated_delta import FakeFla
from test_gated_deltanet import (_local, assert_close, check_rank_results, context, materialized, max_error,
                                 merge_ranks, run_hf_layer)

mk = pytest.importorskip("transformers.models.kimi_linear.modeling_kimi_linear")
from transformers import KimiLinearConfig  # noqa: E402

HF_RECURRENT = inspect.unwrap(mk.recurrent_kimi_delta_attention)  # (fla takes the name when installed)
HF_KW = dict(hidden_size=32, linear_num_heads=4, linear_head_dim=8, linear_conv_kernel_dim=4, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=4, layer_types=["linear_attention", "full_attention"],
             rms_norm_eps=1e-6)
CFG = KimiDeltaConfig(num_heads=4, head_dim=8, conv_kernel=4)
S = 136  # > 2 chunks; a multiple of 2 * cp * tp for the (2, 2) + SP layout
DOC_IDS = torch.tensor([[0] * 20 + [1] * 64 + [2] * 1 + [3] * 51, [0] * 100 + [1] * 36])


@pytest.fixture(autouse=True)
def _transformers_recurrent_form(monkeypatch):
    """transformers' layer with its recurrent function for every call: its own torch code (fla, when installed,
    would take these names), the form without chunking (equal to its chunked one: the rule's test) and 50x cheaper
    on these shapes than its chunked fallback's backward."""
    for name in ("chunk_kimi_delta_attention", "recurrent_kimi_delta_attention"):
        monkeypatch.setattr(mk, name, HF_RECURRENT)


# -- the rule ---------------------------------------------------------------------------------------------------

B, T, H, D = 2, 130, 3, 16  # T: two whole chunks and a part
NAMES = ["output", "final state", "dq", "dk", "dv", "dg", "dbeta", "dh0"]


def rule_inputs(seed: int = 0, strength: float = 2.0, b: int = B, s: int = T):
    """Per-channel log decays in (-strength, 0], a mix of slow and fast channels."""
    g = torch.Generator().manual_seed(seed)
    r = lambda *shape: torch.randn(*shape, generator=g)  # noqa: E731
    decay = -torch.rand(b, s, H, D, generator=g) * torch.rand(b, s, H, 1, generator=g) * strength
    ts = [r(b, s, H, D), r(b, s, H, D), r(b, s, H, D), decay, torch.rand(b, s, H, generator=g), r(b, H, D, D)]
    return [t.requires_grad_() for t in ts]


def run(fn, ts, **kw):
    q, k, v, g, beta, h0 = ts
    o, state = fn(q, k, v, g, beta, initial_state=h0, output_final_state=True, **kw)
    weights = torch.linspace(-1, 1, o.numel()).view_as(o)
    return [o, state, *torch.autograd.grad((o * weights).sum() + (state * state).sum(), ts)]


def test_chunked_and_recurrent_equal_transformers_and_each_other():
    ts = rule_inputs()
    ours_chunk = run(gd.chunk_gated_delta_rule, ts, qk_l2norm=True)
    ours_rec = run(gd.recurrent_gated_delta_rule, ts, qk_l2norm=True)
    hf_rec = run(HF_RECURRENT, ts, use_qk_l2norm_in_kernel=True)  # (its chunked form: the benchmark's baseline)
    for name, a, b, c in zip(NAMES, ours_chunk, ours_rec, hf_rec):
        assert_close(a, c, f"chunked vs transformers' recurrent: {name}")
        assert_close(b, c, f"recurrent vs transformers' recurrent: {name}")
        assert_close(a, b, f"chunked vs recurrent: {name}")
    # strong decays: exp(-G) over a chunk would be exp(1000+); the sub-chunk factors keep every exponent <= 0
    ts = rule_inputs(1, strength=40.0)
    for name, a, b in zip(NAMES, run(gd.chunk_gated_delta_rule, ts), run(gd.recurrent_gated_delta_rule, ts)):
        assert torch.isfinite(a).all(), name
        assert_close(a, b, f"strong decays, chunked vs recurrent: {name}")
    # the dispatching entry point (torch on CPU): the chunked form, the recurrent one for a single token
    o, _ = kernels.gated_delta_rule(*ts[:5], initial_state=ts[5])
    assert torch.equal(o, gd.chunk_gated_delta_rule(*ts[:5], initial_state=ts[5])[0])
    one = [t[:, :1] for t in ts[:5]]
    assert torch.equal(kernels.gated_delta_rule(*one)[0], gd.recurrent_gated_delta_rule(*one)[0])


def test_packed_rows_equal_their_documents_alone():
    ts = rule_inputs(2)
    starts = gd.document_starts(DOC_IDS[:, :T])
    for form, fn in (("chunked", gd.chunk_gated_delta_rule), ("recurrent", gd.recurrent_gated_delta_rule)):
        o, state = fn(*ts[:5], initial_state=ts[5], output_final_state=True, qk_l2norm=True, starts=starts)
        for row in range(B):
            bounds = torch.cat([starts[row].nonzero().flatten(), torch.tensor([T])]).tolist()
            for d, (lo, hi) in enumerate(zip([0] + bounds[:-1], bounds)):
                piece = [t[row:row + 1, lo:hi] for t in ts[:5]]
                o_d, state_d = fn(*piece, initial_state=ts[5][row:row + 1] if d == 0 else None,
                                  output_final_state=True, qk_l2norm=True)
                assert_close(o[row:row + 1, lo:hi], o_d, f"{form}: row {row} document {d}", rtol=1e-6)
                if hi == T:
                    assert_close(state[row:row + 1], state_d, f"{form}: row {row} final state", rtol=1e-6)


class FakeKda(FakeFla):
    """fla.ops.kda as documented (g [B, T, H, K]), computed with transformers' recurrent KDA function."""

    def __init__(self):
        super().__init__("fla.ops.kda", HF_RECURRENT)

    def chunk_kda(self, *a, **kw):
        return self._rule("chunk", *a, **kw)

    def fused_recurrent_kda(self, *a, **kw):
        return self._rule("recurrent", *a, **kw)


def test_fla_call_site_matches_the_torch_path(monkeypatch):
    fake = FakeKda()
    for name, module in (("fla", types.ModuleType("fla")), ("fla.ops", types.ModuleType("fla.ops")),
                         ("fla.ops.kda", fake)):
        monkeypatch.setitem(sys.modules, name, module)
    monkeypatch.setattr(fla_seam, "_fla_device", lambda t: True)  # as if these CPU tensors were on a GPU
    fla_seam.forget_fla()
    try:
        ts = rule_inputs(3)
        starts = gd.document_starts(DOC_IDS[:, :T])
        with kernels.use_backend("triton", kernel="kimi_delta_rule"):
            for kw in (dict(), dict(starts=starts)):
                got = run(kernels.gated_delta_rule, ts, qk_l2norm=True, **kw)
                for name, a, b in zip(NAMES, got, run(gd.chunk_gated_delta_rule, ts, qk_l2norm=True, **kw)):
                    assert_close(a, b, f"fla call site {sorted(kw)}: {name}")
            one = [t.detach()[:, :1] for t in ts[:5]]
            o, h = kernels.gated_delta_rule(*one, initial_state=ts[5].detach(), output_final_state=True)
            o_ref, h_ref = gd.recurrent_gated_delta_rule(*one, initial_state=ts[5].detach(), output_final_state=True)
            assert_close(o, o_ref, "fla decode step output")
            assert_close(h, h_ref, "fla decode step state")
        plain, varlen, step = fake.calls
        assert (plain["kind"], varlen["kind"], step["kind"]) == ("chunk", "chunk", "recurrent")
        assert varlen["cu"].tolist() == [0, 20, 84, 85, 130, 230, 260] and varlen["h0"] == 6
        # Gated DeltaNet's kernel name does not switch KDA's: forced to torch, fla is not called
        with kernels.use_backend("triton", kernel="gated_delta_rule"), \
                kernels.use_backend("torch", kernel="kimi_delta_rule"):
            kernels.gated_delta_rule(*[t.detach() for t in ts[:5]])
        assert len(fake.calls) == 3
    finally:
        fla_seam.forget_fla()


# -- the layer (ours in float64, so the only rounding left is transformers' own: its KDA functions and its gated norm
# cast to fp32 inside whatever the input's dtype; A_log's gradient, a sum over every token and channel of cumulative
# decays, carries the most of it, a few 1e-6 of its largest entry)

LAYER_RTOL = 1e-5

def model_config(g: KimiDeltaConfig = CFG) -> ModelConfig:
    return ModelConfig(family="kimi_linear", vocab_size=97, hidden_size=HF_KW["hidden_size"], num_layers=1,
                       attention=AttentionConfig(4), mlp=MLPConfig(32), kimi_delta=g, token_mixers=["kimi_delta"],
                       norm_eps=HF_KW["rms_norm_eps"])


def build(dims, sp: bool = False) -> KimiDeltaAttention:
    """The kind built on meta, materialized on the CPU and reset in registration order (a model's init_weights)."""
    layer = KimiDeltaAttention(model_config(), 0, ModelLayout(dims, sequence_parallel=sp, dtype=torch.float64))
    return materialized(layer)


def hf_layer(seed: int = 0):
    """transformers' layer, every weight random: A_log distinct per head, dt_bias mixing slow and fast channels (so
    states reach across chunks and the channels' decays differ), the norm away from 1."""
    layer = mk.KimiLinearDeltaAttention(KimiLinearConfig(**HF_KW), 0).double()
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in layer.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.3)
        layer.forget_gate.A_log.copy_(torch.rand(layer.forget_gate.A_log.shape, generator=g).mul(3).add(0.3).log())
        layer.forget_gate.dt_bias.copy_(torch.randn(layer.forget_gate.dt_bias.shape, generator=g) * 2 - 3)
        layer.o_norm.weight.add_(1.0)
    return layer


def hub(tensors: dict) -> dict:
    """transformers' module names -> the checkpoint's (what kimi_delta_hf.py maps): the conv split into q, k, v, the
    forget gate's tensors one level up. Weights or gradients alike (a rearrangement)."""
    out = {}
    for name, t in tensors.items():
        if name == "conv1d.weight":
            out.update({f"{p}_conv1d.weight": part for p, part in zip("qkv", t.chunk(3))})
        else:
            out[name.replace("forget_gate.", "")] = t
    return out


def to_tpzoo(tensors: dict) -> dict:
    hf = hub(tensors)
    return {m.name[4:]: m.to_tpzoo([hf[h[3:]] for h in m.hf]) for m in kimi_delta_tensor_maps(CFG, "kda", "hf")}


def load(layer: KimiDeltaAttention, full: dict) -> KimiDeltaAttention:
    with torch.no_grad():
        for name, p in layer.named_parameters():
            p.copy_(shard(full[name], p.tp_spec, layer.dims.tp_rank, layer.dims.tp))
    return layer


def inputs(b=2, s=S, seed=1):
    g = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(b, s, HF_KW["hidden_size"], generator=g, dtype=torch.float64) for _ in range(2))


def hf_reference(x, w, doc_ids=None) -> dict:
    """transformers' output, input gradient and tpzoo-named full gradients; with doc_ids, its layer run on each
    document alone (outputs placed, gradients summed)."""
    layer = hf_layer()
    y, dx = run_hf_layer(layer, x, w, doc_ids)
    return {"y": y, "dx": dx, "grads": to_tpzoo({n: p.grad for n, p in layer.named_parameters()}),
            "weights": to_tpzoo(layer.state_dict())}


def run_ours(layer, x, w, docs=None):
    x = x.clone().requires_grad_()
    y = layer(x, context(docs))
    (y * w).sum().backward()
    return {"y": y.detach(), "dx": x.grad, "grads": {n: p.grad for n, p in layer.named_parameters()}}


def check(got: dict, ref: dict, what: str) -> None:
    assert_close(got["y"], ref["y"], f"{what} output", LAYER_RTOL)
    assert_close(got["dx"], ref["dx"], f"{what} input gradient", LAYER_RTOL)
    assert set(got["grads"]) == set(ref["grads"])
    for name, g in got["grads"].items():
        assert_close(g, ref["grads"][name], f"{what} gradient of {name}", LAYER_RTOL)


def test_layer_equals_transformers_and_the_names_round_trip():
    x, w = inputs()
    ref = hf_reference(x, w)
    layer = load(build(ParallelDims.for_rank(device="cpu")), ref["weights"])
    check(run_ours(layer, x, w), ref, "tp=1")
    state = hub(hf_layer().state_dict())
    for m in kimi_delta_tensor_maps(CFG, "kda", "hf"):
        back = m.to_hf(m.to_tpzoo([state[h[3:]] for h in m.hf]))
        assert all(torch.equal(t, state[h[3:]]) for t, h in zip(back, m.hf)), m.name


def test_packed_equals_documents_and_the_checks_can_fail(monkeypatch):
    x, w = inputs()
    per_doc = hf_reference(x, w, DOC_IDS)
    layer = load(build(ParallelDims.for_rank(device="cpu")), per_doc["weights"])
    check(run_ours(layer, x, w, DOC_IDS), per_doc, "packed vs transformers per document")
    whole = hf_reference(x, w)["y"]
    rule = kda.DeltaRule.forward
    with monkeypatch.context() as mp:  # the decay per head (its channels' mean) instead of per channel
        mp.setattr(kda.DeltaRule, "forward", lambda self, q, k, v, g, *a: rule(self, q, k, v, g.mean(-1), *a))
        assert max_error(layer(x, context()), whole) > 1e-2
    with monkeypatch.context() as mp:  # the output gate dropped
        mp.setattr(kda.SigmoidGatedRMSNorm, "gate", staticmethod(torch.ones_like))
        assert max_error(layer(x, context()), whole) > 1e-2
    assert_close(layer(x, context()), whole, "unpatched again")


def test_cache_prefill_then_decode_equals_the_full_forward():
    x, _ = inputs(b=2, s=80)
    hf = hf_layer()
    full = hf(x).detach()
    ours = load(build(ParallelDims.for_rank(device="cpu")), to_tpzoo(hf.state_dict()))
    with torch.no_grad():
        cache = ours.new_cache(2)
        steps = [ours(x[:, :70], context(), cache)] + [ours(x[:, t:t + 1], context(), cache) for t in range(70, 80)]
        assert_close(torch.cat(steps, dim=1), full, "prefill 70 + decode 10 vs the full forward")
        ids = torch.tensor([[0] * 68 + [1] * 2] * 2)  # a packed prefill whose last document is shorter than the conv
        cache = ours.new_cache(2)
        steps = [ours(x[:, :70], context(ids), cache)[:, 68:]]
        steps += [ours(x[:, t:t + 1], context(), cache) for t in range(70, 75)]
        assert_close(torch.cat(steps, dim=1), hf(x[:, 68:75]), "packed prefill + decode vs the document alone")


def test_refusals():
    with pytest.raises(ParallelLayoutError, match=r"tp=8 does not divide the Kimi Delta Attention heads \(4\)"):
        KimiDeltaAttention(model_config(), 0, ModelLayout(ParallelDims.for_rank(tp=8, device="meta")))
    with pytest.raises(ParallelLayoutError, match="tp x cp = 2 x 4 .* use a cp that divides"):
        KimiDeltaAttention(model_config(), 0, ModelLayout(ParallelDims.for_rank(tp=2, cp=4, device="meta")))


# -- on gloo ranks (each layout against transformers' results computed here) --------------------------------------

def _rank_cases(weights: dict, x, w, cases: list) -> list:
    out = []
    for tp, cp, sp, packed in cases:
        dims = tpzoo.init_parallel(tp=tp, cp=cp)
        try:
            torch.manual_seed(5)
            fresh = [p.detach().clone() for p in build(dims, sp).parameters()]
            layer = load(build(dims, sp), weights)
            xl = _local(x, dims, sp).detach().clone().requires_grad_()
            with comm.count_collectives() as counter:
                y = layer(xl, context(DOC_IDS if packed else None))
                (y * _local(w, dims, sp)).sum().backward()
            finish_tp_grads(layer, dims)  # the replicated low-rank projections' and the norm's partial gradients
            res = {"y": y.detach(), "dx": xl.grad, "grads": {n: p.grad for n, p in layer.named_parameters()},
                   "fresh": fresh, "a2a": counter.get("all_to_all", "cp").calls}
            if cp == 1 and not sp and not packed:  # generation at this layout: prefill 100, decode 4
                with torch.no_grad():
                    cache = layer.new_cache(x.shape[0])
                    steps = [layer(x[:, :100], context(), cache)]
                    steps += [layer(x[:, t:t + 1], context(), cache) for t in range(100, 104)]
                res["decoded"] = torch.cat(steps, dim=1)
            out.append(res)
        finally:
            tpzoo.destroy_parallel()
    return out


def _merge(per_rank: list, i: int, tp: int, cp: int, sp: bool) -> dict:
    specs = {n: p.tp_spec for n, p in KimiDeltaAttention(model_config(), 0, ModelLayout(
        ParallelDims.for_rank(tp=tp, cp=cp))).named_parameters()}
    return merge_ranks(per_rank, i, tp, cp, sp, specs)


def check_layouts(layouts: dict) -> None:
    """(tp, cp, sp, packed) cases per world size, each against transformers' results."""
    x, w = inputs()
    refs = {False: hf_reference(x, w), True: hf_reference(x, w, DOC_IDS)}
    torch.manual_seed(5)
    fresh = [p.detach() for p in build(ParallelDims.for_rank(device="cpu")).parameters()]
    check_rank_results(layouts, _rank_cases, _merge, check, refs[False]["weights"], x, w, refs, fresh)


def test_tensor_and_context_parallel_equal_transformers():
    check_layouts({2: [(2, 1, False, False), (2, 1, True, False), (2, 1, True, True), (1, 2, False, True)]})


@pytest.mark.slow
def test_tensor_and_context_parallel_together():
    check_layouts({4: [(2, 2, True, False), (2, 2, True, True)]})
