"""tpzoo.kernels' dispatch seam: the backend switch (TPZOO_KERNELS and use_backend, per kernel too), `auto`'s
choice by measurement (decision logic with an injected timer: selection, caching per process and on disk,
consensus, per-class separation, overrides), lazy Triton import, import without Triton, every launched kernel
compiling for a GPU target, and the Triton cross-entropy under tensor parallelism (same losses, gradients and
collectives as the reference on 2 and 4 ranks)."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import tpzoo
from tpzoo import kernels as K
from tpzoo.kernels import autotune, dispatch
from tpzoo.parallel import count_collectives, gather_tp_tensor, get_tp_rank, padded_vocab_size
from tpzoo.testing import run_on_ranks

ROOT = Path(__file__).resolve().parents[1]


def _python(code: str, **env) -> str:
    """Run `code` in a fresh interpreter (TRITON_INTERPRET and TPZOO_KERNELS cleared unless given)."""
    base = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "TPZOO_KERNELS")}
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], cwd=ROOT, env={**base, **env},
                          capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, f"subprocess failed:\n{proc.stdout}\n{proc.stderr}"
    return proc.stdout


def test_backend_switch(monkeypatch):
    monkeypatch.delenv("TPZOO_KERNELS", raising=False)
    assert K.get_backend() == "auto"
    monkeypatch.setenv("TPZOO_KERNELS", "torch")
    assert K.get_backend() == "torch"
    with K.use_backend("triton"):  # the function overrides the environment...
        assert K.get_backend() == "triton"
        with K.use_backend("auto"):
            assert K.get_backend() == "auto"
        assert K.get_backend() == "triton"
    assert K.get_backend() == "torch"  # ...and the context restores what was there
    K.use_backend("triton")  # plain call: process-wide until changed
    try:
        assert K.get_backend() == "triton"
    finally:
        K.use_backend(None)
    assert K.get_backend() == "torch"
    with pytest.raises(ValueError, match="unknown kernel backend"):
        K.use_backend("cuda")
    monkeypatch.setenv("TPZOO_KERNELS", "fast")
    with pytest.raises(ValueError, match="TPZOO_KERNELS"):
        K.get_backend()


def test_backend_per_kernel(monkeypatch):
    monkeypatch.setenv("TPZOO_KERNELS", "auto,layer_norm=torch")
    assert K.get_backend("layer_norm") == "torch" and K.get_backend("rms_norm") == "auto"
    with K.use_backend("triton", kernel="rms_norm"):  # the API beats the environment, for that kernel only
        assert K.get_backend("rms_norm") == "triton" and K.get_backend("swiglu") == "auto"
        with K.use_backend("torch"):  # every kernel without a setting of its own
            assert K.get_backend("swiglu") == "torch" and K.get_backend("rms_norm") == "triton"
    assert K.get_backend("rms_norm") == "auto"
    monkeypatch.setenv("TPZOO_KERNELS", "layer_norm=torch,triton")
    assert K.get_backend("layer_norm") == "torch" and K.get_backend() == "triton"
    with pytest.raises(ValueError, match="unknown kernel"):
        K.use_backend("torch", kernel="rmsnorm")
    monkeypatch.setenv("TPZOO_KERNELS", "rmsnorm=torch")
    with pytest.raises(ValueError, match="TPZOO_KERNELS"):
        K.get_backend("rms_norm")


@pytest.fixture
def fake_timing():
    """A timer reading each trial's time from `times` (label -> seconds; the closures carry their label), and a
    consensus recording what it was asked; both restored afterwards."""
    times, asked = {}, []
    timer = autotune.set_timer(lambda run: times[run.label])
    consensus = autotune.set_consensus(lambda key, triton: asked.append((key, triton)) or triton)
    autotune.forget()
    yield times, asked
    autotune.set_timer(timer)
    autotune.set_consensus(consensus)
    autotune.forget()


def _labelled(label):
    def run():
        raise AssertionError("the fake timer does not run trials")
    run.label = label
    return run


def test_measured_choice_cached_per_class(fake_timing, tmp_path):
    times, asked = fake_timing
    built = []
    runs = lambda: built.append(1) or (_labelled("triton"), _labelled("torch"))  # noqa: E731
    times.update(triton=2.0, torch=1.0)
    key = autotune.shape_class("layer_norm", torch.empty(8192, 4096, dtype=torch.bfloat16))
    assert key == "layer_norm|bfloat16|n4096|rows8192"
    assert autotune.decide(key, runs, cache_file=None) == "torch"  # the faster one, whatever the name
    times.update(triton=0.5)
    assert autotune.decide(key, runs, cache_file=None) == "torch"  # decided once per class and process
    assert len(built) == 1 and autotune.trials_run() == 1 and asked == [(key, False)]
    # another class (hidden size bucket, token bucket or dtype) is measured on its own
    for x in (torch.empty(8192, 2048, dtype=torch.bfloat16), torch.empty(100, 4096, dtype=torch.bfloat16),
              torch.empty(8192, 4096)):
        assert autotune.decide(autotune.shape_class("layer_norm", x), runs, cache_file=None) == "triton"
    assert autotune.shape_class("layer_norm", torch.empty(8000, 3000)) == "layer_norm|float32|n4096|rows8192"
    with torch.no_grad():  # inference is timed forward only: a class of its own
        assert autotune.shape_class("layer_norm", torch.empty(8000, 3000)).endswith("rows8192|forward")
    assert autotune.trials_run() == 4
    # on disk: a new process (forget) takes the file's decision without a trial, still asking the consensus
    cache = tmp_path / "cache" / "dispatch.json"
    times.update(triton=1.0, torch=3.0)
    assert autotune.decide("k|a", runs, cache_file=cache) == "triton"
    autotune.forget()
    asked.clear()
    assert autotune.decide("k|a", lambda: pytest.fail("trial despite the disk"), cache_file=cache) == "triton"
    assert asked == [("k|a", True)] and autotune.trials_run() == 0
    # the consensus has the last word (a TP peer measured otherwise)
    autotune.forget()
    autotune.set_consensus(lambda key, triton: False)
    assert autotune.decide("k|a", runs, cache_file=cache) == "torch"


def test_a_triton_kernel_that_fails_its_trial_loses_it(fake_timing):
    times, asked = fake_timing
    times.update(torch=1.0)

    def broken():
        raise RuntimeError("out of resource: shared memory, Required: 114688, Hardware limit: 101376")
    broken.label = "broken"
    timer = autotune.set_timer(lambda run: run() if run.label == "broken" else times[run.label])
    try:
        with pytest.warns(UserWarning, match=r"failed its trial for k\|b \(RuntimeError: out of resource: shared"):
            assert autotune.decide("k|b", lambda: (broken, _labelled("torch")), cache_file=None) == "torch"
    finally:
        autotune.set_timer(timer)
    assert asked == [("k|b", False)] and autotune.decided("k|b") == "torch"


def test_auto_measures_through_the_ops(fake_timing, monkeypatch):
    """kernels.rms_norm / swiglu_packed under auto with tensors taken for CUDA ones: each new class runs one
    trial (both implementations on stand-ins of the call's shapes) and then the measured winner; an override
    skips the measurement; cross_entropy is never measured."""
    times, asked = fake_timing
    monkeypatch.delenv("TPZOO_KERNELS", raising=False)
    monkeypatch.setattr(dispatch, "_gpu_with_triton", lambda ts: True)
    seen = []
    real_inputs = autotune.trial_inputs
    monkeypatch.setattr(autotune, "trial_inputs", lambda ts, cut=(): seen.append(
        [tuple(t.shape) if t is not None else None for t in ts]) or real_inputs(ts, cut))
    monkeypatch.setattr(autotune, "_cache_file", lambda: None)
    order = iter(["triton", "torch"] * 8)  # a trial builds its two closures in this order
    monkeypatch.setattr(autotune, "fwd_bwd", lambda fn, inputs: _labelled(next(order)))
    times.update(triton=3.0, torch=1.0)  # torch wins: the reference runs (no interpreter needed on CPU)
    x = torch.randn(4, 6, 32, requires_grad=True)
    y = K.rms_norm(x, torch.ones(32), 1e-6)
    assert "RMSNorm" not in y.grad_fn.name() and autotune.trials_run() == 1 and seen == [[(4, 6, 32), (32,)]]
    K.rms_norm(torch.randn(3, 7, 32), torch.ones(32), 1e-6)  # 21 rows: the same class (32 rows bucket)
    assert autotune.trials_run() == 1
    K.swiglu_packed(torch.randn(4, 6, 64))
    assert autotune.trials_run() == 2 and asked[-1][0] == "swiglu|float32|n64|rows32"
    with K.use_backend("torch", kernel="layer_norm"):
        K.layer_norm(x, None, None, 1e-5)
    assert dispatch.use_triton(x, kernel="cross_entropy")  # no trial offered: Triton, as before
    assert autotune.trials_run() == 2
    # trial inputs are capped: rows cut along dim 0 so each holds at most CAP_ELEMENTS
    monkeypatch.setattr(autotune, "CAP_ELEMENTS", 64)
    small = real_inputs([torch.randn(8, 4, 16), torch.randn(16), None], cut=(0,))
    assert [tuple(t.shape) if t is not None else None for t in small] == [(1, 4, 16), (16,), None]


def test_auto_takes_reference_on_cpu(monkeypatch):
    monkeypatch.delenv("TPZOO_KERNELS", raising=False)
    x = torch.randn(2, 3, 8, requires_grad=True)
    assert not dispatch.use_triton(x)
    y = K.rms_norm(x, torch.ones(8), 1e-6)
    assert "NormFunction" not in y.grad_fn.name()
    torch.testing.assert_close(y, K.reference.rms_norm(x, torch.ones(8), 1e-6))
    with pytest.raises(ValueError, match="label_smoothing"):  # argument checks hold on every path
        K.cross_entropy(torch.zeros(2, 4), torch.zeros(2, dtype=torch.long), label_smoothing=1.0)
    with pytest.raises(ValueError, match="do not match"):
        K.cross_entropy(torch.zeros(2, 4), torch.zeros(3, dtype=torch.long))


def test_env_var_and_context_select_triton_in_interpreter():
    """TPZOO_KERNELS=triton takes the kernels (here on CPU tensors, interpreted); use_backend("torch") inside
    overrides it; unsupported inputs (float64) take the reference; public names stay functions after the
    Triton modules load."""
    out = _python("""
        import types, torch
        from tpzoo import kernels as K
        x = torch.randn(2, 3, 8, requires_grad=True)
        assert K.get_backend() == "triton"
        assert K.rms_norm(x, torch.ones(8), 1e-6).grad_fn.name() == "RMSNormFunctionBackward"
        with K.use_backend("torch"):
            assert K.rms_norm(x, torch.ones(8), 1e-6).grad_fn.name() != "RMSNormFunctionBackward"
        assert K.rms_norm(x.double(), torch.ones(8).double(), 1e-6).grad_fn.name() != "RMSNormFunctionBackward"
        K.cross_entropy(torch.randn(4, 6), torch.randint(0, 6, (4,)))
        K.swiglu_packed(torch.randn(4, 8))
        for name in ("rms_norm", "layer_norm", "apply_rotary", "swiglu", "swiglu_packed", "bias_gelu",
                     "cross_entropy"):
            assert isinstance(getattr(K, name), types.FunctionType), name
        print("ok")
    """, TRITON_INTERPRET="1", TPZOO_KERNELS="triton")
    assert out.strip().endswith("ok")


def test_triton_imported_lazily_and_forcing_it_on_cpu_explains():
    out = _python("""
        import sys, torch
        import tpzoo, tpzoo.kernels as K
        x = torch.randn(2, 8)
        K.rms_norm(x, torch.ones(8), 1e-6); K.swiglu(x, x); K.bias_gelu(x)
        assert "triton" not in sys.modules, "triton imported without need"
        with K.use_backend("triton"):
            try:
                K.rms_norm(x, torch.ones(8), 1e-6)
            except RuntimeError as e:
                assert "TRITON_INTERPRET" in str(e), e
            else:
                raise AssertionError("forced triton on CPU without the interpreter did not raise")
        print("ok")
    """)
    assert out.strip().endswith("ok")


def test_import_without_triton():
    out = _python("""
        import sys
        sys.modules["triton"] = None  # `import triton` now raises ImportError
        import torch
        import tpzoo.kernels as K
        x = torch.randn(2, 3, 4, 8, requires_grad=True)
        cos, sin = torch.randn(3, 4), torch.randn(3, 4)
        K.rms_norm(x, torch.ones(8), 1e-6); K.layer_norm(x, torch.ones(8), None, 1e-5)
        K.apply_rotary(x, cos, sin); K.swiglu(x, x); K.bias_gelu(x, torch.zeros(8))
        K.cross_entropy(torch.randn(4, 6), torch.randint(0, 6, (4,)))
        assert not K.triton_available()
        with K.use_backend("triton"):
            try:
                K.swiglu(x, x)
            except RuntimeError as e:
                assert "does not import" in str(e), e
            else:
                raise AssertionError("forced triton without triton did not raise")
        print("ok")
    """)
    assert out.strip().endswith("ok")


def test_every_launch_compiles_for_sm90():
    """Compiled mode is what GPUs run and the interpreter never exercises: compile each specialization the
    wrappers launch (fwd and bwd, fp32 and bf16, one- and multi-block) to a cubin for sm_90, without a GPU."""
    pytest.importorskip("triton")
    out = _python("""
        import warnings; warnings.simplefilter("ignore")
        from tpzoo.kernels.compile_check import compile_all
        print(len(compile_all(arch=90)))
    """)
    assert int(out.split()[-1]) >= 20


# ---- cross-entropy under tensor parallelism ---------------------------------------------------------------

VOCAB = 37


def _ce_on_ranks(tp, dtype, smoothing, pad):
    tpzoo.init_parallel(tp=tp)
    vpad = padded_vocab_size(VOCAB, tp, 16 if pad else 1)  # tp=4, pad: 64, the last shard all padding
    g = torch.Generator().manual_seed(11)
    logits = torch.randn(3, 5, vpad, generator=g) * 3
    logits[..., VOCAB:] = 50.0  # padding would dominate the softmax if it were not excluded
    target = torch.randint(0, VOCAB, (3, 5), generator=g)
    target[0, 0], target[2, 4], target[1, 0], target[1, 1] = -100, -100, 0, VOCAB - 1
    dloss = torch.randn(3, 5, generator=g)
    local = logits.chunk(tp, dim=-1)[get_tp_rank()].to(dtype)

    got = {}
    for backend in ("torch", "triton"):
        z = local.clone().requires_grad_()
        with K.use_backend(backend), count_collectives() as counts:
            loss = K.cross_entropy(z, target, label_smoothing=smoothing, vocab_size=VOCAB)
        (loss * dloss).sum().backward()
        got[backend] = loss.detach(), gather_tp_tensor(z.grad, -1), counts.summary(), loss.grad_fn.name()
    (ref_loss, ref_grad, ref_counts, _), (loss, grad, counts, name) = got["torch"], got["triton"]
    assert name == "CrossEntropyFunctionBackward" and counts == ref_counts, (name, counts, ref_counts)
    assert counts["all_reduce@tp"]["calls"] == 2
    torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-5)
    tol = dict(rtol=1e-5, atol=1e-6) if dtype == torch.float32 else dict(rtol=2e-2, atol=1e-2)
    torch.testing.assert_close(grad, ref_grad, **tol)
    # and the unfused torch expression on the full, unpadded logits
    full = logits[..., :VOCAB].to(dtype).float().requires_grad_()
    ref = F.cross_entropy(full.reshape(-1, VOCAB), target.reshape(-1), label_smoothing=smoothing,
                          reduction="none").view(3, 5)
    (ref * dloss).sum().backward()
    torch.testing.assert_close(loss, ref.detach(), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(grad[..., :VOCAB].float(), full.grad, **tol)
    assert torch.count_nonzero(grad[..., VOCAB:]) == 0
    return tp


@pytest.mark.parametrize("tp", [2, 4])
def test_cross_entropy_tensor_parallel(tp):
    for dtype, smoothing, pad in ((torch.float32, 0.1, True), (torch.bfloat16, 0.0, False)):
        assert run_on_ranks(4, _ce_on_ranks, tp, dtype, smoothing, pad, pool_env={"TRITON_INTERPRET": "1"}) == [tp] * 4
