"""Shared by the post-training tests (DPO, distillation): tiny HF models, their gradients in tpzoo's names, and the
worker that runs an objective's pass at one layout and returns its loss and full gradients."""
from __future__ import annotations

import torch

import tpzoo
from tpzoo.checkpoint import load_model
from tpzoo.data import collate_long
from tpzoo.models import ModelLayout
from tpzoo.parallel import GradBuffer, comm
from tpzoo.parallel.context_parallel import shard_batch
from tpzoo.pipeline import as_chunks, finalize_grads

import test_3d_parity as p3
from hf_models import save_hf_model

MICRO = 2  # rows per micro-batch


def cli_on_rank(argv: list) -> tuple[int, str]:
    """`tpzoo ARGS` on this pooled rank, as under torchrun (RANK and WORLD_SIZE are set): (exit status, stdout)."""
    import contextlib
    import io

    from tpzoo.cli import main

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        rc = main([str(a) for a in argv])
    return rc, out.getvalue()


def hf_pair(kind: str, root, noise: float = 0.05):
    """(policy dir, other dir): the tiny HF `kind` model and a copy with its weights moved by seeded noise."""
    from transformers import AutoModelForCausalLM

    policy, other = root / "policy", root / "other"
    save_hf_model(kind, policy)
    model = AutoModelForCausalLM.from_pretrained(policy, dtype=torch.float32)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g) * noise)
    model.save_pretrained(other)
    return policy, other


def hf_model(path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float64).eval()


def grads_in_tpzoo_names(hf, tmp) -> dict:
    """The gradients of an HF model's parameters, named and laid out as tpzoo's full parameters: written as the
    weights of an HF checkpoint and read back by tpzoo's own HF import (a linear re-layout: fused q|k|v, ...)."""
    with torch.no_grad():
        for p in hf.parameters():
            p.copy_(p.grad)
    hf.save_pretrained(tmp)
    model = load_model(str(tmp), ModelLayout(dtype=torch.float64))
    return {n: p3._full(n, p.detach(), model.cfg) for n, p in model.named_parameters()}


def rank_batches(dataset, dims, sp: bool, keys=None) -> list[dict]:
    """This dp rank's equal share of `dataset`'s rows in micro-batches of MICRO, each this rank's cp share."""
    n = len(dataset) // dims.dp
    rows = [dataset[i] for i in range(dims.dp_rank * n, (dims.dp_rank + 1) * n)]
    out = []
    for i in range(0, n, MICRO):
        b = collate_long(rows[i:i + MICRO])
        out.append({k: v.to(dims.device) for k, v in shard_batch(b, dims, sp).items()})
    return out


def at_layout(layout: dict, run) -> list[dict]:
    """`run(dims, layout)` -> [result dict, ...] with the process groups of `layout` (tp, pp, dp, cp, sp)."""
    dims = tpzoo.init_parallel(tp=layout.get("tp", 1), pp=layout.get("pp", 1), dp=layout.get("dp", 1),
                               cp=layout.get("cp", 1))
    try:
        return run(dims, layout)
    finally:
        tpzoo.destroy_parallel()


def load(path, dims, layout: dict, frozen: bool = False) -> list:
    chunks = as_chunks(load_model(str(path), ModelLayout(dims, sequence_parallel=layout.get("sp", False),
                                                         dtype=torch.float64), virtual_stages=layout.get("v", 1)))
    if frozen:
        for c in chunks:
            c.requires_grad_(False)
    return chunks


def backward_and_gather(chunks, dims, step, main_grads: bool = True) -> tuple[float, dict]:
    """Run `step()` (a pass that backpropagates; returns this rank's loss share), then the TP and DP reductions:
    with fp32 main gradients (the trainer's GradBuffer), or (main_grads=False) on the models' own float64
    gradients; (loss summed over dp x cp, full gradients of this rank's chunks)."""
    params = list({id(p): p for c in chunks for p in c.parameters() if p.requires_grad}.values())
    buffer = GradBuffer(params, device=dims.device) if main_grads else None
    loss = step()
    finalize_grads(chunks, dims)
    if buffer is not None:
        buffer.reduce(dims.grad_group)
        for p in params:
            p.grad = p.main_grad.to(p.dtype)
    else:
        for p in params:
            comm.all_reduce(p.grad, dims.grad_group)
    total = torch.tensor([loss], dtype=torch.float64, device=dims.device)
    comm.all_reduce(total, dims.grad_group)
    return float(total), p3._gathered(chunks, chunks[0].cfg, grad=True)


def assert_grads(results: list[dict], want: dict, what: str, rtol: float = p3.RTOL) -> None:
    """Every gradient some rank holds equals `want`'s (rtol of the tensor's largest entry); every one is held."""
    seen = set()
    for r in results:
        for name, g in r["grads"].items():
            torch.testing.assert_close(g.double(), want[name], rtol=rtol, atol=rtol * float(want[name].abs().max()),
                                       msg=lambda m, name=name: f"{what} rank {r['rank']}: grad {name}: {m}")
            seen.add(name)
    assert seen == set(want), f"{what}: no rank holds {sorted(set(want) - seen)}"
