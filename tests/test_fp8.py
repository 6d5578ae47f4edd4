"""FP8 training (tpzoo.parallel.fp8): the emulated GEMMs against a plain quantize-dequantize reference, bit for bit;
tp = 2 (+SP), pp = 2 (1F1B, zero-bubble) and dp = 2 against one process, step by step; LoRA on an FP8 base; a
100-step run against bf16; bad recipes and layers that fall back.

Parity runs in float64 with float64 gradients (no GradBuffer) and the unfused vocab-parallel loss (which keeps
float64; the fused head computes in fp32, and the head is never FP8): summation order then moves results by
~1e-16, far from an fp8 rounding boundary, so every layout quantizes exactly the same values and agrees to 1e-12,
while scales taken per rank (the check that the test can fail) move them by about 1e-2."""
import math

import pytest
import torch

import tpzoo
from tpzoo.models import Inputs, LossOptions, ModelLayout, Transformer, get_config
from tpzoo.parallel import comm, fp8, gather_tp_tensor, grad_of, local_dims, param_spec
from tpzoo.parallel.context_parallel import shard_batch
from tpzoo.parallel.fp8 import E4M3, E5M2, Fp8Linear, enable_fp8, get_recipe
from tpzoo.pipeline import build_model_chunks, finalize_grads, forward_backward
from tpzoo.testing import run_on_ranks

from test_3d_parity import local_microbatches, make_optimizer
from test_train import store, tiny  # noqa: F401 (store: the token-store fixture)

SEED, STEPS, RTOL = 1234, 2, 1e-12
MODELS = {"llama": get_config("nano-llama").replace(num_layers=4),  # 2 kv heads: one per rank at tp = 2
          "gpt": get_config("nano-gpt")}                            # biases, GeLU (the bias added outside), tied


# -- the GEMMs, bit for bit -------------------------------------------------------------------------------------

def _qdq_gemm(a, b, rowwise: bool, fa, fb):
    """a @ b with a and b quantized to fa / fb and dequantized: tensorwise one scale each; rowwise a scale per row
    of a and per column of b (over the contraction dim), rounded down to a power of two (frexp: s = m 2^e with
    m in [0.5, 1), so 2^(e-1)). The product in fp64, as the emulation computes it."""
    def q(t, amax, fmt):
        top = torch.finfo(fmt).max
        s = torch.tensor(top) / amax.float().clamp(min=1e-12)
        if rowwise:
            s = torch.ldexp(torch.ones_like(s), torch.frexp(s).exponent - 1)
        return (t.float() * s).clamp(-top, top).to(fmt).double(), 1.0 / s.double()

    if rowwise:
        qa, ia = q(a, a.abs().amax(1, keepdim=True), fa)
        qb, ib = q(b, b.abs().amax(0, keepdim=True), fb)
    else:
        qa, ia = q(a, a.abs().max(), fa)
        qb, ib = q(b, b.abs().max(), fb)
    return ((qa @ qb) * (ia * ib)).float()


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_emulated_gemms_equal_quantize_dequantize_reference(recipe):
    """Forward, input gradient and weight gradient of fp8.linear (bf16 operands, 24 tokens: not a multiple of 16)
    equal the reference bit for bit: tensorwise e4m3 x and W, e5m2 gradients; rowwise e4m3 with per-row scales."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 12, 32, generator=g).bfloat16().requires_grad_()
    w = (torch.randn(48, 32, generator=g) * 0.05).bfloat16().requires_grad_()
    b = torch.randn(48, generator=g).bfloat16().requires_grad_()
    dy = (torch.randn(2, 12, 48, generator=g) * 1e-3).bfloat16()
    dy[0, 3] = 0  # an all-zero gradient row (ignored tokens): scale from the amax floor
    y = fp8.linear(x, w, b, Fp8Linear(get_recipe(recipe), "column"))
    y.backward(dy)

    rowwise, gfmt = recipe == "rowwise", (E4M3 if recipe == "rowwise" else E5M2)
    x2, dy2 = x.detach().reshape(24, 32), dy.reshape(24, 48)
    want_y = (_qdq_gemm(x2, w.detach().t(), rowwise, E4M3, E4M3).bfloat16() + b.detach()).view(2, 12, 48)
    want_dx = _qdq_gemm(dy2, w.detach(), rowwise, gfmt, E4M3).bfloat16().view(2, 12, 32)
    want_dw = _qdq_gemm(dy2.t(), x2, rowwise, gfmt, E4M3).bfloat16()
    assert torch.equal(y.detach(), want_y)
    assert torch.equal(x.grad, want_dx)
    assert torch.equal(w.grad, want_dw)
    assert torch.equal(b.grad, dy2.sum(0))
    # and FP8 is really in play: the product differs from the bf16 one
    assert not torch.equal(y.detach(), torch.nn.functional.linear(x.detach(), w.detach(), b.detach()))


def _linear_grads(recipe, x, w, b, dy):
    x, w, b = (t.detach().clone().requires_grad_() for t in (x, w, b))
    y = fp8.linear(x, w, b, Fp8Linear(get_recipe(recipe), "column"))
    y.backward(dy)
    return y.detach(), x.grad, w.grad


@pytest.mark.cuda
@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_cuda_scaled_mm_matches_the_emulation(recipe):
    """The GPU twin of test_emulated_gemms_equal_quantize_dequantize_reference: the same bf16 layer through
    torch._scaled_mm (Hopper; 40 tokens, so the weight gradient's contraction is zero-padded to 48) against the CPU
    emulation: the same fp8 operands, so only the kernel's accumulation order (and the forward's fast
    accumulation) differ: within 1 % of each tensor's largest entry, and the fp32 weight gradient too. The
    Triton casts equal the torch reference bit for bit."""
    if torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("FP8 GEMMs need compute capability 8.9+ (Ada, Hopper)")
    g = torch.Generator().manual_seed(0)
    x = torch.randn(40, 64, generator=g).bfloat16()
    w = (torch.randn(96, 64, generator=g) * 0.05).bfloat16()
    b = torch.randn(96, generator=g).bfloat16()
    dy = (torch.randn(40, 96, generator=g) * 1e-3).bfloat16()
    cpu = _linear_grads(recipe, x, w, b, dy)
    gpu = _linear_grads(recipe, *(t.cuda() for t in (x, w, b, dy)))
    for want, got in zip(cpu, gpu):
        torch.testing.assert_close(got.cpu().float(), want.float(), rtol=0, atol=0.01 * float(want.abs().max()))
    # the amax is max |t|; the Triton casts (hardware rounding) give exactly the torch reference's fp8 values
    from tpzoo.kernels import reference

    for t in (x.cuda(), dy.cuda()):
        for mode, dim in (("tensor", None), ("rows", 1), ("cols", 0)):
            a = fp8.amax(t, dim)
            assert torch.equal(a, t.abs().amax() if dim is None else t.abs().amax(dim, keepdim=True))
            for dtype in (E4M3, E5M2):
                got = fp8.cast(t, a, dtype, mode, recipe == "rowwise", want_q=True, want_t=True)
                want = reference.fp8_cast(t, a, dtype, mode, recipe == "rowwise", True, True, fp8.ALIGN)
                assert all(torch.equal(g.view(torch.uint8), w.view(torch.uint8)) for g, w in zip(got[:2], want[:2]))
                assert torch.equal(got[2], want[2])
    f = Fp8Linear(get_recipe(recipe), "column")
    saved = f.forward(x.cuda(), w.cuda())[1]
    scales = f.backward_scales(dy.cuda(), w.cuda(), saved, False, True)
    main = f.weight_grad(dy.cuda(), x.cuda(), saved, scales, out_dtype=torch.float32)
    assert main.dtype == torch.float32
    torch.testing.assert_close(main.cpu(), cpu[2].float(), rtol=0, atol=0.01 * float(cpu[2].abs().max()))


def test_bad_recipe_is_refused_in_one_line():
    with pytest.raises(ValueError, match=r"^fp8 recipe 'e4m3' is unknown: choose one of none, tensorwise, rowwise$"):
        get_recipe("e4m3")
    with pytest.raises(ValueError, match="fp8 recipe 'delayed' is unknown"):
        enable_fp8([Transformer(MODELS["llama"], ModelLayout(device="meta"))], "delayed")
    from tpzoo.train import load_config
    from tpzoo.train.config import ModelSection

    with pytest.raises(ValueError, match="fp8"):
        load_config(None, {"fp8": "mxfp8"})
    choices = ModelSection.__dataclass_fields__["fp8"].metadata["choices"]
    assert tuple(choices) == fp8.FP8_RECIPES  # the config spells the recipes out (no import at config time)


def test_a_gpu_that_cannot_run_the_recipe_is_refused_in_one_line():
    gpu, runs = torch.device("cuda", 0), (lambda rec, device: None)  # a trial GEMM that ran
    for recipe in ("tensorwise", "rowwise"):
        problem = fp8.hardware_problem(recipe, gpu, (8, 0), trial=runs)  # an A100: no trial needed
        assert problem.startswith(f"--fp8 {recipe} needs FP8 tensor cores (compute capability 8.9+")
        assert "has 8.0: train without --fp8" in problem and "\n" not in problem
        for capability in ((8, 9), (9, 0)):
            assert fp8.hardware_problem(recipe, gpu, capability, trial=runs) is None
        assert fp8.hardware_problem(recipe, torch.device("cpu")) is None  # the emulation
    assert fp8.hardware_problem("none", gpu, (7, 0)) is None

    def refused(rec, device):  # what cuBLAS said of row-wise scaling on an sm_120 board
        raise RuntimeError("CUDA error: CUBLAS_STATUS_NOT_SUPPORTED when calling cublasLtMatmulAlgoGetHeuristic\nmore")
    problem = fp8.hardware_problem("rowwise", gpu, (12, 0), trial=refused)
    assert problem.startswith("--fp8 rowwise: torch ") and "cannot run its scaled GEMMs" in problem
    assert "(RuntimeError: CUDA error: CUBLAS_STATUS_NOT_SUPPORTED" in problem and "try --fp8 tensorwise" in problem
    assert "\n" not in problem
    assert fp8.hardware_problem("rowwise", gpu, (9, 0), trial=lambda rec, device: None) is None


def test_the_hardware_trial_runs_an_fp8_linear_s_three_gemms():
    """The trial's own code, on the CPU emulation (on a GPU the same calls reach torch._scaled_mm)."""
    for name in ("tensorwise", "rowwise"):
        y, dx, dw = fp8._trial_gemm(get_recipe(name), torch.device("cpu"))
        assert (y.shape, dx.shape, dw.shape) == ((40, 16), (40, 32), (16, 32))
        assert (y.dtype, dx.dtype, dw.dtype) == (torch.bfloat16, torch.bfloat16, torch.float32)
        assert all(torch.isfinite(t).all() for t in (y, dx, dw))


# -- layouts against one process ----------------------------------------------------------------------------------

def _lora(chunks):
    from tpzoo.models.lora import LoRAConfig, add_lora, init_lora

    add_lora(chunks, LoRAConfig(rank=4, alpha=8.0, dropout=0.0, targets=["all-linear"]))
    init_lora(chunks, SEED)


def _full(cfg, name, t):
    return t[: cfg.vocab_size] if name in ("embed.weight", "lm_head.weight") else t


def _train(chunks, dims, cfg, layout: dict, recipe: str) -> dict:
    """STEPS SGD steps of the chunks on the parity test's global batches, micro-batch by micro-batch (this dp
    rank's share), float64 gradients summed over dp: each step's loss sum and full (tp-gathered) gradients."""
    if layout.get("lora"):
        _lora(chunks)
    report = enable_fp8(chunks, recipe)
    params = list({id(p): p for c in chunks for p in c.parameters() if p.requires_grad}.values())
    opt = make_optimizer(params)
    losses, grads = [], []
    for step in range(STEPS):
        mbs, tokens = local_microbatches(cfg, step)
        if dims.cp > 1:  # this rank's two load-balanced chunks of every sequence
            mbs = [shard_batch(mb, dims, layout.get("sp", False)) for mb in mbs]
        for p in params:
            p.grad = None
        out = forward_backward(chunks, mbs, dims, schedule=layout.get("schedule", "1f1b"), loss_scale=1.0 / tokens,
                               loss=LossOptions(fused=False))
        finalize_grads(chunks, dims)
        for p in params:
            comm.all_reduce(p.grad, dims.grad_group)  # a group of one: nothing
        losses.append(out["loss_sum"])
        grads.append({n: _full(cfg, n, gather_tp_tensor(grad_of(p), param_spec(p), reduce="first"))
                      for c in chunks for n, p in c.named_parameters() if p.requires_grad})
        opt.step()
    return {"coords": (dims.tp_rank, dims.pp_rank, dims.dp_rank), "loss_sum": losses, "grads": grads,
            "fp8_layers": len(report.fp8_layers), "fallbacks": report.fallbacks}


def run_layouts(model: str, recipe: str, layouts: list[dict]) -> list[dict]:
    """Worker entry point: every layout in turn on this rank. layout["local_scales"]: each rank takes its amaxes
    alone (the reductions skipped), the mistake consistent scales prevent."""
    cfg, results = MODELS[model], []
    for layout in layouts:
        dims = tpzoo.init_parallel(tp=layout.get("tp", 1), cp=layout.get("cp", 1), pp=layout.get("pp", 1),
                                   dp=layout.get("dp", 1))
        saved_run = fp8._Reductions.run
        if layout.get("local_scales"):
            fp8._Reductions.run = lambda self: list(self.tensors)
        try:
            chunks = build_model_chunks(cfg, dims, sequence_parallel=layout.get("sp", False), seed=SEED,
                                        dtype=torch.float64)
            results.append(_train(chunks, dims, cfg, layout, recipe))
        finally:
            fp8._Reductions.run = saved_run
            tpzoo.destroy_parallel()
    return results


def _reference(model: str, recipe: str, lora: bool = False) -> dict:
    """One process, one Transformer (no pipeline machinery), the same micro-batches in the same order."""
    cfg = MODELS[model]
    chunks = [Transformer(cfg, ModelLayout(dtype=torch.float64), seed=SEED)]
    return _train(chunks, local_dims(), cfg, {"lora": lora}, recipe)


def _worst(ranks: list[dict], ref: dict, cfg) -> float:
    """The largest difference from the reference over every step's loss and gradients, relative to the size of
    each tensor (the loss: the sum over dp ranks of the last stage's)."""
    worst = 0.0
    for step, want in enumerate(ref["loss_sum"]):
        last = max(r["coords"][1] for r in ranks)
        got = sum(r["loss_sum"][step] for r in ranks if r["coords"][0] == 0 and r["coords"][1] == last)
        worst = max(worst, abs(got - want) / abs(want))
    seen = set()
    for r in ranks:
        for step, grads in enumerate(r["grads"]):
            for name, g in grads.items():
                want = ref["grads"][step]["embed.weight" if name == "lm_head.weight" and cfg.tie_embeddings
                                          and name not in ref["grads"][step] else name]
                worst = max(worst, float((g - want).abs().max()) / max(float(want.abs().max()), 1e-30))
                seen.add(name)
    assert seen >= set(ref["grads"][0]) - {"lm_head.weight"}, sorted(set(ref["grads"][0]) - seen)
    return worst


LAYOUTS = {"llama": [dict(tp=2), dict(tp=2, sp=True), dict(pp=2), dict(pp=2, schedule="zb"), dict(dp=2),
                     dict(cp=2), dict(tp=2, sp=True, lora=True), dict(tp=2, sp=True, local_scales=True)],
           "gpt": [dict(tp=2, sp=True), dict(pp=2, schedule="zb")]}  # the tied head on both stages


@pytest.mark.parametrize("model,recipe", [("llama", "tensorwise"), ("llama", "rowwise"), ("gpt", "tensorwise")])
def test_layouts_match_one_process_step_by_step(model, recipe):
    """FP8 at tp = 2, tp = 2 + SP, pp = 2 (1F1B, zero-bubble), dp = 2, cp = 2 (ring attention: the amaxes over
    tokens agree over cp), and LoRA on the FP8 base at tp = 2 + SP:
    both steps' losses and every gradient equal one process's to 1e-12. With per-rank scales tp = 2 + SP is off
    by orders of magnitude more. nano-llama (4 layers, kv heads split) and nano-gpt (biases, the GeLU MLP whose
    bias is added outside the matmul, tied embeddings)."""
    cfg, layouts = MODELS[model], LAYOUTS[model]
    n_fp8 = 4 * cfg.num_layers
    per_rank = run_on_ranks(2, run_layouts, model, recipe, layouts)
    refs = {lora: _reference(model, recipe, lora) for lora in {bool(lay.get("lora")) for lay in layouts}}
    assert refs[False]["fp8_layers"] == n_fp8 and not refs[False]["fallbacks"]
    for i, layout in enumerate(layouts):
        ranks = [r[i] for r in per_rank]
        assert all(r["fp8_layers"] == n_fp8 // layout.get("pp", 1) for r in ranks), layout
        worst = _worst(ranks, refs[bool(layout.get("lora"))], cfg)
        if layout.get("local_scales"):
            assert worst > 1e-4, (layout, worst)
        else:
            assert worst < RTOL, (layout, worst)


def test_zero_bubble_weight_pass_of_the_sp_column_matmul_matches_one_process():
    """tp = 2 + SP under pp = 2 zero-bubble (4 ranks): the weight pass re-gathers the column inputs and agrees on
    the output gradient's scale again; tensorwise (the recipe whose weight gradient needs that reduction)."""
    cfg, layout = MODELS["llama"], dict(tp=2, pp=2, sp=True, schedule="zb")
    per_rank = run_on_ranks(4, run_layouts, "llama", "tensorwise", [layout])
    assert _worst([r[0] for r in per_rank], _reference("llama", "tensorwise"), cfg) < RTOL


# -- whole runs ---------------------------------------------------------------------------------------------------

def test_100_steps_stay_close_to_bf16_and_lora_trains_on_an_fp8_base(store, tmp_path):
    """The trainer with --fp8 (bf16 weights, nano-gpt, 100 steps): the loss of the last 10 steps within 3 % of the
    bf16 run's, every projection in FP8 and the head not. Then a LoRA run on that checkpoint, the frozen base in
    FP8, at tp = 2 + SP."""
    kw = dict(model="nano-gpt", steps=100, dtype="bf16", global_batch_size=8, micro_batch_size=8, warmup_steps=5)
    runs = {}
    for recipe in ("none", "tensorwise", "rowwise"):
        save = str(tmp_path / recipe) if recipe == "none" else ""
        runs[recipe] = run_on_ranks(1, _train_run, tiny(store, fp8=recipe, save=save, **kw))[0]
    tail = {recipe: sum(r["losses"][-10:]) / 10 for recipe, r in runs.items()}
    assert runs["none"]["losses"][-1] < runs["none"]["losses"][0] - 1.0
    for recipe in ("tensorwise", "rowwise"):
        assert runs[recipe]["fp8"] == {"recipe": recipe, "layers": 8, "fallbacks": []}
        assert abs(tail[recipe] - tail["none"]) <= 0.03 * tail["none"], tail
        assert runs[recipe]["losses"] != runs["none"]["losses"]  # FP8 changed the numerics

    # LoRA through the trainer: adapters on that checkpoint, the frozen base in FP8, at tp = 2 + SP
    lora = tiny(store, base=runs["none"]["checkpoint"], lora_rank=4, lora_alpha=8.0, fp8="tensorwise", steps=3,
                tp=2, sequence_parallel=True, dtype="bf16")
    r = run_on_ranks(2, _train_run, lora)[0]
    assert r["status"] == "ok" and r["fp8"]["layers"] == 8 and all(math.isfinite(x) for x in r["losses"])


def _train_run(cfg):
    from tpzoo.train import train

    return train(cfg)


def test_layers_with_dims_off_16_stay_in_bf16_and_are_reported():
    """ffn 40: the down projection's input (40) is not a multiple of 16; it keeps F.linear's exact result, the
    other layers go FP8, and the report says which role, shape and how many."""
    cfg = get_config("nano-llama").replace(ffn_hidden_size=40)
    model = Transformer(cfg, seed=SEED)
    report = enable_fp8([model], "rowwise")
    assert [n for n, _, _ in report.fallbacks] == ["layers.0.mlp.fc_out", "layers.1.mlp.fc_out"]
    assert "mlp.fc_out [32 x 40] x2" in report.line() and "6 linear layers in FP8" in report.line()
    down, up = model.layers["0"].mlp.fc_out, model.layers["0"].mlp.fc_in
    assert down.fp8 is None and up.fp8 is not None and model.lm_head.fp8 is None
    x = torch.randn(2, 5, 40)
    assert torch.equal(down(x), torch.nn.functional.linear(x, down.weight))
    assert enable_fp8([model], "none").line() == "" and up.fp8 is None  # and back


def _fit_adapters(recipe: str) -> tuple[list, bool, bool]:
    """30 AdamW steps of LoRA adapters (every projection) on a fixed batch, the nano-llama base in `recipe`:
    (losses, whether the base is bit for bit unchanged, whether every A and B moved)."""
    from tpzoo.models.lora import LoRAConfig, add_lora, init_lora

    model = Transformer(MODELS["llama"], seed=SEED)
    add_lora([model], LoRAConfig(rank=8, alpha=16.0, dropout=0.0, targets=["all-linear"]))
    init_lora([model], SEED)
    assert len(enable_fp8([model], recipe).fp8_layers) == (16 if recipe != "none" else 0)
    base = {n: p.detach().clone() for n, p in model.named_parameters() if not p.requires_grad}
    adapters = {n: p for n, p in model.named_parameters() if p.requires_grad}
    start = {n: p.detach().clone() for n, p in adapters.items()}
    assert adapters and all(".lora." in n for n in adapters)
    ids = torch.randint(0, MODELS["llama"].vocab_size, (4, 16), generator=torch.Generator().manual_seed(3))
    opt = torch.optim.AdamW(adapters.values(), lr=1e-2)
    losses = []
    for _ in range(30):
        loss = model(Inputs(ids, labels=torch.roll(ids, -1, 1))).float().mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return (losses, all(torch.equal(p, base[n]) for n, p in model.named_parameters() if n in base),
            all(not torch.equal(p, start[n]) for n, p in adapters.items()))


def test_lora_adapters_train_on_an_fp8_base():
    """In one process: adapters on an FP8 base (tensorwise) fit a fixed batch as on the plain base (the frozen
    random head bounds both near 4.0 from 4.6), the base stays bit for bit as it was, and every A and B moved."""
    fp8_losses, base_kept, all_moved = _fit_adapters("tensorwise")
    bf16_losses, _, _ = _fit_adapters("none")
    assert base_kept and all_moved
    assert fp8_losses[-1] < fp8_losses[0] - 0.4, fp8_losses
    assert abs(fp8_losses[-1] - bf16_losses[-1]) < 0.02 * bf16_losses[-1], (fp8_losses[-1], bf16_losses[-1])


# -- launches and the weights' casts ------------------------------------------------------------------------------

# Launches of one FP8 linear's micro-batch (a column layer, tp = 1, its weight cached): amax, cast and GEMM per
# operand, the output gradient cast once in both layouts. The Triton path launches the same (test_kernels.py).
# Before issue 36 the same forward and backward took 28 and 37 ops (tensorwise), 34 and 68 (rowwise).
LAUNCH_BUDGET = {"tensorwise": (3, 5), "rowwise": (2, 7)}


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_an_fp8_linear_launches_few_kernels(recipe):
    """Forward: amax (none where the amax is fused into the row cast), one cast of x, one _scaled_mm.
    Backward: amax of dy, dy cast in both layouts (tensorwise; rowwise: per token, then per channel with x),
    x cast transposed, two _scaled_mm. No host arithmetic on scales, no transposes or padding copies; the weight's
    casts come from the cache (none here). Fails when the count grows."""
    from fp8_kernel_checks import fp8_linear_launches
    from tpzoo.kernels.launch import launches

    fwd, bwd, _, casts = fp8_linear_launches(recipe, "torch")
    assert (sum(fwd.values()), sum(bwd.values())) <= LAUNCH_BUDGET[recipe], (fwd, bwd)
    assert (launches(fwd), launches(bwd)) == (sum(fwd.values()), sum(bwd.values()))
    assert casts == (1 if recipe == "tensorwise" else 2)  # from the first micro-batch only


CACHE_CFG = get_config("nano-llama").replace(num_layers=2)
MICRO_BATCHES = 2


def _cached_run(layout: dict) -> dict:
    """Two AdamW steps (DistributedAdamW, fp32) of MICRO_BATCHES micro-batches each, FP8 `layout["recipe"]`, the weights'
    casts kept or not (`cache`), ZeRO level `zero`, recomputation, LoRA; `stale`: the optimizer's publication
    hidden from FP8 (the bug caching must not have). Returns the losses, the weights after, and the weight casts."""
    from tpzoo.train.optim import DistributedAdamW

    dims = tpzoo.init_parallel(dp=layout.get("dp", 1))
    saved = fp8.weights_changed
    if layout.get("stale"):
        fp8.weights_changed = lambda: None
    try:
        chunks = build_model_chunks(CACHE_CFG, dims, seed=SEED, recompute=layout.get("recompute", "none"))
        if layout.get("lora"):
            _lora(chunks)
        enable_fp8(chunks, layout["recipe"], cache_weights=layout["cache"])
        params = [p for c in chunks for p in c.parameters() if p.requires_grad]
        opt = DistributedAdamW(params, dims, zero=layout.get("zero", 0), modules=chunks, weight_decay=0.1,
                               keep_gathered=layout.get("keep", False))
        g = torch.Generator().manual_seed(dims.dp_rank)
        losses = []
        for _ in range(2):
            mbs = [{"input_ids": ids[:, :-1], "labels": ids[:, 1:]} for ids in
                   (torch.randint(0, CACHE_CFG.vocab_size, (2, 17), generator=g) for _ in range(MICRO_BATCHES))]
            opt.zero_grad()
            out = forward_backward(chunks, mbs, dims, loss_scale=1.0 / 64)
            finalize_grads(chunks, dims)
            opt.reduce_grads()
            opt.step(1e-2)
            losses.append(out["loss_sum"])
        # a forward after the last step: its casts see the published weights
        with torch.no_grad():
            losses.append(float(chunks[0](Inputs(mbs[0]["input_ids"], labels=mbs[0]["labels"])).sum()))
        layers = [m.fp8 for c in chunks for m in c.modules() if getattr(m, "fp8", None) is not None]
        return {"losses": losses, "weights": opt.full_weights().clone(), "layers": len(layers),
                "casts": sum(f.weight_casts for f in layers)}
    finally:
        fp8.weights_changed = saved
        tpzoo.destroy_parallel()


def _cache_layouts(layouts: list[dict]) -> list[dict]:
    return [_cached_run(layout) for layout in layouts]


def test_weights_are_cast_once_per_step_and_again_after_it():
    """2 micro-batches per step, full recomputation: each FP8 weight is cast once per step (tensorwise: both
    layouts in one kernel; rowwise: one kernel per scale axis) and once for the forward after the last step (no
    backward: the forward's layout only), where casting per use takes (forward, recomputation, backward) per
    micro-batch. Losses and weights equal casting per use bit for bit; with the optimizer's publication hidden,
    the stale fp8 weights change the second step."""
    results = {}
    for recipe in ("tensorwise", "rowwise"):
        for cache in (True, False):
            results[recipe, cache] = _cached_run(dict(recipe=recipe, cache=cache, recompute="full"))
        per_step = 1 if recipe == "tensorwise" else 2
        on, off = results[recipe, True], results[recipe, False]
        assert on["layers"] == 4 * CACHE_CFG.num_layers
        assert on["casts"] == on["layers"] * (2 * per_step + 1)  # 2 steps and the forward after them
        assert off["casts"] == on["layers"] * (2 * MICRO_BATCHES * 3 + 1)
        assert on["losses"] == off["losses"] and torch.equal(on["weights"], off["weights"])
    stale = _cached_run(dict(recipe="tensorwise", cache=True, recompute="full", stale=True))
    want = results["tensorwise", True]
    assert stale["losses"][0] == want["losses"][0] and stale["losses"][1] != want["losses"][1]
    assert stale["casts"] == stale["layers"]  # cast once, never again


def test_weight_casts_under_zero_1_2_3_and_lora():
    """dp = 2 ranks: ZeRO-1 and ZeRO-2 publish by all-gather (no version counter moves: the publication invalidates
    the casts), ZeRO-3 regathers the layers (cached only with the layers kept gathered for the step: each use
    casts otherwise), LoRA's frozen base is cast once for the whole run. Cast once per step where cached; losses
    and weights equal casting per use bit for bit."""
    layouts = [dict(recipe="tensorwise", dp=2, zero=z, cache=c, keep=z == 3, lora=lora)
               for z, lora in ((1, False), (3, False), (1, True)) for c in (True, False)]
    per_rank = run_on_ranks(2, _cache_layouts, layouts)
    for rank in per_rank:
        for i in range(0, len(layouts), 2):
            on, off, layout = rank[i], rank[i + 1], layouts[i]
            assert on["losses"] == off["losses"] and torch.equal(on["weights"], off["weights"]), layout
            n = on["layers"]
            assert on["casts"] == (n if layout["lora"] else 3 * n), (layout, on["casts"])
            # per use: forward and backward of each micro-batch (the frozen embedding's layer 0 qkv needs no
            # input gradient under LoRA: no backward cast there), and the last forward
            assert off["casts"] == n * (2 * MICRO_BATCHES * 2 + 1) - 2 * MICRO_BATCHES * layout["lora"], layout


MODELS["mla"] = get_config("tiny-deepseek-v3").replace(num_layers=2, vocab_size=97, token_mixers=["mla"] * 2,
                                                    channel_mixers=["mlp", "mlp"])  # (the router computes in fp32)
LAYOUTS["mla"] = [dict(tp=2, sp=True), dict(cp=2), dict(tp=2, sp=True, local_scales=True)]


def test_latent_attention_in_fp8_matches_one_process():
    """A DeepSeek-V3 cut (its latent attention, dense MLPs: the router's fp32 scores would leave 1e-7 differences in
    this float64 comparison) in FP8 (tensorwise): every projection of the latent attention, the replicated down
    projections (q_a_proj, kv_a_proj_with_mqa) included, and the MLP's. At tp 2 + SP (the down projections' amaxes over the
    tokens agree over tp) and cp 2 both steps equal one process's to 1e-12; with per-rank scales tp 2 + SP is off."""
    per_rank = run_on_ranks(2, run_layouts, "mla", "tensorwise", LAYOUTS["mla"])
    ref = _reference("mla", "tensorwise")
    assert ref["fp8_layers"] == 2 * (5 + 2) and not ref["fallbacks"], ref  # 5 MLA projections and 2 MLP ones a layer
    for i, layout in enumerate(LAYOUTS["mla"]):
        worst = _worst([r[i] for r in per_rank], ref, MODELS["mla"])
        assert (worst > 1e-4) if layout.get("local_scales") else (worst < RTOL), (layout, worst)
