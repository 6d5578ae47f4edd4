"""Each TP layer at tp = 1, 2, 4 against its dense torch twin with the same full weights: outputs, input
gradients, weight and bias gradients (shards gathered), with and without sequence parallelism."""
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import tpzoo
from tpzoo.parallel import (ColumnParallelLinear, ParallelLayoutError, RowParallelLinear, VocabParallelEmbedding,
                            allreduce_sequence_parallel_grads, count_collectives, gather_tp_param, get_tp_rank,
                            get_tp_size)
from tpzoo.testing import run_on_ranks

B, S, IN, OUT = 2, 8, 12, 20
TOL = dict(rtol=1e-5, atol=1e-5)


def _chunk(t, dim):
    n, r = get_tp_size(), get_tp_rank()
    return t.chunk(n, dim=dim)[r].contiguous()


def _inputs(in_features, out_features, seed=1):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(B, S, in_features, generator=g)
    dy = torch.randn(B, S, out_features, generator=g)
    bias = torch.randn(out_features, generator=g)
    return x, dy, bias


def _dense_master(out_features, in_features, seed):
    """What the layer's init draws for the full weight, from the same seed."""
    torch.manual_seed(seed)
    return nn.init.normal_(torch.empty(out_features, in_features), std=0.02)


def _check_column(tp, sp, bias, gather_output):
    tpzoo.init_parallel(tp=tp)
    torch.manual_seed(0)
    layer = ColumnParallelLinear(IN, OUT, bias=bias, gather_output=gather_output, sequence_parallel=sp)
    full_w = gather_tp_param(layer.weight)
    torch.testing.assert_close(full_w, _dense_master(OUT, IN, 0), rtol=0, atol=0)  # layout-independent init
    x_full, dy_full, b_full = _inputs(IN, OUT)
    if bias:
        with torch.no_grad():
            layer.bias.copy_(_chunk(b_full, 0))
    ref = nn.Linear(IN, OUT, bias=bias)
    with torch.no_grad():
        ref.weight.copy_(full_w)
        if bias:
            ref.bias.copy_(b_full)
    x_ref = x_full.clone().requires_grad_()
    (ref(x_ref) * dy_full).sum().backward()
    y_ref = ref(x_full).detach()

    x = (_chunk(x_full, 1) if sp else x_full.clone()).requires_grad_()
    with count_collectives() as fwd:
        y = layer(x)
    expected_y = y_ref if gather_output else _chunk(y_ref, -1)
    torch.testing.assert_close(y, expected_y, **TOL)
    dy = dy_full if gather_output else _chunk(dy_full, -1)
    with count_collectives() as bwd:
        (y * dy).sum().backward()
    torch.testing.assert_close(x.grad, _chunk(x_ref.grad, 1) if sp else x_ref.grad, **TOL)
    torch.testing.assert_close(gather_tp_param(layer.weight, grad=True), ref.weight.grad, **TOL)
    if bias:
        torch.testing.assert_close(gather_tp_param(layer.bias, grad=True), ref.bias.grad, **TOL)
    return fwd.summary(), bwd.summary()


def _check_row(tp, sp, bias, input_is_parallel):
    tpzoo.init_parallel(tp=tp)
    torch.manual_seed(0)
    layer = RowParallelLinear(IN, OUT, bias=bias, input_is_parallel=input_is_parallel, sequence_parallel=sp)
    full_w = gather_tp_param(layer.weight)
    torch.testing.assert_close(full_w, _dense_master(OUT, IN, 0), rtol=0, atol=0)
    x_full, dy_full, b_full = _inputs(IN, OUT)
    if bias:
        with torch.no_grad():
            layer.bias.copy_(b_full)
    ref = nn.Linear(IN, OUT, bias=bias)
    with torch.no_grad():
        ref.weight.copy_(full_w)
        if bias:
            ref.bias.copy_(b_full)
    x_ref = x_full.clone().requires_grad_()
    y_ref = ref(x_ref)
    (y_ref * dy_full).sum().backward()

    x = (_chunk(x_full, -1) if input_is_parallel else x_full.clone()).requires_grad_()
    with count_collectives() as fwd:
        y = layer(x)
    torch.testing.assert_close(y, _chunk(y_ref.detach(), 1) if sp else y_ref.detach(), **TOL)
    with count_collectives() as bwd:
        (y * (_chunk(dy_full, 1) if sp else dy_full)).sum().backward()
    allreduce_sequence_parallel_grads(layer)  # what the trainer does for SP-replicated params
    torch.testing.assert_close(x.grad, _chunk(x_ref.grad, -1) if input_is_parallel else x_ref.grad, **TOL)
    torch.testing.assert_close(gather_tp_param(layer.weight, grad=True), ref.weight.grad, **TOL)
    if bias:
        torch.testing.assert_close(layer.bias.grad, ref.bias.grad, **TOL)
    return fwd.summary(), bwd.summary()


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_column_parallel_linear_matches_nn_linear(tp):
    for sp, bias, gather in [(False, True, False), (False, True, True), (True, True, False), (False, False, False)]:
        run_on_ranks(4, _check_column, tp, sp, bias, gather)


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_row_parallel_linear_matches_nn_linear(tp):
    for sp, bias, parallel_in in [(False, True, True), (False, True, False), (True, True, True), (False, False, True)]:
        run_on_ranks(4, _check_row, tp, sp, bias, parallel_in)


def _stats(summary, key):
    s = summary.get(key)
    return (s["calls"], s["elements"], s["payload_bytes"], s["sent_bytes"]) if s else (0, 0, 0, 0.0)


@pytest.mark.parametrize("sp", [False, True])
def test_communication_counts_match_the_analysis(sp):
    tp = 4
    (col_f, col_b), _, _, _ = run_on_ranks(4, _check_column, tp, sp, True, False)
    (row_f, row_b), _, _, _ = run_on_ranks(4, _check_row, tp, sp, True, True)
    x_elems, y_elems = B * S * IN, B * S * OUT  # full activations entering the column / leaving the row layer
    ring = (tp - 1) / tp
    if not sp:
        assert col_f == {}  # column: nothing in forward ...
        assert set(col_b) == {"all_reduce@tp"}  # ... one all-reduce of the input gradient in backward
        assert _stats(col_b, "all_reduce@tp") == (1, x_elems, 4 * x_elems, 2 * ring * 4 * x_elems)
        assert set(row_f) == {"all_reduce@tp"} and row_b == {}  # row: one forward all-reduce, nothing back
        assert _stats(row_f, "all_reduce@tp") == (1, y_elems, 4 * y_elems, 2 * ring * 4 * y_elems)
    else:
        # column: the forward gathers the input's sequence; only the local shard is kept, so the backward
        # gathers it again (for the weight gradient) and reduce-scatters the input gradient
        assert set(col_f) == {"all_gather@tp"} and set(col_b) == {"all_gather@tp", "reduce_scatter@tp"}
        assert _stats(col_f, "all_gather@tp") == (1, x_elems, 4 * x_elems, ring * 4 * x_elems)
        assert _stats(col_b, "all_gather@tp") == _stats(col_f, "all_gather@tp")
        assert _stats(col_b, "reduce_scatter@tp") == (1, x_elems, 4 * x_elems, ring * 4 * x_elems)
        assert set(row_b) == {"all_gather@tp"} and set(row_f) == {"reduce_scatter@tp"}
        assert set(row_f) == {"reduce_scatter@tp"}
        assert _stats(row_f, "reduce_scatter@tp") == (1, y_elems, 4 * y_elems, ring * 4 * y_elems)
        assert _stats(row_b, "all_gather@tp") == (1, y_elems, 4 * y_elems, ring * 4 * y_elems)
        # SP moves the same bytes as the all-reduce it replaces (ring all-reduce = reduce-scatter + all-gather)
        assert _stats(row_f, "reduce_scatter@tp")[3] + _stats(row_b, "all_gather@tp")[3] == 2 * ring * 4 * y_elems


VOCAB, DIM = 37, 16  # 37 is divisible by neither 2 nor 4: exercises the padding


def _check_embedding(tp, sp):
    tpzoo.init_parallel(tp=tp)
    torch.manual_seed(0)
    emb = VocabParallelEmbedding(VOCAB, DIM, sequence_parallel=sp)
    full_w = gather_tp_param(emb.weight)
    assert full_w.shape[0] == emb.num_embeddings_padded and emb.num_embeddings_padded % tp == 0
    assert torch.count_nonzero(full_w[VOCAB:]) == 0  # padded rows start at zero
    torch.testing.assert_close(full_w[:VOCAB], _dense_master(VOCAB, DIM, 0), rtol=0, atol=0)
    ref = nn.Embedding(VOCAB, DIM)
    with torch.no_grad():
        ref.weight.copy_(full_w[:VOCAB])
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(0, VOCAB, (B, S), generator=g)
    ids[0, :4] = torch.tensor([0, VOCAB - 1, emb.per_rank - 1, emb.per_rank % VOCAB])  # shard boundaries
    dy = torch.randn(B, S, DIM, generator=g)
    y_ref = ref(ids)
    (y_ref * dy).sum().backward()
    y = emb(ids)
    torch.testing.assert_close(y, _chunk(y_ref.detach(), 1) if sp else y_ref.detach(), **TOL)
    (y * (_chunk(dy, 1) if sp else dy)).sum().backward()
    full_grad = gather_tp_param(emb.weight, grad=True)
    torch.testing.assert_close(full_grad[:VOCAB], ref.weight.grad, **TOL)
    assert torch.count_nonzero(full_grad[VOCAB:]) == 0


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_vocab_parallel_embedding_matches_nn_embedding(tp):
    for sp in (False, True):
        run_on_ranks(4, _check_embedding, tp, sp)


def _bad_layer_layout():
    tpzoo.init_parallel(tp=4)
    errors = []
    with count_collectives() as c:
        for make in (lambda: ColumnParallelLinear(8, 10), lambda: RowParallelLinear(10, 8)):
            try:
                make()
            except ParallelLayoutError as e:
                errors.append(str(e))
    return errors, c.total_calls()


def test_tp_not_dividing_features_is_a_clear_error_before_any_collective():
    for errors, calls in run_on_ranks(4, _bad_layer_layout, timeout=60):
        assert errors == ["ColumnParallelLinear out_features / tp: 10 is not divisible by 4",
                          "RowParallelLinear in_features / tp: 10 is not divisible by 4"]
        assert calls == 0


def test_layers_run_without_any_distributed_setup():
    torch.manual_seed(0)
    col, row = ColumnParallelLinear(IN, OUT), RowParallelLinear(OUT, IN)
    x = torch.randn(3, 5, IN)
    torch.testing.assert_close(row(col(x)), F.linear(F.linear(x, col.weight, col.bias), row.weight, row.bias))
