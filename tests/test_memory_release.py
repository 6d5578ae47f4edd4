"""A dropped model and optimizer give their memory back at once, without Python's cyclic GC.

On a GPU, a tensor's memory returns to the caching allocator when its last reference goes; objects caught in a
reference cycle wait for the cyclic GC, which runs when Python allocates enough objects, not when the GPU runs
short. A benchmark running several cases in one process measured each earlier case's parameters and main
gradients in a later case's peak that way (docs/benchmarks.md, FP8). Here, with the GC off, two training steps on
2 ranks at several layouts; afterwards nothing of the model, the optimizer or its gradient buffer is alive, and
turning the GC off is what makes the check able to fail (the test shows the GC would collect a planted cycle).
Not covered: full recomputation, whose first checkpointed forward triggers a lazy import inside torch that leaves
its frames (and so that forward's model) in a cycle once; the GC collects it."""
import gc
import weakref

import torch

import tpzoo
from tpzoo.models import get_config
from tpzoo.parallel import GradBuffer
from tpzoo.pipeline import build_model_chunks, finalize_grads, forward_backward
from tpzoo.testing import run_on_ranks
from tpzoo.train.optim import DistributedAdamW

LAYOUTS = {"dp2": {}, "zero1": {"zero": 1}, "zero2": {"zero": 2}, "zero3": {"zero": 3}, "tp2": {"tp": 2},
           "pp2": {"pp": 2}}


def _train_and_drop(layout: dict) -> dict:
    dims = tpzoo.init_parallel(tp=layout.get("tp", 1), pp=layout.get("pp", 1))
    try:
        chunks = build_model_chunks(get_config("nano-llama"), dims, seed=0)
        params = [p for c in chunks for p in c.parameters()]
        opt = DistributedAdamW(params, dims, zero=layout.get("zero", 0), modules=chunks)
        ids = torch.randint(0, 97, (2, 17), generator=torch.Generator().manual_seed(0))
        batch = {"input_ids": ids[:, :-1], "labels": ids[:, 1:]}
        for _ in range(2):
            opt.zero_grad()
            forward_backward(chunks, [batch, batch], dims, loss_scale=0.01)
            finalize_grads(chunks, dims)
            opt.reduce_grads()
            opt.step(1e-3, 1.0)
        refs = {"model": weakref.ref(chunks[0]), "optimizer": weakref.ref(opt), "parameter": weakref.ref(params[0]),
                "gradient buffer": weakref.ref(opt.grads)}
        del chunks, params, opt
        return refs
    finally:
        tpzoo.destroy_parallel()


def _alive_after(layouts: dict) -> dict:
    out = {}
    gc.collect()
    gc.disable()
    try:
        for name, layout in layouts.items():
            out[name] = sorted(k for k, r in _train_and_drop(layout).items() if r() is not None)

        class Cycle:  # the control: with the GC off a cycle outlives its last name; gc.collect() frees it
            pass
        planted = Cycle()
        planted.me = planted
        ref = weakref.ref(planted)
        del planted
        out["control"] = [ref() is not None]
        gc.collect()
        out["control"].append(ref() is not None)
    finally:
        gc.enable()
    return out


def test_dropped_model_and_optimizer_free_their_memory_without_the_cyclic_gc():
    for rank in run_on_ranks(2, _alive_after, LAYOUTS):
        assert rank.pop("control") == [True, False]
        assert rank == {name: [] for name in LAYOUTS}, rank


def test_a_dropped_grad_buffer_leaves_plain_parameters():
    """Parameters hold their GradBuffer weakly: dropped, it takes its hooks and main_grad views with it (the
    gradient is autograd's .grad again), and never those of a buffer that took the parameters over since."""
    w = torch.nn.Parameter(torch.ones(3))
    first = GradBuffer([w], device=torch.device("cpu"))
    (2 * w).sum().backward()
    assert w.grad is None and torch.equal(w.main_grad, torch.full((3,), 2.0))
    del first
    assert not hasattr(w, "main_grad") and not hasattr(w, "_grad_buffer")
    (3 * w).sum().backward()
    assert torch.equal(w.grad, torch.full((3,), 3.0))
    w.grad = None
    old = GradBuffer([w], device=torch.device("cpu"))
    new = GradBuffer([w], device=torch.device("cpu"))
    del old  # its hook goes; the new buffer keeps collecting
    (4 * w).sum().backward()
    assert w.grad is None and torch.equal(new.data[:3], torch.full((3,), 4.0))
    new.remove()
    assert not hasattr(w, "main_grad")
