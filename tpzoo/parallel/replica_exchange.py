"""The outer-gradient exchange across replicas (DiLoCo, tpzoo.train.diloco): start it, compute, wait, get the mean.

Each replica holds an fp32 vector (its outer gradient for one fragment, this rank's part of it); the mean over the
replicas is wanted in fp32 on every replica, identical bit for bit (every replica applies it to the same global
parameters, which must stay equal).

- fp32: an all-reduce (sum), divided by the number of replicas.
- bf16 / fp8: what crosses the link is the vector in the low-precision format, and the sum is taken in fp32. A
  collective cannot sum low-precision values in fp32 (NCCL and gloo sum in the tensor's dtype), so every replica's
  encoded vector is all-gathered and each rank decodes and sums them in fp32 in replica order: the same
  arithmetic, hence the same result, on every replica. With K replicas a rank sends (K - 1) x the encoded vector
  (a ring all-reduce of fp32 sends 2 (K - 1) / K x 4 bytes per element): at K = 2, the usual two clusters, half
  the fp32 bytes with bf16 and about a quarter with fp8.
- fp8: e4m3 with one fp32 scale per block of 128 values (amax / 448, DeepSeek-V3's 1 x 128 tiles), so a block of
  small changes keeps its precision beside a block of large ones: 1 + 4/128 bytes per value.

Asynchronous by contract (tpzoo.parallel.comm): the buffers handed to the collective are this object's own and
untouched until `wait()`; the caller may keep computing (Streaming DiLoCo overlaps the exchange with inner steps)
and must wait every exchange it started, in the same order on every rank of the group.
"""
from __future__ import annotations

import torch

from . import comm, fp8

SYNC_DTYPES = ("fp32", "bf16", "fp8")
BLOCK = 128  # fp8: values per scale


def encoded_bytes(numel: int, dtype: str) -> int:
    """Bytes of one replica's encoded vector of `numel` fp32 values."""
    if dtype == "fp32":
        return 4 * numel
    if dtype == "bf16":
        return 2 * numel
    blocks = -(-numel // BLOCK)
    return blocks * (BLOCK + 4)


def encode(x: torch.Tensor, dtype: str) -> torch.Tensor:
    """fp32 vector -> its bytes in `dtype` (bf16, or fp8 blocks: the scales first, then the e4m3 values)."""
    if dtype == "bf16":
        return x.to(torch.bfloat16).view(torch.uint8)
    blocks = -(-x.numel() // BLOCK)
    padded = torch.zeros(blocks * BLOCK, dtype=torch.float32, device=x.device)
    padded[:x.numel()] = x
    rows = padded.view(blocks, BLOCK)
    values, inv = fp8.cast_rows(rows, fp8.E4M3, pow2=False)  # a scale per block from its own amax; inv [blocks, 1]
    return torch.cat([inv.float().reshape(-1).view(torch.uint8), values.reshape(-1).view(torch.uint8)])


def decode(raw: torch.Tensor, numel: int, dtype: str) -> torch.Tensor:
    """The inverse of encode: fp32 values."""
    if dtype == "bf16":
        return raw.view(torch.bfloat16).float()
    blocks = -(-numel // BLOCK)
    inv = raw[:4 * blocks].view(torch.float32).view(blocks, 1)
    values = raw[4 * blocks:].view(fp8.E4M3).view(blocks, BLOCK).float()
    return (values * inv).reshape(-1)[:numel]


class Exchange:
    """The mean over the replicas (`group`) of fp32 vector `x`, sent in `dtype`; started at construction. `x` is
    the exchange's own from then on (fp32: summed in place)."""

    def __init__(self, x: torch.Tensor, group, dtype: str = "fp32"):
        if dtype not in SYNC_DTYPES:
            raise ValueError(f"sync dtype must be one of {SYNC_DTYPES}, got {dtype!r}")
        self.numel, self.dtype, self.replicas = x.numel(), dtype, comm.group_size(group)
        if dtype == "fp32":
            self.pending = comm.all_reduce_start(x, group)
        else:
            mine = encode(x, dtype)
            out = torch.empty(self.replicas * mine.numel(), dtype=torch.uint8, device=x.device)
            self.pending = comm.all_gather_into_start(out, mine, group)

    def wait(self) -> torch.Tensor:
        """The mean (fp32): waits for the collective."""
        got = self.pending.wait()
        if self.dtype == "fp32":
            return got.div_(self.replicas)
        each = got.view(self.replicas, -1)
        total = decode(each[0], self.numel, self.dtype)
        for k in range(1, self.replicas):  # replica order: the same sum on every replica
            total.add_(decode(each[k], self.numel, self.dtype))
        return total.div_(self.replicas)
