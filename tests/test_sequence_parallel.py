"""Sequence parallelism end to end: what travels between pipeline stages, what the TP collectives of a layer
cost, what a layer keeps for its backward (every term divided by tp, as in Korthikanti et al.), the replicated
parameters that must stay identical on every TP rank, and the sequence-length check."""
import contextlib

import pytest
import torch

import tpzoo
from tpzoo.models import get_config
from tpzoo.parallel import count_collectives, get_pp_rank, get_tp_rank
from tpzoo.parallel.column_linear import keep_gathered_inputs
from tpzoo.plan import RankLayout, layer_activation_bytes
from tpzoo.plan.measure import forward_activation_bytes, tp_layer_collectives
from tpzoo.pipeline import build_model_chunks, finalize_grads, forward_backward, sum_tied_grads
from tpzoo.testing import run_on_ranks

GPT8 = get_config("nano-gpt").replace(num_layers=8)
B, S = 2, 8


def _microbatches(cfg, m, seq=S, seed=0):
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(m):
        ids = torch.randint(0, cfg.vocab_size, (B, seq), generator=g)
        out.append({"input_ids": ids, "labels": torch.roll(ids, -1, dims=1)})
    return out


# -- stage-to-stage activations ---------------------------------------------------------------------------------
def _pipeline_messages(sp: bool, m: int = 3):
    tpzoo.init_parallel(tp=2, pp=2)
    try:
        chunks = build_model_chunks(GPT8, sequence_parallel=sp)
        with count_collectives() as c:
            forward_backward(chunks, _microbatches(GPT8, m), loss_scale=0.01)
        send, recv = c.get("send", "pp"), c.get("recv", "pp")
        return get_pp_rank(), (send.calls, send.elements), (recv.calls, recv.elements)
    finally:
        tpzoo.destroy_parallel()


@pytest.mark.parametrize("sp", [False, True])
def test_stages_exchange_sequence_sharded_activations(sp):
    m, h = 3, GPT8.hidden_size
    per_message = B * (S // 2 if sp else S) * h  # [b, s/tp, h] under SP: half the bytes between stages
    for pp_rank, send, recv in run_on_ranks(4, _pipeline_messages, sp, m):
        # stage 0 sends m activations and receives m gradients; stage 1 the reverse: one message each way per mb
        assert send == (m, m * per_message) and recv == (m, m * per_message), (pp_rank, send, recv)


# -- TP communication per layer ---------------------------------------------------------------------------------
def layer_collectives(cfg, tp: int, sp: bool, recompute: str = "none") -> dict:
    """Collectives over the TP group of one forward + backward through cfg.num_layers layers (no embedding,
    no head): {kind: (calls, elements, sent_bytes)}."""
    tpzoo.init_parallel(tp=tp)
    try:
        return tp_layer_collectives(cfg, B, S, sequence_parallel=sp, recompute=recompute)
    finally:
        tpzoo.destroy_parallel()


def test_tp_communication_per_layer_matches_megatron():
    cfg = get_config("nano-llama").replace(num_layers=3)
    bsh, L = B * S * cfg.hidden_size, cfg.num_layers
    for tp in (2, 4):
        ring = (tp - 1) / tp
        plain = run_on_ranks(4, layer_collectives, cfg, tp, False)[0]
        # 2 forward all-reduces (attention out, MLP out) + 2 backward (the column layers' input gradients)
        assert plain == {"all_reduce": (4 * L, 4 * L * bsh, 4 * L * 2 * ring * 4 * bsh)}
        sp = run_on_ranks(4, layer_collectives, cfg, tp, True)[0]
        # SP: each all-reduce becomes a reduce-scatter + an all-gather of the full activation, same bytes; and
        # the column layers (qkv, fc_in), which keep only their input's sequence shard, gather it again in
        # backward: 2 more all-gathers per layer, the price of s*b*h/tp instead of s*b*h saved per column layer
        assert sp == {"all_gather": (6 * L, 6 * L * bsh, 6 * L * ring * 4 * bsh),
                      "reduce_scatter": (4 * L, 4 * L * bsh, 4 * L * ring * 4 * bsh)}
        regather = 2 * L * ring * 4 * bsh
        assert sp["all_gather"][2] - regather + sp["reduce_scatter"][2] == pytest.approx(plain["all_reduce"][2])


# -- activation memory per layer ---------------------------------------------------------------------------------
def _saved_bytes_per_layer(cfg, tp: int, keep_gathered: bool) -> int:
    """Unique storages autograd saves for one more layer (a 2-layer minus a 1-layer stack, no embedding or head),
    bf16, one micro-batch of B x 4S tokens, SP on (at tp=1: nothing to shard)."""
    from tpzoo import kernels as K
    from tpzoo.models import ModelLayout, Stage, Transformer

    tpzoo.init_parallel(tp=tp)
    try:
        sizes = []
        for layers in (1, 2):
            model = Transformer(cfg.replace(num_layers=layers),
                                ModelLayout(sequence_parallel=tp > 1, dtype=torch.bfloat16),
                                Stage(pre_process=False, post_process=False))
            with K.use_backend("torch"), keep_gathered_inputs() if keep_gathered else contextlib.nullcontext():
                sizes.append(forward_activation_bytes(model, B, 4 * S, hooks=True))
        return sizes[1] - sizes[0]
    finally:
        tpzoo.destroy_parallel()


def test_layer_activations_divide_by_tp_with_sequence_parallelism():
    """The paper's s*b*h*(34/t + 5as/(ht)) divides every term by t (tpzoo's terms: docs/plan.md). Measured from
    real saved tensors: per layer, tp * bytes(tp) equals bytes(1) at tp = 2 and 4, and the plan's estimate."""
    for cfg in (get_config("nano-gpt"), get_config("nano-llama").replace(num_kv_heads=4)):
        got = {tp: run_on_ranks(4, _saved_bytes_per_layer, cfg, tp, False)[0] for tp in (1, 2, 4)}
        before = {tp: run_on_ranks(4, _saved_bytes_per_layer, cfg, tp, True)[0] for tp in (2, 4)}
        tokens = B * 4 * S
        for tp in (2, 4):
            assert tp * got[tp] == got[1], (cfg.name, tp, got)
            # CPU's layer_norm keeps bf16 row statistics, 4 bytes per row less than CUDA's fp32 (docs/plan.md)
            cpu_stats = 2 * 4 * tokens // tp if cfg.norm == "layernorm" else 0
            at = RankLayout(tp=tp, sequence_parallel=True, kernels="reference")
            assert got[tp] == layer_activation_bytes(cfg, 0, at, B, 4 * S) - cpu_stats
            # before: the qkv and fc_in inputs were kept whole, (1 - 1/tp) of 2 full-sequence activations more
            assert before[tp] - got[tp] == 2 * 2 * cfg.hidden_size * tokens * (tp - 1) // tp


# -- replicated parameters stay identical on every TP rank (Megatron-LM issue #1446) -----------------------------
def _replicated_after_a_step(tp_reduce: bool):
    tpzoo.init_parallel(tp=2, pp=2)
    try:
        chunks = build_model_chunks(GPT8, sequence_parallel=True)
        opt = torch.optim.SGD([p for c in chunks for p in c.parameters()], lr=1.0)
        forward_backward(chunks, _microbatches(GPT8, 2), loss_scale=0.01)
        if tp_reduce:
            finalize_grads(chunks)
        else:  # everything but the TP reduction of the partial gradients (dp = 1: no data-parallel sum)
            sum_tied_grads(chunks)
        opt.step()
        sp_params = {n: p.detach().clone() for c in chunks for n, p in c.named_parameters()
                     if getattr(p, "sequence_parallel", False)}
        return get_pp_rank(), get_tp_rank(), sp_params
    finally:
        tpzoo.destroy_parallel()


def test_norm_weights_and_row_biases_stay_identical_across_tp_ranks():
    for tp_reduce in (True, False):
        by_stage = {}
        for pp_rank, _, params in run_on_ranks(4, _replicated_after_a_step, tp_reduce):
            by_stage.setdefault(pp_rank, []).append(params)
        names = set(by_stage[0][0]) | set(by_stage[1][0])
        assert any("norm" in n for n in names) and any("out.bias" in n for n in names)
        identical = all(torch.equal(copies[0][n], copies[1][n]) for copies in by_stage.values() for n in copies[0])
        # finalize_grads sums the partial gradients over TP; without it each rank steps on its own partial sum
        assert identical == tp_reduce


# -- sequence length ---------------------------------------------------------------------------------------------
def _indivisible_sequence():
    tpzoo.init_parallel(tp=2, pp=2)
    try:
        chunks = build_model_chunks(GPT8, sequence_parallel=True)
        errors = []
        try:  # every rank must refuse before sending anything (a lone failing stage would hang its neighbours)
            forward_backward(chunks, _microbatches(GPT8, 2, seq=7))
        except ValueError as e:
            errors.append(str(e))
        if chunks[0].pre_process:
            try:
                chunks[0](torch.zeros(1, 7, dtype=torch.long))
            except ValueError as e:
                errors.append(str(e))
        return errors
    finally:
        tpzoo.destroy_parallel()


def test_sequence_length_not_divisible_by_tp_is_a_clear_error():
    results = run_on_ranks(4, _indivisible_sequence)
    for rank, errors in enumerate(results):
        assert len(errors) == (2 if rank in (0, 1) else 1), errors  # ranks 0, 1: the first stage (tp 0 and 1)
        for e in errors:
            assert "sequence length 7 is not divisible by tp=2" in e
