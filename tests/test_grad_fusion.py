"""Gradient-accumulation fusion (tpzoo.parallel.wgrad) against the unfused path, bit for bit.

At each layout a tiny LLaMA trains three AdamW steps with DistributedAdamW twice on every rank, fusion on and off:
the loss, the reduced fp32 gradients of every step (what the optimizer steps on: the whole main-gradient buffer,
or under ZeRO this rank's shard) and every parameter after the last step must be *equal* (torch.equal): fusion only
moves where the same fp32 additions happen (the matmul adds its product into the main gradient instead of autograd
handing it over to be added; at these shapes the GEMM's product is the same sum either way). The exception is a
weight fed by a fused and a native op on one rank (a tied embedding and head at pp = 1): unfused, autograd sums
the two contributions first; fused, they are added into the fp32 main gradient one after the other (a rounding
difference, compared to 1e-5).

Layouts: dp = 2 with the overlapped reduction at ZeRO 0, 1, 2, 3 (small buckets: some weights cross a bucket
boundary, which ZeRO-2/3 leaves unfused), pp = 2 with 1f1b and zero-bubble (W restarts autograd.grad walks: the
declared-parameters path), tp = 2 with sequence parallelism (the gathered column matmul), LoRA (adapters
trained, base frozen) without and with SP, FP8 (tensorwise, rowwise: the FP8 weight-gradient GEMM's fp32 output
added into the main gradient) at tp = 2 + SP, dp = 2 at ZeRO-2, zero-bubble and with LoRA, and at 4 ranks
zero-bubble's W into ZeRO-2 staging buffers and TP + SP + DP at ZeRO-3. The LM head is fused too: the fused linear
cross-entropy (the models' default loss) adds its scaled fp32 weight gradient into the main gradient.

A tensor hook on every trainable parameter records each gradient tensor autograd hands it: with fusion none for
the column/row-parallel weights and biases (but those crossing a ZeRO-2 bucket boundary), without fusion one per
pass (so the spy itself is proven). The overlapped reduction keeps its promise with fusion on (the checks of
tests/test_zero.py: buckets start inside the backward that made them final, in order)."""
import pytest
import torch

import tpzoo
from test_3d_parity import MODELS, SEED
from test_lora import randomize_b
from test_zero import ADAM, BUCKET, LR, backward_step, check_overlap, step_timing
from tpzoo.models.lora import LoRAConfig, add_lora, init_lora
from tpzoo.parallel import ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding
from tpzoo.parallel.fp8 import enable_fp8
from tpzoo.pipeline import build_model_chunks
from tpzoo.testing import run_on_ranks

CFG = MODELS["llama"].replace(num_layers=2)
STEPS = 2  # the second step starts from weights the first one moved


def fused_params(chunks) -> dict:
    """id -> name of the parameters fusion applies to: column/row-parallel weights and biases (the LM head, a
    column layer, included) and the LoRA A of column layers (fed the layer's input), minus a weight an embedding of
    this rank also uses (tied at pp = 1)."""
    embeds = {id(m.weight) for c in chunks for m in c.modules() if isinstance(m, VocabParallelEmbedding)}
    out = {}
    for c in chunks:
        for name, m in c.named_modules():
            if isinstance(m, (ColumnParallelLinear, RowParallelLinear)):
                ps = {"weight": m.weight, "bias": m.bias}
                if m.lora is not None and isinstance(m, ColumnParallelLinear):
                    ps.update({f"lora.A.{n}": a for n, a in m.lora.A.items()})
                out.update({id(p): f"{name}.{n}" for n, p in ps.items()
                            if p is not None and p.requires_grad and id(p) not in embeds})
    return out


def train(layout: dict, fusion: bool) -> dict:
    from tpzoo.train.optim import DistributedAdamW

    tp, pp, dp = layout["tp"], layout.get("pp", 1), layout["dp"]
    dims = tpzoo.init_parallel(tp=tp, pp=pp, dp=dp)
    cfg = CFG.replace(tie_embeddings=layout.get("tied", False))
    try:
        chunks = build_model_chunks(cfg, dims, sequence_parallel=layout.get("sp", False), seed=SEED,
                                    recompute=layout.get("recompute", "none"))
        enable_fp8(chunks, layout.get("fp8", "none"))  # FP8 weight-gradient GEMMs accumulate into main grads too
        if layout.get("lora"):
            add_lora(chunks, LoRAConfig(rank=4, alpha=8.0))
            init_lora(chunks, SEED)
            randomize_b(chunks)
        params = list({id(p): p for c in chunks for p in c.parameters() if p.requires_grad}.values())
        opt = DistributedAdamW(params, dims, zero=layout["zero"], overlap=layout["overlap"], bucket_elems=BUCKET,
                               modules=chunks, grad_accumulation_fusion=fusion, **ADAM)
        assert opt.grads.fuse == fusion
        hits = {id(p): 0 for p in params}
        spies = [p.register_hook(lambda g, i=id(p): hits.__setitem__(i, hits[i] + (g is not None))) for p in params]
        losses, grads, timing = [], [], []
        for step in range(STEPS):
            out, m = backward_step(chunks, dims, cfg, opt, layout, step)
            grads.append(opt.grad_owned.clone())
            opt.global_grad_norm()
            opt.step(LR)
            losses.append(out["loss_sum"])
            timing.append(step_timing(opt, out, layout, m))
        for h in spies:
            h.remove()
        with opt.weights_readable():
            weights = {n: p.detach().clone() for c in chunks for n, p in c.named_parameters()}
        fused = fused_params(chunks)
        # ZeRO-2/3: a weight across a bucket boundary has no single staging buffer to accumulate into
        by_id = {id(p): p for p in params}
        across = {i for i in fused if len(opt.grads._of_param[i]) > 1 and not hasattr(by_id[i], "main_grad")}
        return {"loss_sum": losses, "grads": grads, "weights": weights, "timing": timing,
                "hits": {fused[i]: n for i, n in hits.items() if i in fused}, "across": {fused[i] for i in across}}
    finally:
        tpzoo.destroy_parallel()


def run_layouts(layouts: list[dict]) -> list[tuple[dict, dict]]:
    return [(train(layout, True), train(layout, False)) for layout in layouts]


def _same(a: torch.Tensor, b: torch.Tensor, exact: bool) -> bool:
    if exact:
        return torch.equal(a, b)
    return bool((a - b).abs().max() <= 1e-5 * b.abs().max().clamp_min(1e-30))


def check(on: dict, off: dict, layout: dict) -> None:
    exact = not (layout.get("tied") and layout.get("pp", 1) == 1)
    assert on["loss_sum"] == off["loss_sum"] if exact else on["loss_sum"] == pytest.approx(off["loss_sum"], rel=1e-6)
    for step, (a, b) in enumerate(zip(on["grads"], off["grads"])):
        assert _same(a, b, exact), (layout, step, (a - b).abs().max())
    for name, w in on["weights"].items():
        assert _same(w, off["weights"][name], exact), (layout, name)
    # with fusion no gradient tensor reaches a fused weight (but across ZeRO-2 buckets); without, every one
    assert on["hits"] and all(n > 0 for n in off["hits"].values()), layout
    handed = {name for name, n in on["hits"].items() if n}
    assert handed == on["across"], (layout, handed, on["across"])
    assert len(on["across"]) < len(on["hits"]), layout  # most weights were fused
    check_overlap(on["timing"], layout)


LAYOUTS = {
    2: [dict(tp=1, dp=2, zero=0, overlap=True), dict(tp=1, dp=2, zero=1, overlap=True),
        dict(tp=1, dp=2, zero=2, overlap=True), dict(tp=1, dp=2, zero=3, overlap=True, recompute="full"),
        dict(tp=1, dp=2, zero=0, overlap=True, tied=True),
        dict(tp=1, pp=2, dp=1, zero=1, overlap=False, tied=True),
        dict(tp=1, pp=2, dp=1, zero=0, overlap=False, tied=True, schedule="zb"),
        dict(tp=2, dp=1, sp=True, zero=1, overlap=False),
        dict(tp=1, dp=2, zero=0, overlap=True, lora=True), dict(tp=2, dp=1, sp=True, zero=0, overlap=False, lora=True),
        # FP8 (tpzoo.parallel.fp8): its weight-gradient GEMMs fused the same way
        dict(tp=2, dp=1, sp=True, zero=1, overlap=False, fp8="tensorwise"),
        dict(tp=1, dp=2, zero=2, overlap=True, fp8="rowwise"),
        dict(tp=1, pp=2, dp=1, zero=0, overlap=False, schedule="zb", fp8="tensorwise"),
        dict(tp=2, dp=1, sp=True, zero=0, overlap=False, lora=True, fp8="rowwise")],
    4: [dict(tp=1, pp=2, dp=2, zero=2, overlap=True, tied=True, schedule="zb"),
        dict(tp=2, dp=2, sp=True, zero=3, overlap=True)],
}


@pytest.mark.parametrize("world", sorted(LAYOUTS))
def test_fused_weight_gradients_equal_unfused(world):
    results = run_on_ranks(world, run_layouts, LAYOUTS[world])
    for i, layout in enumerate(LAYOUTS[world]):
        for rank in results:
            check(*rank[i], layout)
