"""The gated delta rule (kernels/gated_delta.py, kernels/gated_delta_fla.py) against transformers' torch functions
(the oracle: torch_chunk_gated_delta_rule, torch_recurrent_gated_delta_rule), fp32, sequences longer than the
chunk, grouped value heads, an initial state in and the final state out: outputs, final states and every gradient
(q, k, v, g, beta, the initial state) within 1e-5 of the largest entry. Packed rows equal their documents run one
by one (chunked and recurrent; boundaries on and off chunk edges, a one-token document, documents longer than a
chunk). The fla call site is checked on CPU against a stand-in `fla` module that implements fla's documented
varlen semantics with transformers' recurrent function (fla's Triton kernels need a GPU: they autotune through a
GPU driver and do not run under Triton's interpreter)."""
import inspect
import sys
import types

import pytest
import torch

from tpzoo import kernels
from tpzoo.kernels import autotune
from tpzoo.kernels import gated_delta as gd
from tpzoo.kernels import gated_delta_fla as fla_seam

hf_next = pytest.importorskip("transformers.models.qwen3_next.modeling_qwen3_next")
# transformers routes these names to fla when fla is installed (even for CPU tensors): take its torch functions
HF_CHUNK = inspect.unwrap(hf_next.torch_chunk_gated_delta_rule)
HF_RECURRENT = inspect.unwrap(hf_next.torch_recurrent_gated_delta_rule)

B, S, HK, HV, DK, DV = 2, 130, 2, 4, 16, 8  # S: two whole chunks and a part


def assert_close(actual, expected, what: str, rtol: float = 1e-5) -> None:
    actual, expected = actual.detach(), expected.detach()
    torch.testing.assert_close(actual, expected, rtol=rtol, atol=rtol * float(expected.abs().max()),
                               msg=lambda m: f"{what}: {m}")


def inputs(seed: int = 0, b: int = B, s: int = S):
    g = torch.Generator().manual_seed(seed)
    r = lambda *shape: torch.randn(*shape, generator=g)  # noqa: E731
    q, k, v = r(b, s, HK, DK), r(b, s, HK, DK), r(b, s, HV, DV)
    decay = -torch.rand(b, s, HV, generator=g) * 2  # log decays in (-2, 0]
    beta = torch.rand(b, s, HV, generator=g)
    h0 = r(b, HV, DK, DV)
    return [t.requires_grad_() for t in (q, k, v, decay, beta, h0)]


def run(fn, ts, **kw):
    """Outputs, final state and the gradients of a loss that weighs every output differently."""
    q, k, v, g, beta, h0 = ts
    o, state = fn(q, k, v, g, beta, initial_state=h0, output_final_state=True, **kw)
    weights = torch.linspace(-1, 1, o.numel()).view_as(o)
    grads = torch.autograd.grad((o * weights).sum() + (state * state).sum(), ts)
    return [o, state, *grads]


NAMES = ["output", "final state", "dq", "dk", "dv", "dg", "dbeta", "dh0"]


def test_chunked_and_recurrent_equal_transformers_and_each_other():
    ts = inputs()
    ours_chunk = run(gd.chunk_gated_delta_rule, ts, qk_l2norm=True)
    ours_rec = run(gd.recurrent_gated_delta_rule, ts, qk_l2norm=True)
    hf_chunk = run(HF_CHUNK, ts, use_qk_l2norm_in_kernel=True)
    hf_rec = run(HF_RECURRENT, ts, use_qk_l2norm_in_kernel=True)
    for name, a, b, c, d in zip(NAMES, ours_chunk, ours_rec, hf_chunk, hf_rec):
        assert_close(a, c, f"chunked vs transformers' chunked: {name}")
        assert_close(b, d, f"recurrent vs transformers' recurrent: {name}")
        assert_close(a, b, f"chunked vs recurrent: {name}")
    # the dispatching entry point (torch on CPU) is the chunked form, and the recurrent one for a single token
    o, _ = kernels.gated_delta_rule(*ts[:5], initial_state=ts[5], qk_l2norm=True)
    assert torch.equal(o, ours_chunk[0])
    one = [t[:, :1] for t in ts[:5]]
    assert torch.equal(kernels.gated_delta_rule(*one)[0], gd.recurrent_gated_delta_rule(*one)[0])


DOC_IDS = torch.tensor([[0] * 30 + [1] * 34 + [2] * 1 + [3] * 65,    # a boundary on a chunk edge (64), a 1-token doc
                        [0] * 70 + [1] * 46 + [2] * 14])               # a document longer than a chunk


def test_packed_rows_equal_their_documents_alone():
    ts = inputs(1)
    starts = gd.document_starts(DOC_IDS)
    for form, fn in (("chunked", gd.chunk_gated_delta_rule), ("recurrent", gd.recurrent_gated_delta_rule)):
        packed = run(fn, ts, qk_l2norm=True, starts=starts)
        o, state, *grads = packed
        alone_grads = [torch.zeros_like(t) for t in ts]
        for row in range(B):
            bounds = torch.cat([starts[row].nonzero().flatten(), torch.tensor([S])]).tolist()
            for d, (lo, hi) in enumerate(zip([0] + bounds[:-1], bounds)):
                # each document alone; the row's first one continues the initial state, the others start empty
                piece = [t[row:row + 1, lo:hi].detach().requires_grad_() for t in ts[:5]]
                h0 = ts[5][row:row + 1].detach().requires_grad_() if d == 0 else None
                o_d, state_d = fn(*piece, initial_state=h0, output_final_state=True, qk_l2norm=True)
                assert_close(o[row:row + 1, lo:hi], o_d, f"{form}: row {row} document {d} output", rtol=1e-6)
                if hi == S:
                    assert_close(state[row:row + 1], state_d, f"{form}: row {row} final state", rtol=1e-6)
                weights = torch.linspace(-1, 1, o.numel()).view_as(o)[row:row + 1, lo:hi]
                loss = (o_d * weights).sum() + ((state_d * state_d).sum() if hi == S else 0)
                got = torch.autograd.grad(loss, piece + ([h0] if h0 is not None else []))
                for i, gr in enumerate(got[:5]):
                    alone_grads[i][row:row + 1, lo:hi] += gr
                if h0 is not None:
                    alone_grads[5][row:row + 1] += got[5]
        for name, a, b in zip(NAMES[2:], grads, alone_grads):
            assert_close(a, b, f"{form}: packed vs documents alone: {name}", rtol=1e-5)
    # the comparison has teeth: the same packed rows without the resets are far from the documents alone
    unreset, _ = gd.chunk_gated_delta_rule(*ts[:5], qk_l2norm=True, initial_state=ts[5])
    assert (unreset - o).abs().max() > 1e-2


# fla's call site, on CPU with a stand-in module (module docstring)

class FakeFla(types.ModuleType):
    """fla.ops.gated_delta_rule's two functions as documented: q/k [B, T, H, K], v [B, T, HV, V], g/beta
    [B, T, HV]; with cu_seqlens (B = 1) the sequences are independent, initial_state / final state [N, HV, K, V].
    Computed per sequence with transformers' recurrent torch function; records every call's keywords."""

    def __init__(self, name: str = "fla.ops.gated_delta_rule", recurrent=HF_RECURRENT):
        super().__init__(name)
        self.calls, self.recurrent = [], recurrent  # (fla.ops.kda: tests/test_kimi_delta.py)

    def _rule(self, kind, q, k, v, g=None, beta=None, scale=None, initial_state=None, output_final_state=False,
              use_qk_l2norm_in_kernel=False, cu_seqlens=None, **rest):
        assert not rest, rest
        self.calls.append(dict(kind=kind, scale=scale, l2=use_qk_l2norm_in_kernel, cu=cu_seqlens,
                               h0=None if initial_state is None else initial_state.shape[0], shape=tuple(q.shape)))
        assert scale == pytest.approx(q.shape[-1] ** -0.5)
        if cu_seqlens is None:
            bounds, pieces = None, [(slice(None), slice(None))]
        else:
            assert q.shape[0] == 1
            bounds = cu_seqlens.tolist()
            pieces = [(slice(0, 1), slice(lo, hi)) for lo, hi in zip(bounds[:-1], bounds[1:])]
        outs, finals = [], []
        for n, (rows, span) in enumerate(pieces):
            h0 = None if initial_state is None else (initial_state if bounds is None else initial_state[n:n + 1])
            o, h = self.recurrent(q[rows, span], k[rows, span], v[rows, span], g[rows, span], beta[rows, span],
                                initial_state=h0, output_final_state=True,
                                use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel)
            outs.append(o)
            finals.append(h)
        return torch.cat(outs, dim=1), torch.cat(finals) if output_final_state else None

    def chunk_gated_delta_rule(self, *a, **kw):
        return self._rule("chunk", *a, **kw)

    def fused_recurrent_gated_delta_rule(self, *a, **kw):
        return self._rule("recurrent", *a, **kw)


@pytest.fixture
def fake_fla(monkeypatch):
    fake = FakeFla()
    monkeypatch.setitem(sys.modules, "fla", types.ModuleType("fla"))
    monkeypatch.setitem(sys.modules, "fla.ops", types.ModuleType("fla.ops"))
    monkeypatch.setitem(sys.modules, "fla.ops.gated_delta_rule", fake)
    monkeypatch.setattr(fla_seam, "_fla_device", lambda t: True)  # as if these CPU tensors were on a GPU
    fla_seam.forget_fla()
    yield fake
    fla_seam.forget_fla()


def test_fla_call_site_matches_the_torch_path(fake_fla):
    ts = inputs(2)
    starts = gd.document_starts(DOC_IDS)
    with kernels.use_backend("triton", kernel="gated_delta_rule"):
        for kw in (dict(), dict(starts=starts)):
            got = run(kernels.gated_delta_rule, ts, qk_l2norm=True, **kw)
            want = run(gd.chunk_gated_delta_rule, ts, qk_l2norm=True, **kw)
            for name, a, b in zip(NAMES, got, want):
                assert_close(a, b, f"fla call site {sorted(kw)}: {name}")
        one = [t[:, :1] for t in ts[:5]]
        o, h = kernels.gated_delta_rule(*one, initial_state=ts[5], output_final_state=True)
        o_ref, h_ref = gd.recurrent_gated_delta_rule(*one, initial_state=ts[5], output_final_state=True)
        assert_close(o, o_ref, "fla decode step output")
        assert_close(h, h_ref, "fla decode step state")
    plain, varlen, step = fake_fla.calls
    assert plain["kind"] == varlen["kind"] == "chunk" and step["kind"] == "recurrent"
    assert plain["cu"] is None and plain["h0"] == B and plain["l2"] and not step["l2"]
    # rows flattened to one sequence, cut at every row and document start; one initial state per document
    assert varlen["shape"][:2] == (1, B * S)
    assert varlen["cu"].tolist() == [0, 30, 64, 65, 130, 200, 246, 260] and varlen["h0"] == 7


def test_fla_chosen_by_measurement_and_fallbacks(fake_fla, monkeypatch):
    ts = [t.detach() for t in inputs(3, b=1, s=8)]
    autotune.forget()
    previous = autotune.set_consensus(None)
    try:
        for fla_time, expect_calls in ((2.0, 0), (0.5, 1)):  # the timer sees (fla, torch) in that order
            autotune.forget()
            times = iter([fla_time, 1.0])
            monkeypatch.setattr(autotune, "_timer", lambda fn: (fn(), next(times))[1])
            before = len(fake_fla.calls)
            kernels.gated_delta_rule(*ts[:5], recurrent=False)
            assert autotune.trials_run() == 1
            # the trial ran fla once; the call itself only when fla measured faster
            assert len(fake_fla.calls) - before == 1 + expect_calls, (fla_time, fake_fla.calls)
        with kernels.use_backend("torch", kernel="gated_delta_rule"):
            before = len(fake_fla.calls)
            kernels.gated_delta_rule(*ts[:5])
            assert len(fake_fla.calls) == before
    finally:
        autotune.set_consensus(previous)
        autotune.forget()
    # fla not installed: auto takes torch quietly, a forced backend says what to install
    monkeypatch.setitem(sys.modules, "fla", None)
    monkeypatch.delitem(sys.modules, "fla.ops.gated_delta_rule")
    fla_seam.forget_fla()
    torch.testing.assert_close(kernels.gated_delta_rule(*ts[:5])[0], gd.chunk_gated_delta_rule(*ts[:5])[0])
    with kernels.use_backend("triton", kernel="gated_delta_rule"), pytest.raises(RuntimeError, match=r"tpzoo\[fla\]"):
        kernels.gated_delta_rule(*ts[:5])


def test_cpu_tensors_never_reach_fla(monkeypatch):
    called = []
    monkeypatch.setattr(fla_seam, "fla_module", lambda: called.append(1))
    ts = [t.detach() for t in inputs(4, b=1, s=8)]
    for backend in ("auto", "triton"):
        with kernels.use_backend(backend, kernel="gated_delta_rule"):
            kernels.gated_delta_rule(*ts[:5])
    assert not called
