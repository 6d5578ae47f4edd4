"""Layer kinds are registered, not wired in (models/kinds): kinds defined in this file alone, by one registration
each, run everywhere the built-in ones do.

- A token mixer with a recurrent cache (a running mean of a projection: no positions, no KV) trains at tp=2 + SP
  and at pp=2 like one process (loss, every gradient, every parameter), and generates greedily with its own cache
  at tp=2 exactly as one process recomputing the whole context each step; the comparison fails when its cache is
  dropped.
- A hybrid stack whose first layer is that mixer (no KV cache at layer 0: the model counts the decoded tokens
  itself) generates with caches, in one process and at pp=2 (each chunk its own caches), the tokens of the
  cacheless run.
- A channel mixer with state updated after each optimizer step (models/aux.py: what DeepSeek's selection bias
  needs): the trainer calls the hook once per applied step, and full recomputation does not count twice.
"""
import json
import math
from pathlib import Path

import torch
import torch.nn as nn

import tpzoo
from tpzoo.generation import generate
from tpzoo.models import Transformer, get_config, register_channel_mixer, register_config, register_token_mixer
from tpzoo.models.kinds.mlp import MLP
from tpzoo.models.recompute import is_recomputing
from tpzoo.parallel import ColumnParallelLinear, RowParallelLinear, comm
from tpzoo.pipeline import build_model_chunks
from tpzoo.testing import run_on_ranks

from test_3d_parity import check_layout, reference, train_layout


class RunningMeanCache:
    """The state of one layer: the sum of every token's projection so far, [b, 1, d/tp]."""

    def __init__(self):
        self.total = None


@register_token_mixer("running_mean")
class RunningMean(nn.Module):
    """y_t = out(mean_{j <= t} tanh(in(x_j))). TP split: the d channels (in column-, out row-parallel); what
    crosses ranks: the column layer's entry and the row layer's exit; cache: the running sum (RunningMeanCache)."""
    rotary = None

    def __init__(self, cfg, layer, layout):
        super().__init__()
        h = cfg.hidden_size
        init = lambda t: nn.init.normal_(t, std=0.3)  # noqa: E731 - wide: the outputs depend on the context
        self.proj_in = ColumnParallelLinear(h, h, bias=False, init_method=init, **layout.linear)
        self.proj_out = RowParallelLinear(h, h, bias=False, init_method=init, **layout.linear)

    def new_cache(self, batch: int, max_length: int) -> RunningMeanCache:
        return RunningMeanCache()

    def forward(self, x, ctx, cache=None):
        v = torch.tanh(self.proj_in(x))  # [b, s, d/tp]: the whole sequence (gathered under SP)
        total = v.cumsum(dim=1)
        if cache is not None:
            if cache.total is not None:
                total = total + cache.total
            cache.total = total[:, -1:]
        count = torch.arange(ctx.past + 1, ctx.past + v.shape[1] + 1, device=v.device, dtype=v.dtype)
        return self.proj_out(total / count[:, None])

    @staticmethod
    def num_parameters(cfg, layer, active=False):
        return 2 * cfg.hidden_size ** 2

    @staticmethod
    def sequence_flops(cfg, layer, seq_len):
        return 0


TOY = get_config("nano-llama").replace(num_layers=4, token_mixers=["running_mean"] * 4)
HYBRID = get_config("nano-llama").replace(num_layers=4, token_mixers=["running_mean", "attention"] * 2)
PROMPT = torch.randint(0, 97, (2, 5), generator=torch.Generator().manual_seed(3))
NEW = 8


def _toy_worker(cfg, layouts):
    results = [train_layout(cfg, layout, 1) for layout in layouts]
    dims = tpzoo.init_parallel(tp=2)
    try:
        tokens = generate(Transformer(cfg, dims, seed=1), PROMPT, NEW)
    finally:
        tpzoo.destroy_parallel()
    return results, tokens


def test_a_token_mixer_registered_in_a_test_file_trains_and_generates_with_its_cache(monkeypatch):
    assert TOY.num_parameters() == Transformer(TOY).cfg.num_parameters() == sum(
        p.numel() for p in Transformer(TOY).parameters())
    layouts = [dict(tp=2, sp=True), dict(tp=1, pp=2)]
    per_rank = run_on_ranks(2, _toy_worker, TOY, layouts)
    ref = reference(TOY, steps=1)
    for i, layout in enumerate(layouts):
        check_layout(TOY, ref, [r[0][i] for r in per_rank], layout)
    one = Transformer(TOY, seed=1)
    cacheless = generate(one, PROMPT, NEW, use_cache=False)
    assert all(torch.equal(r[1], cacheless) for r in per_rank)  # tp=2, its cache: one process, no cache
    monkeypatch.setattr(RunningMean, "new_cache", lambda self, batch, max_length: None)  # the cache dropped
    assert not torch.equal(generate(one, PROMPT, NEW), cacheless)  # the comparison can fail


def _hybrid_pp2(cfg):
    dims = tpzoo.init_parallel(pp=2)
    try:
        return generate(build_model_chunks(cfg, dims, seed=1), PROMPT, NEW)
    finally:
        tpzoo.destroy_parallel()


def test_a_hybrid_stack_without_kv_at_its_first_layer_generates():
    model = Transformer(HYBRID, seed=1)
    assert [type(layer.attn).__name__ for layer in model.layers.values()] == ["RunningMean", "Attention"] * 2
    cacheless = generate(model, PROMPT, NEW, use_cache=False)
    assert torch.equal(generate(model, PROMPT, NEW), cacheless)
    assert all(torch.equal(t, cacheless) for t in run_on_ranks(2, _hybrid_pp2, HYBRID))  # stage 1 starts with it


# -- a channel mixer with state updated after each optimizer step -----------------------------------------------

@register_channel_mixer("counting_mlp")
class CountingMLP(MLP):
    """The dense MLP, counting the tokens it sees in a step (not again when recomputed) and summing the count
    over the data-parallel ranks after each optimizer step, as a load-balancing bias update would."""
    steps: list = []  # every instance's per-step totals, in call order

    def __init__(self, cfg, layer, layout):
        super().__init__(cfg, layer, layout)
        self.dims, self.seen = layout.dims, 0

    def forward(self, x, ctx=None):
        if not is_recomputing():
            self.seen += x.shape[0] * x.shape[1]
        return super().forward(x, ctx)

    def after_optimizer_step(self):
        total = torch.tensor([float(self.seen)], device=self.dims.device)
        comm.all_reduce(total, self.dims.grad_group)
        CountingMLP.steps.append(int(total))
        self.seen = 0


register_config("nano-counting", get_config("nano-llama").replace(channel_mixers=["counting_mlp", "mlp"]))


def test_the_trainer_updates_step_state_once_per_step_without_recomputation_counting():
    from tpzoo.train import load_config, train

    fixture = Path(__file__).parent / "fixtures" / "pre_kinds"
    cfg = load_config(None, dict(model="nano-counting", data=[str(fixture / "store")], seq_len=16,
                                 global_batch_size=4, micro_batch_size=2, steps=3, recompute="full", tp=1, save="",
                                 sample_prompt="", quiet=True, eval_fraction=0.0, prefetch=1, device="cpu"))
    CountingMLP.steps.clear()
    result = train(cfg)
    assert result["status"] == "ok" and all(math.isfinite(x) for x in result["losses"])
    assert CountingMLP.steps == [4 * 16] * 3  # one layer counts, once per step: every token once
    assert json.dumps(get_config("nano-counting").to_dict())  # the kinds serialize with the config
