"""Parallel plan advisor: memory and step-time estimates of tpzoo training layouts, and a search over them.

    from tpzoo.models import get_config
    from tpzoo.plan import ClusterSpec, Layout, TrainingSpec, estimate, search
    cfg = get_config("llama-3-8b")
    cluster = ClusterSpec(gpus=8, gpu_memory_gib=80)
    training = TrainingSpec(seq_len=8192, global_batch_size=128)
    best = search(cfg, cluster, training)[0]          # Estimate: .layout, .memory, .time, .tokens_per_s, .mfu
    one = estimate(cfg, Layout(tp=8, dp=1, recompute="full"), cluster, training)

The memory model is derived from what tpzoo's code allocates and saves, and tested against it on CPU
(tests/test_plan_*.py); the model, its assumptions and where it departs from Korthikanti et al. 2022 are in
docs/plan.md. `tpzoo plan` is the command line.
"""
from . import kinds  # noqa: F401 (the built-in kinds' costs register themselves)
from .costs import Acts, Collective, Matmul, Weights, cost_of, register_cost
from .estimate import Estimate, TimeBreakdown, estimate, stage_flops
from .head import local_vocab
from .layers import cache_bytes, layer_cost, layer_flops
from .memory import (MemoryBreakdown, ParamCount, StateBytes, chunk_activation_bytes, layer_activation_bytes,
                     layer_params, output_grad_bytes, stage_memory, stage_params, state_bytes)
from .schedule import bubble_time, held_states, peak_bytes, peak_micro_batches
from .search import enumerate_layouts, search
from .spec import (DTYPE_BYTES, ClusterSpec, Layout, RankLayout, TrainingSpec, check_layout, chunk_layer_ranges,
                   num_micro_batches, stage_chunks, stage_layers)
from .volume import VolumeTable, layer_volume, tp_step_volume

__all__ = [name for name in dir() if not name.startswith("_")]
