"""Launch helpers shared by the Triton kernels (no Triton import here): 2-D row views, block sizes, grids; and the
count of launches a piece of code makes (torch.profiler on CPU stands in for a GPU's launch count)."""
from __future__ import annotations

import collections
import contextlib
import functools

import torch

# Largest block (elements) a program holds along a row; longer rows are streamed block by block. Tests lower
# it to exercise the multi-block loops on small shapes.
MAX_BLOCK = 4096
# Elementwise kernels use smaller column blocks so a row splits over several programs.
MAX_ELEMENTWISE_BLOCK = 1024
# Longest row the single-pass kernels (RMSNorm) keep whole in registers; longer rows take the streaming kernels.
MAX_ROW = 16384
# Elements of the [rows, row length] tile one program of the single-pass kernels holds (several short rows).
MAX_TILE = 8192


def next_pow2(n: int) -> int:
    return 1 << max(0, int(n) - 1).bit_length()


def block_size(n: int, cap: int | None = None) -> int:
    cap = MAX_BLOCK if cap is None else min(cap, MAX_BLOCK)
    return max(1, min(next_pow2(n), cap))


def num_warps(block: int) -> int:
    return 16 if block >= 8192 else 8 if block >= 2048 else 4


def as_rows(t: torch.Tensor, n: int) -> torch.Tensor:
    """`t` as [rows, n] with unit column stride: a view when the layout allows it, else a contiguous copy.
    Row strides may be anything (a slice of a wider tensor, a chunk of a fused projection)."""
    rows = t.reshape(-1, n)
    if n > 1 and rows.stride(-1) != 1:
        rows = rows.contiguous()
    return rows


def target_programs(device: torch.device, per_sm: int = 4) -> int:
    """About how many programs keep the device busy (`per_sm` per SM); small on CPU, where the interpreter
    runs programs one after the other."""
    if device.type == "cuda":
        return per_sm * _sm_count(device.index if device.index is not None else torch.cuda.current_device())
    return 4


@functools.lru_cache(maxsize=None)
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def row_groups(rows: int, col_blocks: int, device: torch.device, per_sm: int = 4) -> tuple[int, int]:
    """Split `rows` into groups that one program each walks through: (rows per group, number of groups).
    Kernels that reduce over rows keep one fp32 partial per group, so fewer groups means less scratch."""
    groups = max(1, min(rows, 65535, target_programs(device, per_sm) // max(1, col_blocks)))
    per = -(-rows // groups)
    return per, -(-rows // per)


_recorders: list[list] = []


def run(kernel, grid, *args, **kwargs) -> None:
    """Launch `kernel[grid](*args, **kwargs)`, or only record the call while `recording()` is active (used to
    compile every launched specialization for a GPU target on a machine without one)."""
    if _recorders:
        _recorders[-1].append((kernel, grid, args, kwargs))
        return
    kernel[grid](*args, **kwargs)


class recording:
    """`with recording() as calls:` launches nothing and appends (kernel, grid, args, kwargs) to `calls`."""

    def __enter__(self) -> list:
        self.calls: list = []
        _recorders.append(self.calls)
        return self.calls

    def __exit__(self, *exc) -> None:
        _recorders.remove(self.calls)


# -- counting launches -------------------------------------------------------------------------------------------

# aten ops that launch no kernel (views, allocations; host work only), counted apart as "views"
VIEWS = frozenset({
    "aten::slice", "aten::select", "aten::view", "aten::as_strided", "aten::detach", "aten::detach_", "aten::alias",
    "aten::lift_fresh", "aten::resolve_conj", "aten::resolve_neg", "aten::_unsafe_view", "aten::reshape", "aten::t",
    "aten::transpose", "aten::expand", "aten::unsqueeze", "aten::squeeze", "aten::permute", "aten::split",
    "aten::split_with_sizes", "aten::chunk", "aten::narrow", "aten::unbind", "aten::_reshape_alias", "aten::view_as",
    "aten::empty", "aten::empty_like", "aten::empty_strided", "aten::to", "aten::contiguous", "aten::lift"})
# composite ops that are only a dispatch when nothing needs copying (aten::to of a tensor already in that dtype):
# what they run inside is counted instead
_PASS_THROUGH = frozenset({"aten::to", "aten::contiguous", "aten::reshape"})
LABELS = ("tpzoo::", "triton::")  # record_function labels (as_one_launch): one launch on the GPU each


def as_one_launch(name: str):
    """Label a torch reference that stands for one kernel launch on the GPU (a Triton kernel, torch._scaled_mm):
    count_launches counts the region once, not the ops inside. No cost beyond the label's on the CPU path."""
    from torch.profiler import record_function

    return record_function(name)


def count_launches(fn) -> collections.Counter:
    """The launches fn() makes, as a GPU would see them: top-level aten ops (not nested in another aten op or a
    label), each Triton kernel launched through run() (as triton::<name>; in the interpreter its own tensor work
    on the CPU is not counted), each as_one_launch label once, each collective (c10d::<op>) once; ops that launch
    nothing (views, allocations, an aten::to with nothing to convert) are counted together as "views"."""
    from torch.profiler import ProfilerActivity, profile

    out: collections.Counter = collections.Counter()
    plain = run

    def counted(kernel, grid, *a, **kw):  # labelled: what the interpreter runs on the CPU inside is not counted
        with as_one_launch(f"triton::{getattr(kernel, '__name__', kernel)}"):
            return plain(kernel, grid, *a, **kw)

    globals()["run"] = counted
    try:
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            fn()
    finally:
        globals()["run"] = plain
    for e in prof.events():
        name, parent = e.name, e.cpu_parent
        inside = False
        while parent is not None:  # nested in a counted op or a label: not a launch of its own
            if parent.name.startswith(LABELS) or (parent.name.startswith("aten::")
                                                 and parent.name not in _PASS_THROUGH):
                inside = True
                break
            parent = parent.cpu_parent
        if inside:
            continue
        if name.startswith(LABELS):
            out[name] += 1
        elif name.startswith("aten::"):
            out["views" if name in VIEWS else name] += 1
        elif name.startswith("c10d::"):
            out[name] += 1
    return out


def launches(c: collections.Counter) -> int:
    """The number of launches in a count_launches result (everything but the views)."""
    return sum(v for k, v in c.items() if k != "views")
