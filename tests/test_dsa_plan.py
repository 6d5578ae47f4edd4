"""The plan's costs of the "sparse_mla" kind (tpzoo/plan/kinds/sparse_mla.py) against the built layers: the
parameters of every pipeline stage and tp rank exactly (DeepSeek-V3.2 with an indexer on every layer, GLM-5 with
shared layers that hold none), the generation cache (MLA's latent and rotary key plus the indexer's keys) as the
layers fill it, what training the indexer keeps for the backward, and the published configs plan at every layout the
search proposes."""
import dataclasses

import pytest
import torch
from dsa_models import hf_config
from test_plan_kinds import check_parameters

from tpzoo.models import Inputs, ModelLayout, Transformer, from_hf_config, get_config
from tpzoo.plan import ClusterSpec, RankLayout, TrainingSpec, cache_bytes, cost_of, search


def _cfg(kind):
    return from_hf_config(hf_config(kind).to_dict())


@pytest.mark.parametrize("kind", ["deepseek_v32", "glm_moe_dsa"])
def test_parameters_exact(kind):
    from tpzoo.models.kinds.sparse_mla import SparseLatentAttention

    assert cost_of(SparseLatentAttention).derived == []  # exact costs, none approximated
    check_parameters(_cfg(kind))


def test_generation_cache_is_what_the_layers_keep():
    cfg, at, b, prompt, room = _cfg("glm_moe_dsa"), RankLayout(), 2, 8, 12
    model = Transformer(cfg, ModelLayout(dtype=torch.bfloat16))
    cache = model.new_cache(b, room)
    model(Inputs(torch.randint(0, cfg.vocab_size, (b, prompt))), cache=cache)
    for i, layer in cache.layers.items():  # layer 1 and 3 share layer 0's and 2's top-k: no indexer keys
        held = layer.latent.nbytes + layer.k_rope.nbytes + (layer.index_keys.nbytes if layer.has_keys else 0)
        assert held == cache_bytes(cfg, i, at, b, room) > 0
        assert layer.has_keys == (i % 2 == 0)


@pytest.mark.parametrize("name", ["deepseek-v3.2", "glm-5", "glm-4.7-flash", "mistral-small-4"])
def test_published_configs_plan(name):
    cfg = get_config(name)
    res = search(cfg, ClusterSpec(gpus=8, gpu_memory_gib=80), TrainingSpec(seq_len=2048, global_batch_size=16),
                 max_micro_batch=2, recompute="full")
    assert res, name


def test_trained_indexer_activations_are_what_the_layers_keep():
    """What training the indexer adds to a chunk's saved activations (the KL's target, the indexer's queries, head
    weights and keys; its scores recomputed block by block) is the plan's, within 3%. (Measured against the frozen
    indexer: the MLA part's own estimate is tpzoo/plan/kinds/mla.py's, tested there.)"""
    from test_plan_memory import measure_chunk

    from tpzoo.plan.memory import chunk_activation_bytes

    base = get_config("tiny-deepseek-v3.2")
    got, est = [], []
    for scale in (0.0, 0.5):
        cfg = base.replace(sparse_mla=dataclasses.replace(base.sparse_mla, index_topk=8, indexer_loss_scale=scale))
        got.append(measure_chunk(cfg, "none"))
        est.append(sum(chunk_activation_bytes(cfg, RankLayout(recompute="none", kernels="reference"),
                                              range(cfg.num_layers), 2, 16, True, True).values()))
    assert abs((est[1] - est[0]) / (got[1] - got[0]) - 1) <= 0.03, (est, got)


def test_pipeline_stages_keep_shared_layers_with_their_source():
    """GLM-5's shared layers (F S F S F S here) reuse the selection of the full layer before them in the same
    forward: given boundaries that part them are refused in one line, a balanced split moves the stage's start back
    to the full layer, and one that would empty the stage before is refused."""
    from tpzoo.pipeline import partition_layers
    from tpzoo.pipeline.partition import PartitionError

    cfg = _cfg("glm_moe_dsa")
    six = cfg.replace(num_layers=6, token_mixers=["sparse_mla"] * 6, channel_mixers=["mlp"] + ["moe"] * 5,
                      sparse_mla=dataclasses.replace(cfg.sparse_mla, indexer_types=["full", "shared"] * 3))
    assert [six.reads_layer(i) for i in range(6)] == [0, 0, 2, 2, 4, 4]
    assert partition_layers(six, 2, [0, 2, 6]) == [(0, 2), (2, 6)]
    with pytest.raises(PartitionError, match="layer 3 reuses what layer 2 computes"):
        partition_layers(six, 2, [0, 3, 6])
    # a balanced split of equal layers, the first stage also holding the embedding: 3 | 3, moved to 2 | 4
    assert partition_layers(six, 2, weights=[1.0] * 6, ends=(1.0, 0.0)) == [(0, 2), (2, 6)]
    with pytest.raises(PartitionError, match="layer 1 reuses what layer 0"):
        partition_layers(six, 6)  # one layer per stage
