"""finalize_grads: the gradient reductions between forward_backward and the optimizer (clipping included).

All three are sums, so their order does not change the result:
  1. tensor parallel: replicated parameters that only saw this rank's sequence chunk (norms, row biases under
     SP) and kv heads replicated over TP ranks get the sum over their copies (`finish_tp_grads`);
  2. tied embeddings split over the pipeline: the first stage's embedding and the last stage's head are one
     parameter of the model, stored twice; each copy gets the sum of both gradients, so they stay equal;
  3. data parallel: sum over replicas (bucketed, fp32).
"""
from __future__ import annotations

import torch

from tpzoo.parallel import comm, finish_tp_grads
from tpzoo.parallel.data_parallel import DEFAULT_BUCKET_MB, allreduce_gradients
from tpzoo.parallel.state import get_embedding_group, get_pp_size


def _tied_copy(chunks):
    """This rank's copy of a tied embedding that lives on two pipeline stages (or None)."""
    for chunk in chunks:
        if not chunk.cfg.tie_embeddings:
            return None
        if chunk.pre_process:
            return chunk.embed.weight
        if chunk.post_process:
            return chunk.lm_head.weight
    return None


def sum_tied_embedding_grads(chunks) -> None:
    if get_pp_size() == 1:
        return  # embedding and head are the same Parameter on this rank
    weight = _tied_copy(chunks)
    if weight is None:
        return
    if weight.grad is None:  # the other copy may have a gradient: join the sum with zeros
        weight.grad = torch.zeros_like(weight)
    comm.all_reduce(weight.grad, get_embedding_group())


def finalize_grads(chunks, *, dp_reduce: bool = True, bucket_mb: float = DEFAULT_BUCKET_MB) -> None:
    """TP reductions, tied-embedding sum over the first and last pipeline stage, then (dp_reduce) the
    data-parallel all-reduce SUM in ~bucket_mb fp32 buckets."""
    for chunk in chunks:
        finish_tp_grads(chunk)
    sum_tied_embedding_grads(chunks)
    if dp_reduce:
        allreduce_gradients([p for chunk in chunks for p in chunk.parameters()], bucket_mb=bucket_mb)
