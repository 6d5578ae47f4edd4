"""Launch helpers shared by the Triton kernels (no Triton import here): 2-D row views, block sizes, grids."""
from __future__ import annotations

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
