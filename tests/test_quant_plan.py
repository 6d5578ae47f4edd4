"""`tpzoo plan --lora-rank R --base-dtype fp8|int4`: the frozen base's bytes are what a kept-quantized checkpoint
loaded for LoRA holds (its quantized weights with their scales, the rest in the model dtype), at tp 1 and on each rank
at tp 2; a tp that would cut a block is no layout; at the scale of a 32B model the FP8 base holds about half of the
bf16 one's weight bytes and int4 about a third (the embeddings and head stay bf16)."""
from __future__ import annotations

import pytest
import torch
from quant_models import write_fp8

from tpzoo.checkpoint import convert_from_hf, load_model
from tpzoo.models import get_config
from tpzoo.models.lora import LoRAConfig, add_lora
from tpzoo.parallel.dims import ParallelDims, ParallelLayoutError
from tpzoo.plan import ClusterSpec, Layout, TrainingSpec, search, stage_memory
from tpzoo.plan.spec import check_layout


def test_plan_counts_the_bytes_of_a_kept_fp8_base(tmp_path):
    write_fp8("qwen3", tmp_path / "hf")
    convert_from_hf(tmp_path / "hf", tmp_path / "kept", keep_quantized=True, dtype="bf16", progress=False)
    training = TrainingSpec(seq_len=16, global_batch_size=2, lora_rank=4, base_dtype="fp8")
    for tp in (1, 2):
        model = load_model(tmp_path / "kept", ParallelDims.for_rank(tp=tp, device="cpu"), device="cpu")
        add_lora([model], LoRAConfig(rank=4, alpha=8))
        frozen = sum(p.numel() * p.element_size() for p in model.parameters() if not p.requires_grad)
        adapters = sum(p.numel() for p in model.parameters() if p.requires_grad)
        est = stage_memory(model.cfg.replace(quantization=None), Layout(tp=tp, dp=1), training, 0)
        assert est.params == frozen + 2 * adapters, (tp, est.params, frozen, adapters)
        assert {p.dtype for n, p in model.named_parameters() if n.endswith("qkv.weight")} == {torch.float8_e4m3fn}


def test_a_tp_cutting_blocks_is_no_layout_and_the_base_shrinks():
    cfg, cluster = get_config("qwen3-32b"), ClusterSpec(gpus=8, gpu_memory_gib=80)
    tiny = get_config("tiny-llama")  # hidden 128: tp 2 cuts the rows of its 2 kv heads of 32 (64 < 128)
    with pytest.raises(ParallelLayoutError, match="would cut its fp8_block blocks"):
        check_layout(tiny, Layout(tp=2, dp=4), cluster, TrainingSpec(seq_len=64, global_batch_size=8, lora_rank=4,
                                                                    base_dtype="fp8"))
    params = {}
    for base in (None, "fp8", "int4"):
        training = TrainingSpec(seq_len=4096, global_batch_size=64, lora_rank=16, base_dtype=base)
        params[base] = stage_memory(cfg, Layout(tp=8, dp=1, micro_batch_size=1), training, 0).params
    assert 0.45 < params["fp8"] / params[None] < 0.55 and 0.25 < params["int4"] / params[None] < 0.35, params
    with pytest.raises(ValueError, match="--lora-rank"):
        TrainingSpec(seq_len=64, global_batch_size=8, base_dtype="fp8")
    assert search(cfg, cluster, TrainingSpec(seq_len=4096, global_batch_size=64, lora_rank=16, base_dtype="fp8"),
                  tp=8)
