"""Triton kernels (tpzoo.kernels) against their torch references and autograd of the unfused torch
expressions: forward and every gradient, fp32 and bf16, odd shapes, strided inputs, rows longer than a block.

How Triton's interpreter is set up (CPU tensors need it). Triton reads TRITON_INTERPRET when a kernel is
defined, and again at run time, so the flag must be set before tpzoo.kernels loads its Triton modules in a
process. It is not set in the pytest process: that would hinge on collection order, and on a GPU machine it
would turn every later Triton use (torch.compile included) into the interpreter. The checks run instead in one
dedicated spawned worker whose initializer sets the flag before anything imports Triton (fixture `interp`).
On a CUDA machine, test_cuda runs the same checks on the GPU in this process with compiled kernels.

Tolerances (kernel vs the reference autograd, per dtype): fp32 1e-5 relative and absolute (1e-4 relative for
gradients summed over rows); bf16 compares both the kernel and the reference with an fp64 evaluation of the
same expression on the same bf16 inputs, and asks the kernel's error to be within 2% of the largest value
(|x| scale) and no more than 1.5x the reference's own error plus 1/128 of that scale (about 1-2 bf16 ulps).
"""
from __future__ import annotations

import concurrent.futures
import multiprocessing as mp
import os

import pytest
import torch
import torch.nn.functional as F

from tpzoo import kernels as K
from tpzoo.kernels import launch

GRAD_RTOL_FP32 = 1e-4


def _init_interpreter_worker():
    os.environ["TRITON_INTERPRET"] = "1"
    torch.set_num_threads(1)


@pytest.fixture(scope="module")
def interp():
    """run(fn, *args): fn(*args) in a worker process where Triton runs in interpreter mode."""
    pool = concurrent.futures.ProcessPoolExecutor(1, mp_context=mp.get_context("spawn"),
                                                  initializer=_init_interpreter_worker)
    yield lambda fn, *args: pool.submit(fn, *args).result(timeout=300)
    pool.shutdown(cancel_futures=True)


# ---- generic comparison (runs in the interpreter worker, or in-process on CUDA) ---------------------------

def _leaf(shape, dtype, layout, gen, device, scale=1.0, shift=0.0):
    """A leaf whose view `_view(leaf, shape, layout)` has `shape`: contiguous, a column slice of a wider
    buffer (row stride > row length), or dims 0 and 1 swapped in memory (needs a copy to become rows)."""
    full = list(shape)
    if layout == "sliced":
        full[-1] += 5
    elif layout == "transposed":
        full[0], full[1] = full[1], full[0]
    t = torch.randn(full, generator=gen, dtype=torch.float64) * scale + shift
    return t.to(device=device, dtype=dtype).requires_grad_()


def _view(leaf, shape, layout):
    if layout == "sliced":
        return leaf[..., 2:2 + shape[-1]]
    return leaf.transpose(0, 1) if layout == "transposed" else leaf


def _run(backend, fn, leaves, grad_out, dtype=None):
    leaves = [x.detach().to(dtype or x.dtype).requires_grad_(x.requires_grad) for x in leaves]
    with K.use_backend(backend):
        out = fn(*leaves)
    want = [x for x in leaves if x.requires_grad]
    grads = torch.autograd.grad(out, want, grad_out.to(dtype or out.dtype))
    return [out.detach(), *grads], out.grad_fn.name()


def _compare(fn, leaves, grad_out, kernel_fn_name, max_block=launch.MAX_BLOCK):
    """Triton vs reference autograd (and vs fp64 for low precision): output and the gradient of every leaf
    that requires one."""
    saved = launch.MAX_BLOCK, launch.MAX_ELEMENTWISE_BLOCK, launch.MAX_ROW, launch.MAX_TILE
    # small blocks and tiles on small shapes: rows streamed in several blocks, several short rows per tile
    launch.MAX_BLOCK, launch.MAX_ELEMENTWISE_BLOCK = max_block, min(max_block, saved[1])
    launch.MAX_ROW, launch.MAX_TILE = min(max_block, saved[2]), min(4 * max_block, saved[3])
    try:
        got, name = _run("triton", fn, leaves, grad_out)
    finally:
        launch.MAX_BLOCK, launch.MAX_ELEMENTWISE_BLOCK, launch.MAX_ROW, launch.MAX_TILE = saved
    assert name == kernel_fn_name, f"expected the Triton path ({kernel_fn_name}), got {name}"
    ref, ref_name = _run("torch", fn, leaves, grad_out)
    assert ref_name != kernel_fn_name
    dtype = leaves[0].dtype
    if dtype == torch.float32:
        for i, (g, r) in enumerate(zip(got, ref)):
            torch.testing.assert_close(g, r, rtol=1e-5 if i == 0 else GRAD_RTOL_FP32, atol=1e-5,
                                       msg=lambda m: f"[{'output' if i == 0 else f'grad {i}'}] {m}")
        return
    gold, _ = _run("torch", fn, leaves, grad_out, dtype=torch.float64)
    for i, (g, r, o) in enumerate(zip(got, ref, gold)):
        scale = o.abs().max().item() + 1e-6
        err, ref_err = (g.double() - o).abs().max().item(), (r.double() - o).abs().max().item()
        what = "output" if i == 0 else f"grad {i}"
        assert g.dtype == r.dtype and g.shape == r.shape, (what, g.dtype, r.dtype, g.shape, r.shape)
        assert err <= 0.02 * scale, f"[{what}] kernel error {err:.3g} vs fp64 exceeds 2% of {scale:.3g}"
        assert err <= 1.5 * ref_err + scale / 128, f"[{what}] kernel error {err:.3g} >> reference's {ref_err:.3g}"


def check_norm(kind, dtype, shape, layout, max_block, device="cpu"):
    gen = torch.Generator().manual_seed(1)
    n = shape[-1]
    x = _leaf(shape, dtype, layout, gen, device, scale=2.0, shift=0.5)  # off-centre: LayerNorm must subtract
    w = _leaf((n,), dtype, "contiguous", gen, device, scale=0.3, shift=1.0)
    b = _leaf((n,), dtype, "contiguous", gen, device)
    dy = _view(_leaf(shape, dtype, layout, gen, device), shape, layout).detach()  # strided incoming gradient
    if kind == "rms":  # rows up to MAX_ROW: several whole rows per program (kernels/rms.py); longer: streamed
        fn, leaves = (lambda x, w: K.rms_norm(_view(x, shape, layout), w, 1e-6)), [x, w]
        if n <= max_block:
            _compare(fn, leaves, dy, "RMSNormFunctionBackward", max_block)
            return
    elif kind == "layer":
        fn, leaves = (lambda x, w, b: K.layer_norm(_view(x, shape, layout), w, b, 1e-5)), [x, w, b]
    else:  # LayerNorm without bias
        fn, leaves = (lambda x, w: K.layer_norm(_view(x, shape, layout), w, None, 1e-5)), [x, w]
    _compare(fn, leaves, dy, "NormFunctionBackward", max_block)


def check_rotary(dtype, batched_cos, layout, max_block, device="cpu"):
    gen = torch.Generator().manual_seed(2)
    b, s, h, d = 2, 5, 3, 12
    if layout == "qkv":  # q as a view into a fused qkv projection output: strides (s*3hd, 3hd, d, 1)
        qkv = _leaf((b, s, 3 * h * d), dtype, "contiguous", gen, device)
        view = lambda t: t[..., h * d:2 * h * d].view(b, s, h, d)  # noqa: E731
    else:  # [b, heads, s, d] memory seen as [b, s, heads, d]
        qkv = _leaf((b, h, s, d), dtype, "contiguous", gen, device)
        view = lambda t: t.transpose(1, 2)  # noqa: E731
    # positions from a KV-cache offset (different per sequence when batched), llama-style inverse freqs
    inv_freq = 1.0 / (10000 ** (torch.arange(0, d, 2, dtype=torch.float64) / d))
    pos = torch.arange(s) + (torch.tensor([[7], [30]]) if batched_cos else 11)
    angles = (pos.to(torch.float64).unsqueeze(-1) * inv_freq).float().to(device)
    cos, sin = angles.cos(), angles.sin()
    dy = _leaf((b, s, h, d), dtype, "contiguous", gen, device).detach()
    _compare(lambda t: K.apply_rotary(view(t), cos, sin), [qkv], dy, "RotaryFunctionBackward", max_block)


def check_swiglu(dtype, layout, max_block, device="cpu", op="swiglu"):
    """SwiGLU, or with op="geglu" Gemma's GeGLU (the same kernel pair with the tanh GeLU on the gate)."""
    gen = torch.Generator().manual_seed(3)
    shape = (3, 5, 37)
    act = getattr(K, op)
    if layout == "fused":  # gate, up = h.chunk(2, -1) of one column-parallel output
        h = _leaf((3, 5, 74), dtype, "contiguous", gen, device, scale=2.0)
        fn, leaves = (lambda h: act(*h.chunk(2, dim=-1))), [h]
    elif layout == "packed":  # h = gate|up itself, as the MLP passes it: one gradient tensor comes back
        h = _leaf((3, 5, 74 + 6), dtype, "contiguous", gen, device, scale=2.0)
        dy = _leaf(shape, dtype, "contiguous", gen, device).detach()
        packed = getattr(K, f"{op}_packed")
        _compare(lambda h: packed(h[..., 3:-3]), [h], dy, "PackedGLUFunctionBackward", max_block)
        return
    else:
        g, u = _leaf(shape, dtype, layout, gen, device, scale=2.0), _leaf(shape, dtype, layout, gen, device)
        fn, leaves = (lambda g, u: act(_view(g, shape, layout), _view(u, shape, layout))), [g, u]
    dy = _leaf(shape, dtype, "contiguous", gen, device).detach()
    _compare(fn, leaves, dy, "SwiGLUFunctionBackward", max_block)


def check_bias_gelu(dtype, with_bias, layout, max_block, device="cpu"):
    gen = torch.Generator().manual_seed(4)
    shape = (4, 3, 45)
    x = _leaf(shape, dtype, layout, gen, device, scale=2.0)
    bias = _leaf((45,), dtype, "contiguous", gen, device)
    dy = _view(_leaf(shape, dtype, layout, gen, device), shape, layout).detach()
    if with_bias:
        fn, leaves = (lambda x, bias: K.bias_gelu(_view(x, shape, layout), bias)), [x, bias]
    else:
        fn, leaves = (lambda x: K.bias_gelu(_view(x, shape, layout))), [x]
    _compare(fn, leaves, dy, "BiasGeLUFunctionBackward", max_block)


def check_cross_entropy(dtype, smoothing, layout, inplace, max_block, device="cpu", z_loss=0.0):
    """One rank: against the reference and against F.cross_entropy on the real vocabulary (padding 48 -> 45,
    padded logits large so that they would win if not excluded), with ignored tokens (+ z_loss logZ^2)."""
    gen = torch.Generator().manual_seed(5)
    vocab, padded, shape = 45, 48, (3, 7, 48)
    logits = _leaf(shape, dtype, layout, gen, device, scale=3.0)
    with torch.no_grad():
        _view(logits, shape, layout)[..., vocab:] = 30.0
    target = torch.randint(0, vocab, shape[:2], generator=gen).to(device)
    target[0, 0] = target[2, 6] = -100
    target[1, 0], target[1, 1] = 0, vocab - 1
    dloss = torch.randn(shape[:2], generator=gen).to(device)
    view = (lambda z: _view(z, shape, layout) * 1) if inplace else (lambda z: _view(z, shape, layout))
    fn = lambda z: K.cross_entropy(view(z), target, label_smoothing=smoothing, vocab_size=vocab,  # noqa: E731
                                   inplace_backward=inplace, z_loss=z_loss)
    _compare(fn, [logits], dloss, "CrossEntropyFunctionBackward", max_block)
    # the unfused torch expression (autograd of F.cross_entropy on the unpadded logits)
    z = _view(logits, shape, layout).detach().float()[..., :vocab].requires_grad_()
    ref = F.cross_entropy(z.reshape(-1, vocab), target.reshape(-1), label_smoothing=smoothing, reduction="none")
    ref = ref + z_loss * torch.logsumexp(z, -1).reshape(-1).square() * (target.reshape(-1) != -100)
    (ref_grad,) = torch.autograd.grad(ref, z, dloss.reshape(-1))
    got, _ = _run("triton", fn, [logits], dloss)
    full_grad = _view(got[1], shape, layout)
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(got[0], ref.view(shape[:2]), rtol=1e-5, atol=1e-5 if dtype == torch.float32 else 1e-4)
    torch.testing.assert_close(full_grad[..., :vocab].float(), ref_grad, **tol)
    assert torch.count_nonzero(full_grad[..., vocab:]) == 0 and torch.count_nonzero(full_grad[0, 0]) == 0
    assert padded == shape[-1]
    if inplace:  # the gradient lands in the logits buffer, and autograd knows the buffer changed
        z = torch.randn(6, 10, generator=gen).to(device, dtype).requires_grad_()
        t = torch.randint(0, 10, (6,), generator=gen).to(device)
        with K.use_backend("triton"):
            (grad,) = torch.autograd.grad(K.cross_entropy(z, t, inplace_backward=True).sum(), z)
        assert grad.data_ptr() == z.data_ptr() and z._version > 0
        with K.use_backend("triton"):
            z = torch.randn(6, 10, generator=gen).to(device, dtype).requires_grad_()
            squares = (z * z).sum()  # saves z; its backward runs after the loss's and must refuse
            total = K.cross_entropy(z, t, inplace_backward=True).sum() + squares
        with pytest.raises(RuntimeError, match="modified by an inplace operation"):
            total.backward()


def check_linear_cross_entropy(dtype, softcap, smoothing, z_loss, uniform, device="cpu"):
    """The fused linear cross-entropy with the Triton per-chunk kernels (row_stats, write_grad: really called)
    against the same op in torch and against the unfused head (matmul, then the reference cross-entropy): loss,
    hidden and weight gradients; 21 tokens in chunks of 4, vocabulary 45 padded to 48 (padded rows large), a
    uniform incoming gradient (no recomputation) or per-token weights (the weight gradient recomputed)."""
    from tpzoo.kernels import vocab_cross_entropy as kce

    gen = torch.Generator().manual_seed(6)
    vocab, padded, hidden = 45, 48, 24
    h = _leaf((3, 7, hidden), dtype, "contiguous", gen, device, scale=1.0)
    w = _leaf((padded, hidden), dtype, "contiguous", gen, device, scale=0.4)
    with torch.no_grad():
        w[vocab:] = 1.0
    target = torch.randint(0, vocab, (3, 7), generator=gen).to(device)
    target[0, :2] = target[2, 6] = -100
    dloss = (torch.full((), 0.7).expand(3, 7) if uniform else torch.rand(3, 7, generator=gen)).to(device)
    kw = dict(label_smoothing=smoothing, z_loss=z_loss, softcap=softcap, vocab_size=vocab)
    fused = lambda h, w: K.linear_cross_entropy(h, w, target, chunk_rows=4, **kw)  # noqa: E731

    def unfused(h, w):
        z = F.linear(h, w)
        z = torch.tanh(z / softcap) * softcap if softcap else z
        return K.cross_entropy(z, target, label_smoothing=smoothing, vocab_size=vocab, z_loss=z_loss)

    calls = []
    originals = kce.row_stats, kce.write_grad
    kce.row_stats = lambda *a: calls.append("stats") or originals[0](*a)
    kce.write_grad = lambda *a: calls.append("grad") or originals[1](*a)
    try:
        got, name = _run("triton", fused, [h, w], dloss)
    finally:
        kce.row_stats, kce.write_grad = originals
    assert name == "LinearCrossEntropyFunctionBackward" and calls.count("stats") == 6 and "grad" in calls, calls
    ref, _ = _run("torch", fused, [h, w], dloss)
    if dtype == torch.float32:
        dense, _ = _run("torch", unfused, [h, w], dloss)
        for i, (g, r, d) in enumerate(zip(got, ref, dense)):
            for other in (r, d):
                torch.testing.assert_close(g, other, rtol=1e-5 if i == 0 else GRAD_RTOL_FP32, atol=1e-5,
                                           msg=lambda m: f"[{'loss' if i == 0 else f'grad {i}'}] {m}")
        return
    gold, _ = _run("torch", unfused, [h, w], dloss, dtype=torch.float64)
    for i, (g, r, o) in enumerate(zip(got, ref, gold)):
        scale = o.abs().max().item() + 1e-6
        err, ref_err = (g.double() - o).abs().max().item(), (r.double() - o).abs().max().item()
        assert g.dtype == r.dtype and g.shape == r.shape
        assert err <= 0.02 * scale and err <= 1.5 * ref_err + scale / 128, (i, err, ref_err, scale)


# ---- tests ------------------------------------------------------------------------------------------------

DTYPES = [torch.float32, torch.bfloat16]
DT_IDS = ["fp32", "bf16"]


@pytest.mark.parametrize("dtype", DTYPES, ids=DT_IDS)
@pytest.mark.parametrize("kind", ["rms", "layer", "layer_nobias"])
@pytest.mark.parametrize("shape,layout,max_block", [((3, 5, 50), "contiguous", 4096),
                                                    ((4, 3, 70), "sliced", 16),
                                                    ((3, 4, 33), "transposed", 16),
                                                    ((5, 7, 24), "sliced", 32)],
                         ids=["one_block", "sliced_multiblock", "transposed_multiblock", "rows_per_tile"])
def test_norms(interp, kind, dtype, shape, layout, max_block):
    interp(check_norm, kind, dtype, shape, layout, max_block)


@pytest.mark.parametrize("dtype", DTYPES, ids=DT_IDS)
@pytest.mark.parametrize("batched_cos,layout,max_block", [(False, "qkv", 4096), (True, "heads_first", 8)],
                         ids=["cos2d_qkv_view", "cos3d_transposed_multiblock"])
def test_rotary(interp, dtype, batched_cos, layout, max_block):
    interp(check_rotary, dtype, batched_cos, layout, max_block)


@pytest.mark.parametrize("dtype", DTYPES, ids=DT_IDS)
@pytest.mark.parametrize("layout,max_block", [("fused", 16), ("transposed", 4096), ("packed", 16)])
@pytest.mark.parametrize("op", ["swiglu", "geglu"])
def test_swiglu(interp, dtype, layout, max_block, op):
    interp(check_swiglu, dtype, layout, max_block, "cpu", op)


@pytest.mark.parametrize("dtype", DTYPES, ids=DT_IDS)
@pytest.mark.parametrize("with_bias,layout,max_block", [(True, "sliced", 16), (False, "contiguous", 4096)],
                         ids=["bias_sliced_multiblock", "nobias"])
def test_bias_gelu(interp, dtype, with_bias, layout, max_block):
    interp(check_bias_gelu, dtype, with_bias, layout, max_block)


@pytest.mark.parametrize("dtype", DTYPES, ids=DT_IDS)
@pytest.mark.parametrize("smoothing,layout,inplace,max_block", [(0.0, "contiguous", False, 4096),
                                                                (0.1, "sliced", False, 16),
                                                                (0.1, "transposed", True, 16)],
                         ids=["plain", "smoothing_sliced_multiblock", "smoothing_inplace_multiblock"])
def test_cross_entropy(interp, dtype, smoothing, layout, inplace, max_block):
    interp(check_cross_entropy, dtype, smoothing, layout, inplace, max_block, "cpu", 0.01 if inplace else 0.0)


@pytest.mark.parametrize("dtype", DTYPES, ids=DT_IDS)
@pytest.mark.parametrize("softcap,smoothing,z_loss,uniform", [(None, 0.0, 0.0, True), (5.0, 0.1, 0.01, False)],
                         ids=["plain_uniform", "softcap_smoothing_zloss_weighted"])
def test_linear_cross_entropy(interp, dtype, softcap, smoothing, z_loss, uniform):
    interp(check_linear_cross_entropy, dtype, softcap, smoothing, z_loss, uniform)


def test_fp8_casts_equal_the_reference_bit_for_bit(interp):
    """The FP8 cast kernels (tpzoo.kernels.float8) against reference.fp8_cast: every scale axis, format, layout
    and input dtype (tests/fp8_kernel_checks.py), and at every rounding decision of both formats; Triton's own
    conversion in the interpreter gets hundreds of those wrong (the kernel's bit-level routine is needed there,
    and the comparison sees the difference)."""
    from fp8_kernel_checks import check_fp8_casts, check_fp8_rounding

    interp(check_fp8_casts)
    assert interp(check_fp8_rounding) > 100


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_fp8_linear_launches_as_many_kernels_as_its_cpu_twin_counts(interp, recipe):
    """An FP8 linear's next micro-batch with the Triton casts (interpreted: one launch each) launches what the CPU
    path counts (each torch reference labelled as the one kernel it stands for), with the same outputs bit for
    bit: the launch budget in test_fp8.py, counted on the CPU path, is the GPU's."""
    from fp8_kernel_checks import fp8_linear_launches

    fwd, bwd, outs, casts = interp(fp8_linear_launches, recipe, "triton")
    fwd_ref, bwd_ref, outs_ref, casts_ref = fp8_linear_launches(recipe, "torch")
    assert (fwd, bwd, casts) == (fwd_ref, bwd_ref, casts_ref)
    assert all(torch.equal(a, b) for a, b in zip(outs, outs_ref))


@pytest.mark.cuda
def test_cuda():
    pytest.importorskip("triton")
    for dtype in DTYPES:
        for kind in ("rms", "layer", "layer_nobias"):
            check_norm(kind, dtype, (64, 3000), "sliced", 1024, "cuda")
            check_norm(kind, dtype, (3, 5, 50), "transposed", 4096, "cuda")
        check_rotary(dtype, True, "qkv", 4096, "cuda")
        check_rotary(dtype, False, "heads_first", 8, "cuda")
        check_swiglu(dtype, "fused", 4096, "cuda")
        check_swiglu(dtype, "fused", 4096, "cuda", "geglu")
        check_bias_gelu(dtype, True, "sliced", 4096, "cuda")
        check_cross_entropy(dtype, 0.1, "sliced", False, 4096, "cuda")
        check_cross_entropy(dtype, 0.0, "contiguous", True, 16, "cuda")
        check_cross_entropy(dtype, 0.1, "contiguous", False, 4096, "cuda", z_loss=0.01)
        check_linear_cross_entropy(dtype, None, 0.0, 0.0, True, "cuda")
        check_linear_cross_entropy(dtype, 5.0, 0.1, 0.01, False, "cuda")


@pytest.mark.cuda
def test_cuda_fp8_casts():
    """The FP8 cast kernels compiled, with the hardware's conversion (cvt.rn.satfinite), against torch's cast bit
    for bit, on GPU-sized tiles and rows."""
    pytest.importorskip("triton")
    from fp8_kernel_checks import check_fp8_casts, check_fp8_rounding

    check_fp8_casts("cuda")
    assert check_fp8_rounding("cuda") == 0
