"""`tpzoo plan --fp8`: the FLOPs the plan moves to the FP8 rate are the GEMMs tpzoo runs in FP8 (counted on CPU
through the scaled GEMM every FP8 matmul calls: dense and mixture-of-experts layers, LoRA, a projection left in
the model dtype), the step gets faster by their half and no more, and the casts' working set is in memory."""
import pytest
import torch

from tpzoo.models import Inputs, Transformer, get_config
from tpzoo.parallel import fp8
from tpzoo.plan import ClusterSpec, Layout, RankLayout, TrainingSpec, estimate, stage_memory
from tpzoo.plan.fp8 import fp8_flops, fp8_transient_bytes
from tpzoo.plan.spec import FP8_RECIPES

B, S = 2, 16
MODELS = {"dense": get_config("nano-llama").replace(num_layers=3),
          "moe": get_config("nano-mixtral").replace(hidden_size=48, ffn_hidden_size=64, head_dim=16, num_heads=3,
                                                    num_kv_heads=1),
          "off16": get_config("nano-llama").replace(ffn_hidden_size=40)}  # the down projection's input: 40


def _counted_fp8_flops(cfg, lora: bool) -> tuple[int, int]:
    """(forward, backward) FLOPs of the FP8 GEMMs of one micro-batch's forward and backward, at tp = 1."""
    model = Transformer(cfg, seed=0)
    if lora:
        from tpzoo.models.lora import LoRAConfig, add_lora, init_lora

        add_lora([model], LoRAConfig(rank=4, alpha=8.0))
        init_lora([model], 0)
    fp8.enable_fp8([model], "tensorwise")
    counted = [0]
    real = fp8.scaled_mm

    def counting(a, b, *args, **kw):
        counted[0] += 2 * a.shape[0] * a.shape[1] * b.shape[1]
        return real(a, b, *args, **kw)

    ids = torch.randint(0, cfg.vocab_size, (B, S), generator=torch.Generator().manual_seed(0))
    fp8.scaled_mm = counting
    try:
        loss = model(Inputs(ids, labels=ids)).sum()
        forward, counted[0] = counted[0], 0
        loss.backward()
    finally:
        fp8.scaled_mm = real
    return forward, counted[0]


@pytest.mark.parametrize("model,lora", [("dense", False), ("moe", False), ("off16", False), ("dense", True)])
def test_plan_counts_the_gemms_tpzoo_runs_in_fp8(model, lora):
    cfg = MODELS[model]
    forward, backward = _counted_fp8_flops(cfg, lora)
    want = fp8_flops(cfg, 1, B * S, list(range(cfg.num_layers)), lora, "none")
    if lora:  # nothing below layer 0 trains: its qkv input gradient is never asked for (the plan, as for bf16,
        # counts every input gradient)
        backward += 2 * B * S * cfg.hidden_size * (cfg.num_heads + 2 * cfg.num_kv_heads) * cfg.head_dim
    assert forward > 0 and (forward, backward) == (want["forward"], want["dgrad"] + want["wgrad"])


def test_fp8_speeds_the_step_by_half_its_fp8_gemms_and_holds_its_casts():
    cfg, cluster = get_config("llama-3-8b"), ClusterSpec(gpus=8)
    layout = Layout(tp=4, pp=1, dp=2, micro_batch_size=1, sequence_parallel=True)
    plain = TrainingSpec(seq_len=4096, global_batch_size=16)
    runs = {r: estimate(cfg, layout, cluster, TrainingSpec(seq_len=4096, global_batch_size=16, fp8=r))
            for r in FP8_RECIPES}
    f8 = fp8_flops(cfg, 4, 4096, list(range(cfg.num_layers)), False, "none")
    saved = runs["none"].micro_batches * (f8["forward"] + f8["dgrad"] + f8["wgrad"]) / 2
    saved_s = saved / (cluster.gpu_tflops * 1e12 * cluster.efficiency)
    for r in ("tensorwise", "rowwise"):
        assert runs[r].time.compute == pytest.approx(runs["none"].time.compute - saved_s, rel=1e-9)
        extra = runs[r].memory.transient - runs["none"].memory.transient
        assert extra == fp8_transient_bytes(cfg, RankLayout(tp=4), 4096, list(range(cfg.num_layers))) > 0
        # the weights' fp8 copies kept for the step: 2 bytes per element of every projection weight of the stage
        per_layer = 2 * (4096 * 6144 + 4096 * 4096 + 4096 * 28672 + 14336 * 4096) // 4
        assert runs[r].memory.params - runs["none"].memory.params == cfg.num_layers * per_layer
        zero3 = [estimate(cfg, layout, cluster, TrainingSpec(seq_len=4096, global_batch_size=16, fp8=f, zero=3))
                 for f in ("none", r)]  # gathered and cast per use: no copies kept, the weight's in the working set
        assert zero3[1].memory.params == zero3[0].memory.params
        assert zero3[1].memory.transient - zero3[0].memory.transient == fp8_transient_bytes(
            cfg, RankLayout(tp=4), 4096, list(range(cfg.num_layers)), per_use=True)
    assert runs["none"].memory.transient == stage_memory(cfg, layout, plain, 0).transient
    assert FP8_RECIPES == fp8.FP8_RECIPES
    with pytest.raises(ValueError, match="fp8 must be one of none, tensorwise, rowwise"):
        TrainingSpec(seq_len=16, global_batch_size=8, fp8="e4m3")
