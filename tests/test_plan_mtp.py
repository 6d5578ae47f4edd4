"""`tpzoo plan` and the pipeline partitioner cost multi-token prediction's depths on the last stage (models/mtp.py):

- parameters: exactly the built model's per (tp, pp, stage, tp rank), tied and untied (the last stage's copy of the
  embedding when pp > 1, kept in sync over the embedding group);
- activations: the last stage's forward keeps what the estimate says (tp 1, measured on live storages) within 2%;
- the estimate's FLOPs and memory of the last stage grow with the depths, and the partitioner gives the last stage
  fewer layers for them.
"""
import pytest
import torch

from plan_kinds import mla_model
from test_plan_kinds import check_parameters
from tpzoo.models import LossOptions, ModelLayout, Stage, Transformer
from tpzoo.models.config import MTPConfig
from tpzoo.pipeline import partition_layers
from tpzoo.plan import Layout, RankLayout, TrainingSpec, chunk_activation_bytes, stage_params
from tpzoo.plan.estimate import stage_flops
from tpzoo.plan.measure import forward_activation_bytes
from tpzoo.plan.memory import stage_memory


def _model(tied: bool, layers: int = 2):
    return mla_model(layers=layers, tie_embeddings=tied).replace(mtp=MTPConfig(2))


@pytest.mark.parametrize("tied", [False, True])
def test_parameters_exact(tied):
    cfg = _model(tied)
    check_parameters(cfg)  # per (tp, pp, stage, tp rank), and the config's own count
    assert stage_params(cfg, Layout(tp=2, pp=2), 1).embedding > 0  # the last stage's copy, kept in sync


def test_last_stage_activations_are_the_estimate():
    cfg = _model(False)
    b, s = 2, 64
    torch.manual_seed(0)
    chunk = Transformer(cfg, ModelLayout(dtype=torch.bfloat16), Stage(None, False, True))
    got = forward_activation_bytes(chunk, b, s, loss=LossOptions(mtp=0.1))
    at = RankLayout(kernels="reference")
    parts = chunk_activation_bytes(cfg, at, range(cfg.num_layers), b, s, False, True)
    want = sum(parts.values())
    without = forward_activation_bytes(chunk, b, s)
    assert parts["mtp"] > 0 and got > without
    assert abs(got - want) <= 0.02 * got, (got, want, parts)


def test_the_last_stage_costs_more_and_gets_fewer_layers():
    plain, cfg = mla_model(layers=8), mla_model(layers=8).replace(mtp=MTPConfig(1))
    training = TrainingSpec(global_batch_size=4, seq_len=64)
    layout = Layout(pp=2, micro_batch_size=1, boundaries=(0, 4, 8))  # the same layers on each stage
    for s in (0, 1):
        grows = s == 1
        flops = [stage_flops(c, layout, training, s)["forward"] for c in (cfg, plain)]
        assert (flops[0] > flops[1]) == grows, (s, flops)
        assert (stage_memory(cfg, layout, training, s).total > stage_memory(plain, layout, training, s).total) == grows
    last = lambda c: (lambda r: r[-1][1] - r[-1][0])(partition_layers(c, 2))  # noqa: E731
    assert last(cfg) < last(plain)
