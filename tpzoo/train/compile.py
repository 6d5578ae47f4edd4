"""Regional torch.compile (`--compile`): each transformer block compiled on its own, as torchtitan does.

Every entry of each model chunk's `layers` container is compiled in place (nn.Module.compile: the module, its
parameter names, state dict and hooks stay as they are, so checkpoints, LoRA, FP8 and the optimizer see the same
model). Blocks of one shape share one compiled graph (Dynamo treats the parameters as inputs), so a model compiles
about one block's forward and backward, not the whole network: the first step pays it, once. What is not in a
block (embedding, final norm, the fused head and loss) stays eager: the fused linear cross-entropy is already
one kernel per chunk of tokens.

What the compiled regions hold and where they break (graph breaks are the seams between compiled pieces; each
costs a return to Python, not correctness):
  - the tensor-parallel collectives (tpzoo.parallel.comm: every collective and Pending.wait is excluded from
    compilation, tpzoo.parallel.eager): one break per collective, so a block at tp > 1 is compiled in pieces
    between its gathers, reduce-scatters and all-reduces. Tracing them is not possible as they run: Dynamo has no
    rule for asynchronous collectives, and tpzoo's must keep the asynchronous contract (ARCHITECTURE.md).
  - an FP8 projection (tpzoo.parallel.fp8.linear, the sequence-parallel column matmul): excluded, it runs its own
    fused cast kernels and torch._scaled_mm eagerly (its weight cache is Python state a graph cannot hold).
  - a mixture of experts' dispatch and expert compute (the rows per expert are data: a graph would recompile for
    every count), its step's load count and the router statistics' record (Python state across calls).
  - everything else (norms, rotary, attention, activations, residual adds, LoRA's adapters, selective
    recomputation's checkpointed core, the linear layers, which take the native matmul inside a compiled block:
    tpzoo.parallel.wgrad.fusable) is traced;
    inside a compiled region the kernels dispatch takes the torch references (tpzoo.kernels.dispatch), from which
    inductor generates its own fused kernels.
Full recomputation wraps each compiled block in torch.utils.checkpoint (the recomputed forward is the compiled
one). Pipeline stages compile their own chunks' blocks. ZeRO-3's per-layer gathers (hooks on the blocks) are not
composed with compilation: refused with one line (train.config).

A break inside a called function resumes tracing in its caller (torch._dynamo.config.nested_graph_breaks), so
no function on the way down is compiled as a frame of its own, once per shape; a block recompiles only for a block
of another kind (docs/training.md lists the breaks per kind).
compile_report() gives the one line the trainer prints after the first step: blocks compiled, the compile time
torch measured, graphs, the graph breaks with their reasons and the recompiles with their guards.
"""
from __future__ import annotations

import collections
import re

import torch
import torch.nn as nn


def compile_blocks(chunks) -> int:
    """Compile every entry of each chunk's `layers` container (ModuleDict or ModuleList) in place; returns how
    many. Anything else in the chunks stays eager."""
    from tpzoo.parallel import eager

    eager.enable()  # the collectives, FP8 projections and MoE's expert dispatch: graph breaks, run as written
    # A break inside a called function (a collective inside a TP layer inside the mixer) resumes in that function's
    # caller, tracing on: without it Dynamo compiles each function on the way down as a frame of its own, shared
    # by every call site (a ColumnParallelLinear.forward or einops' rearrange of every shape), which recompiles
    # per shape until torch's recompile limit sends the block back to eager (issue 48).
    import torch._dynamo

    torch._dynamo.config.nested_graph_breaks = True
    n = 0
    for chunk in chunks:
        layers = getattr(chunk, "layers", None)
        if isinstance(layers, nn.ModuleDict):
            blocks = list(layers.values())
        elif isinstance(layers, (nn.ModuleList, nn.Sequential)):
            blocks = list(layers)
        else:
            continue
        for block in blocks:
            recomputed = block.__dict__.get("forward")  # models.recompute's wrapper (full recomputation)
            if hasattr(recomputed, "compile"):
                recomputed.compile()  # inside the checkpoint
            else:
                block.compile()
            n += 1
    return n


def compile_seconds() -> float:
    """Seconds torch spent compiling in this process so far (Dynamo's frames with inductor's forward graphs, and
    the backward graphs compiled at their first use)."""
    from torch._dynamo.utils import compilation_time_metrics

    keys = [k for k in compilation_time_metrics if k == "_compile.compile_inner" or "bw_compiler" in k]
    return sum(sum(compilation_time_metrics[k]) for k in keys)


def graph_breaks() -> collections.Counter:
    """Graph breaks torch met while tracing so far (each trace of a graph counts its breaks once), by the function
    called where it broke ("eager: <name>" for the ones excluded on purpose), else by the reason's first line."""
    from torch._dynamo.utils import counters

    out: collections.Counter = collections.Counter()
    for reason, n in counters["graph_break"].items():
        text = str(reason)
        called = re.search(r"<function (\S+) at 0x", text)
        if "torch.compiler.disable" in text and called:
            out[f"eager: {called.group(1)}"] += n
        else:
            out[text.strip().splitlines()[0]] += n
    return out


def recompiles() -> collections.Counter:
    """Recompilations so far, by the guard that failed (its first line; an object's id dropped). A block of
    another kind (an MLA block beside a Gated DeltaNet one, a dense MLP beside a mixture of experts) fails
    `___check_type_id(self._modules['attn'|'mlp'])`: one graph per block kind, as meant. Any other guard is on
    something a block's graph should not depend on (a shape per call site, Python state across calls)."""
    from torch._dynamo.utils import guard_failures

    out: collections.Counter = collections.Counter()
    for reasons in guard_failures.values():
        for reason in reasons:
            line = re.sub(r"^\d+/\d+: ", "", str(reason).strip().splitlines()[0])
            out[re.sub(r"(___check_type_id\([^,]+), \d+\).*", r"\1)", line).strip()] += 1
    return out


def compile_report(blocks: int, first_step_s: float) -> str:
    """One line: what was compiled, the compile time, the graphs, their breaks and recompilations (counted)."""
    from torch._dynamo.utils import counters

    breaks, again = graph_breaks(), recompiles()
    text = (f"compile: {blocks} transformer blocks compiled regionally (torch.compile); the first step took "
            f"{first_step_s:.1f} s, {compile_seconds():.1f} s of it compiling; "
            f"{counters['stats']['unique_graphs']} graphs, {sum(breaks.values())} graph breaks")
    if breaks:
        text += " (" + "; ".join(f"{reason} x{n}" for reason, n in breaks.most_common(4)) + ")"
    if again:
        text += f", {sum(again.values())} recompiles (" + "; ".join(f"{r} x{n}" for r, n in again.most_common(2)) + ")"
    return text


def eager():
    """A context in which compiled blocks run eagerly (generation: a KV cache that grows every token would
    recompile)."""
    return torch.compiler.set_stance("force_eager")
