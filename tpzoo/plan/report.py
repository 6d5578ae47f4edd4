"""Render search results: a ranked text table, or JSON for machines."""
from __future__ import annotations

import dataclasses
import json

from tpzoo.models.config import ModelConfig

from .estimate import GIB, Estimate
from .memory import state_bytes_per_param
from .post import frozen_text
from .spec import ClusterSpec, TrainingSpec


def _sched(est: Estimate) -> str:
    lay = est.layout
    if lay.pp == 1:
        return "-"
    cut = "*" if lay.boundaries is not None else ""  # a split other than tpzoo's default (stages() below)
    return (f"interleaved v={lay.virtual_stages}" if lay.schedule == "interleaved" else lay.schedule) + cut


def stages(est: Estimate) -> list[str]:
    """Each pipeline rank's layers, memory and busy time (m micro-batches' F + B + W) of a layout, and the split
    as --pp-boundaries."""
    lay = est.layout
    ranges = est.stage_layers
    lines = [f"pipeline stages of #1 ({'split by time, ' if lay.boundaries is not None else ''}--pp-boundaries "
             f"{','.join(str(a) for a, _ in ranges)},{ranges[-1][1]}):"]
    for s in range(lay.pp):
        layers = " ".join(f"{a}-{b - 1}" if b - a > 1 else str(a) for a, b in ranges[s::lay.pp])
        lines.append(f"  stage {s}: layers {layers}, {est.stage_memory_gib[s]:.1f} GiB, "
                     f"busy {est.stage_busy_s[s]:.3g} s{'  (slowest)' if s == est.slowest_stage else ''}")
    return lines


def header(cfg: ModelConfig, cluster: ClusterSpec, training: TrainingSpec, considered: int, fitting: int,
           ruled_out: int = 0) -> str:
    name = cfg.name or "custom config"
    tokens = training.global_batch_size * training.seq_len
    active = (f", {cfg.num_parameters(active=True) / 1e9:.2f} B active: {cfg.num_experts} experts, top-"
              f"{cfg.num_experts_per_tok}" if cfg.num_experts else "")
    return (f"tpzoo plan: {name} ({cfg.num_parameters() / 1e9:.2f} B parameters{active}) on {cluster.gpus} GPUs "
            f"({cluster.gpus_per_node}/node) of {cluster.gpu_memory_gib:g} GiB, {cluster.gpu_tflops:g} TFLOP/s, "
            f"intra-node {cluster.intra_node_gbps:g} GB/s, inter-node {cluster.inter_node_gbps:g} GB/s\n"
            f"seq {training.seq_len}, global batch {training.global_batch_size} ({tokens:,} tokens/step), "
            f"{training.dtype}, {f'ZeRO-{training.zero_level}' if training.zero_level else 'ZeRO off'}"
            f"{'' if training.overlap_grad_reduce else ', DP reduction not overlapped'} "
            f"({_state_text(training)}), {training.kernels} kernels"
            f"{' (blocks compiled)' if training.compile else ''}, "
            f"{'fused' if training.fused_linear_cross_entropy else 'unfused'} head and loss, "
            f"{f'FP8 {training.fp8} projections, ' if training.fp8 != 'none' else ''}"
            f"{frozen_text(training)[2:] + ', ' if training.frozen else ''}"
            f"efficiency {cluster.efficiency:g}, reserve {cluster.reserve_gib:g} GiB; "
            f"{considered} layouts, {fitting} fit"
            + (f" ({ruled_out:,} ruled out by their memory floor, not estimated)" if ruled_out else ""))


def _state_text(training: TrainingSpec) -> str:
    if training.optimizer == "muon":  # per-parameter figures are AdamW's; Muon's matrices keep 4 bytes less
        return (f"Muon ({training.muon_ns_steps} Newton-Schulz steps) for the hidden layers' matrices: 4 B/param "
                f"less optimizer state than AdamW's {state_bytes_per_param(training)}")
    if training.lora_rank:
        base = ({"fp8": "block FP8 (1 B/param + scales)", "int4": "int4 (0.5 B/param + scales)"}[training.base_dtype]
                + f" projections and experts, the rest {training.act_bytes} B/param" if training.base_dtype
                else f"{training.act_bytes} B/param")
        where = "every linear layer and routed expert" if training.lora_experts else "every linear layer"
        return f"LoRA rank {training.lora_rank} on {where}: frozen base {base}, adapters " \
               f"{state_bytes_per_param(training)}"
    return f"training state {state_bytes_per_param(training)}"


_COLS = ("#", "tp", "pp", "dp", "mbs", "m", "recompute", "sp", "schedule", "params", "grads", "optim",
         "acts", "total", "step s", "tokens/s", "MFU", "bubble", "comm")


def _row(rank: int, est: Estimate, with_cp: bool = False, with_ep: bool = False) -> list[str]:
    lay, mem, tb = est.layout, est.memory, est.time
    g = lambda b: f"{b / GIB:.1f}"  # noqa: E731
    comm = tb.tp_comm + tb.cp_comm + tb.ep_comm + tb.pp_comm + tb.dp_comm
    return [str(rank), str(lay.tp)] + ([str(lay.cp)] if with_cp else []) + [
            str(lay.pp), str(lay.dp)] + ([str(lay.ep)] if with_ep else []) + [
            str(lay.micro_batch_size), str(est.micro_batches),
            lay.recompute, "on" if lay.sequence_parallel else "off", _sched(est), g(mem.params), g(mem.grads),
            g(mem.master + mem.optimizer), g(mem.activations), g(mem.total), f"{tb.total:.2f}",
            f"{est.tokens_per_s:,.0f}", f"{100 * est.mfu:.1f}%", f"{100 * tb.bubble / tb.total:.0f}%",
            f"{100 * comm / tb.total:.0f}%"]


def table(estimates: list[Estimate], top: int = 10, rejected: int = 5, with_stages: bool = False) -> str:
    fitting = [e for e in estimates if e.fits][:top]
    with_cp = any(e.layout.cp > 1 for e in estimates)  # the cp column only when the search tried cp
    with_ep = any(e.layout.ep > 1 for e in estimates)  # the ep column only for experts split over ep
    cols = _COLS[:2] + ("cp",) + _COLS[2:] if with_cp else _COLS
    if with_ep:
        cols = cols[:cols.index("dp") + 1] + ("ep",) + cols[cols.index("dp") + 1:]
    rows = [list(cols)] + [_row(i + 1, e, with_cp, with_ep) for i, e in enumerate(fitting)]
    widths = [max(len(r[c]) for r in rows) for c in range(len(cols))]
    left = {"recompute", "schedule", "sp"}
    lines = ["  ".join(cell.ljust(w) if cols[c] in left else cell.rjust(w)
                       for c, (cell, w) in enumerate(zip(r, widths))) for r in rows]
    if not fitting:
        lines.append("(no layout fits: see the rejected ones below, and the line after them)")
    lines.append("memory in GiB per GPU on the fullest pipeline stage; total = params + grads + optim (fp32 master"
                 " + AdamW) + acts + backward working set + reserve")
    if any(e.layout.boundaries is not None for e in fitting):
        lines.append("*: pipeline stages split by time (tpzoo.plan.balance), not tpzoo's default split by parameters:"
                     " train with its --pp-boundaries")
    if fitting and fitting[0].layout.pp > 1 and (with_stages or fitting[0].layout.boundaries is not None):
        lines.extend(stages(fitting[0]))
    others = rejected_summary(estimates)[:rejected]
    if others:
        lines.append("")
        dims = f"tp, {'cp, ' if with_cp else ''}pp, dp{', ep' if with_ep else ''}"
        lines.append(f"({dims}) with no variant that fits, fastest first (the variant "
                     f"needing the least memory):")
        for e in others:
            lines.append(f"  {e.layout.label()}: {e.reason}")
    return "\n".join(lines)


def rejected_summary(estimates: list[Estimate]) -> list[Estimate]:
    """For each (tp, pp, dp) none of whose variants fits, its variant needing the least memory (it says
    why even full recompute and a micro-batch of one are not enough), in order of estimated speed."""
    fitting = {(e.layout.tp, e.layout.cp, e.layout.pp, e.layout.dp, e.layout.ep) for e in estimates if e.fits}
    best: dict[tuple, Estimate] = {}
    for e in estimates:
        key = (e.layout.tp, e.layout.cp, e.layout.pp, e.layout.dp, e.layout.ep)
        if key not in fitting and (key not in best or e.memory.total < best[key].memory.total):
            best[key] = e
    return sorted(best.values(), key=lambda e: e.time.total)


def to_json(cfg: ModelConfig, cluster: ClusterSpec, training: TrainingSpec, estimates: list[Estimate],
            top: int = 10, rejected: int = 5) -> str:
    return json.dumps({
        "model": cfg.name or "custom", "num_parameters": cfg.num_parameters(),
        **({"active_parameters": cfg.num_parameters(active=True)} if cfg.num_experts else {}),
        "cluster": dataclasses.asdict(cluster), "training": dataclasses.asdict(training),
        "layouts_considered": getattr(estimates, "considered", len(estimates)),
        "layouts_fitting": sum(e.fits for e in estimates),
        "recommended": [e.to_dict() for e in estimates if e.fits][:top],
        "rejected": [e.to_dict() for e in rejected_summary(estimates)][:rejected],
    }, indent=2)
