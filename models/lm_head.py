"""The output layer of the last pipeline stage: a column-parallel linear layer over the (padded) vocabulary that
returns the logits shard, or with labels the per-token loss.

With labels and `fused` (the default; LossOptions.fused) the matmul and the vocab-parallel cross-entropy run
together in chunks of tokens (tpzoo.kernels.fused_linear_cross_entropy): the logits of all the tokens never
exist, in the forward or in the backward. `fused=False` is the former path, logits then tpzoo.kernels.cross_entropy; both give the same
loss and gradients. The loss is computed through this module's forward (not beside it), so whatever hooks the
module (ZeRO-3 gathering its weight) sees the head used.

Generation needs one position's logits: `position=` computes only those (after the sequence is gathered under
sequence parallelism), not [b, s, V'/tp].
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from tpzoo import kernels
from tpzoo.parallel import ColumnParallelLinear
from tpzoo.parallel.mappings import copy_to_tp, gather_from_sequence


class LMHead(ColumnParallelLinear):
    """ColumnParallelLinear(hidden, padded vocab, bias=False) plus the loss. `vocab_size`: the real vocabulary
    (padded entries never enter the softmax); `softcap`: Gemma 2's final logit soft-capping (cap * tanh(z /
    cap), elementwise on each vocab shard); `chunk_rows`: the fused linear cross-entropy's tokens per chunk (None: tpzoo.kernels.fused_linear_cross_entropy.default_chunk_rows).
    The head stays in the model dtype under --fp8 (fp8_kind None), as Transformer Engine's and torchao's recipes
    keep it: the logits' precision drives the loss."""
    fp8_kind = None

    def __init__(self, hidden_size: int, vocab_padded: int, vocab_size: int, *, softcap: float | None = None,
                 chunk_rows: int | None = None, **kw):
        super().__init__(hidden_size, vocab_padded, bias=False, **kw)
        self.vocab_size, self.softcap, self.chunk_rows = vocab_size, softcap, chunk_rows

    def forward(self, x: torch.Tensor, labels: torch.Tensor | None = None, *, label_smoothing: float = 0.0,
                z_loss: float = 0.0, position: int | None = None, fused: bool = True) -> torch.Tensor:
        """x: [b, s, h] (this rank's sequence shard under SP). Without labels the logits shard [b, s, V'/tp]
        ([b, 1, V'/tp] at `position` only); with labels [b, s] the per-token loss (0 where ignored), through the
        fused linear cross-entropy unless `fused` is False (or adapters are attached)."""
        group = self.dims.tp_group
        if labels is None:
            if position is None:
                return self._capped(super().forward(x))
            # the TP region's entry as the column layer's (gathered under SP), then only that position
            x = gather_from_sequence(x, self.sequence_dim, group) if self.sequence_parallel else copy_to_tp(x, group)
            x = x.narrow(self.sequence_dim, position % x.shape[self.sequence_dim], 1)
            return self._capped(F.linear(x, self.weight))
        if fused and self.lora is None:
            return kernels.linear_cross_entropy(
                x, self.weight, labels, label_smoothing=label_smoothing, z_loss=z_loss, softcap=self.softcap,
                vocab_size=self.vocab_size, group=group,
                sequence_dim=self.sequence_dim if self.sequence_parallel else None, chunk_rows=self.chunk_rows)
        return kernels.cross_entropy(self._capped(super().forward(x)), labels, label_smoothing=label_smoothing,
                                     vocab_size=self.vocab_size, group=group, z_loss=z_loss)

    def _capped(self, logits: torch.Tensor) -> torch.Tensor:
        if self.softcap is None:
            return logits
        return torch.tanh(logits / self.softcap) * self.softcap  # elementwise: each vocab shard caps its own

