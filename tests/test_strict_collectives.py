"""Strict collective mode (tpzoo/parallel/strict.py): each mistake NCCL's asynchronous semantics punish is planted
in a small program on 2 gloo ranks, and the mode must catch it (a poisoned read, an error naming the collective
and the group, an error naming where a never-waited collective was started); the same program passes without
the mode, which is exactly why gloo alone cannot be trusted. The rest of the suite runs under the mode
(tests/conftest.py), so every multi-rank path is checked by it at every change."""
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from tpzoo.testing import RankFailure, run_on_ranks

ROOT = Path(__file__).resolve().parents[1]


def _settle(handle) -> None:
    """Let a collective finish before the planted mistake, as gloo usually has: without strict mode the mistake
    then goes unseen, which is what these tests show. (Some gloo requests, point-to-point ones among them, never
    say they are done before wait(): those are given a moment.)"""
    work = getattr(handle, "work", None)
    deadline = time.monotonic() + 0.2
    while time.monotonic() < deadline and not (work is not None and work.is_completed()):
        time.sleep(0.002)


def _world():
    import tpzoo

    return tpzoo.init_parallel(dp=2)


def _read_before_wait(strict_on: bool, which: str):
    from tpzoo.parallel import comm, strict_collectives

    dims = _world()
    with strict_collectives(strict_on):
        me = float(dims.rank + 1)
        if which == "all_gather_into":
            out = torch.zeros(4)
            pending = comm.all_gather_into_start(out, torch.full((2,), me), dims.dp_group)
        elif which == "all_reduce":
            out = torch.full((3,), me)
            pending = comm.all_reduce_start(out, dims.dp_group)
        else:  # a point-to-point receive, as the pipeline and ring attention post them
            out = torch.zeros(3)
            peer = 1 - dims.rank
            (pending,) = comm.batch_send_recv([(torch.full((3,), me), peer)], [(out, peer)], wait=False)
        _settle(pending)
        early = out.clone()  # the mistake: the output read before wait()
        pending.wait()
        return early.tolist(), out.tolist()


@pytest.mark.parametrize("which", ["all_gather_into", "all_reduce", "recv"])
def test_reading_an_output_before_wait_sees_poison(which):
    expected = {"all_gather_into": [1.0, 1.0, 2.0, 2.0], "all_reduce": [3.0] * 3, "recv": None}[which]
    for strict_on in (False, True):
        results = run_on_ranks(2, _read_before_wait, strict_on, which)
        for rank, (early, final) in enumerate(results):
            want = expected or [float(2 - rank)] * 3  # a receive gets the peer's tensor
            assert final == want  # after wait() the result is right either way
            if strict_on:
                assert all(x != x for x in early), early  # poisoned: NaN until wait()
            elif which != "recv":  # (a gloo receive may or may not have landed: a race strict mode removes)
                assert early == want  # gloo had finished: the early read looked fine


def _write_before_wait(strict_on: bool, which: str):
    from tpzoo.parallel import CollectiveMisuse, comm, strict_collectives

    dims = _world()
    with strict_collectives(strict_on):
        t = torch.ones(4)
        if which == "reduce_scatter_into":
            out = torch.zeros(2)
            pending = comm.reduce_scatter_into_start(out, t, dims.dp_group)
            written = t  # the mistake: the input written before wait()
        elif which == "all_gather_into_output":
            out = torch.zeros(8)
            pending = comm.all_gather_into_start(out, t, dims.dp_group)
            written = out  # the mistake: the output written before wait() (NCCL would overwrite it, or not)
        elif which == "all_reduce":
            pending = comm.all_reduce_start(t, dims.dp_group)
            written = t  # in place: input and output at once
        else:
            peer = 1 - dims.rank
            (pending,) = comm.batch_send_recv([(t, peer)], [(torch.zeros(4), peer)], wait=False)
            written = t  # a tensor being sent
        _settle(pending)
        written.add_(1.0)
        try:
            pending.wait()
        except CollectiveMisuse as e:
            return str(e)
        return None


@pytest.mark.parametrize("which, message", [
    ("reduce_scatter_into", "reduce_scatter_into: input modified before wait() (group dp"),
    ("all_gather_into_output", "all_gather_into: output written before wait() (group dp"),
    ("all_reduce", "all_reduce: tensor modified (in place: it is the input and the output) before wait()"),
    ("send", "send/recv: input modified before wait() (group world"),
])
def test_writing_a_buffer_before_wait_is_an_error_naming_the_collective(which, message):
    assert run_on_ranks(2, _write_before_wait, False, which) == [None, None]
    errors = run_on_ranks(2, _write_before_wait, True, which)
    for e in errors:
        assert e is not None and message in e, e
        assert "test_strict_collectives.py" in e  # where it was started


def _strided(strict_on: bool, which: str):
    from tpzoo.parallel import CollectiveMisuse, comm, strict_collectives

    dims = _world()
    with strict_collectives(strict_on):
        t = torch.arange(6.0).view(2, 3).t()  # the mistake: a transposed view (NCCL: "Tensors must be contiguous")
        try:
            if which == "all_reduce":
                comm.all_reduce(t, dims.dp_group)
            elif which == "broadcast":
                comm.broadcast(t, 0, dims.dp_group)
            elif which == "all_reduce_start":
                comm.all_reduce_start(t, dims.dp_group).wait()
            else:  # into a strided output
                comm.all_gather_into_start(torch.zeros(4, 3).t(), torch.zeros(6), dims.dp_group).wait()
        except CollectiveMisuse as e:
            return str(e)
        return t.tolist()


@pytest.mark.parametrize("which", ["all_reduce", "broadcast", "all_reduce_start", "all_gather_into"])
def test_a_non_contiguous_tensor_is_refused_as_nccl_refuses_it(which):
    t = [[0.0, 3.0], [1.0, 4.0], [2.0, 5.0]]
    if which in ("all_reduce", "broadcast"):  # gloo takes it and gets it right: nothing to see without the mode
        want = [[2 * x for x in row] for row in t] if which == "all_reduce" else t
        assert run_on_ranks(2, _strided, False, which) == [want, want]
    name = "all_reduce" if which == "all_reduce_start" else which
    shape = "(3, 4), strides (1, 3)" if which == "all_gather_into" else "(3, 2), strides (1, 3)"
    for e in run_on_ranks(2, _strided, True, which):
        assert e.startswith(f"{name}: a non-contiguous tensor (shape {shape}; group dp"), e
        assert "NCCL refuses it" in e and "test_strict_collectives.py" in e


def _out_of_order(strict_on: bool):
    from tpzoo.parallel import CollectiveMisuse, comm, strict, strict_collectives

    dims = _world()
    with strict_collectives(strict_on):
        first, second = torch.full((3,), 1.0), torch.full((3,), 2.0)
        if dims.rank == 0:  # sends tag 7 then tag 8
            for handle in comm.batch_send_recv([(first, 1, 7)], [], wait=False) + comm.batch_send_recv(
                    [(second, 1, 8)], [], wait=False):
                handle.wait()
            return None
        a, b = torch.zeros(3), torch.zeros(3)
        # the mistake: receives posted in the other order (gloo pairs by tag; NCCL by order)
        handles = comm.batch_send_recv([], [(b, 0, 8), (a, 0, 7)], wait=False)
        try:
            for handle in handles:
                handle.wait()
        except CollectiveMisuse as e:
            strict.forget()  # the other receive is as wrong: one report is enough
            return str(e)
        return a.tolist() + b.tolist()


def test_receives_posted_out_of_the_peers_send_order_are_an_error():
    # NCCL ignores tags and pairs two ranks' messages in posting order: strict mode does the same, and says so
    assert run_on_ranks(2, _out_of_order, False)[1] == [1.0] * 3 + [2.0] * 3
    e = run_on_ranks(2, _out_of_order, True)[1]
    assert "a receive from rank 0 posted for the message tagged 8 was matched with the peer's message tagged 7" in e
    assert "NCCL pairs the sends and receives of two ranks in the order they are posted" in e


def _receive_first_then_send(strict_on: bool):
    import torch.distributed as dist

    from tpzoo.parallel import CollectiveMisuse, comm, strict, strict_collectives

    dims = _world()
    group = dist.new_group([0, 1])  # a channel of its own: what this test leaves posted stays there
    previous, strict.P2P_TIMEOUT = strict.P2P_TIMEOUT, 3.0
    peer, got = 1 - dims.rank, torch.zeros(3)
    try:
        with strict_collectives(strict_on):
            # the mistake: on both ranks, a receive-only batch, then the send it waits for, in a later batch
            (receiving,) = comm.batch_send_recv([], [(got, peer, 1)], group, wait=False)
            try:
                (sending,) = comm.batch_send_recv([(torch.full((3,), float(dims.rank)), peer, 1)], [], group,
                                                  wait=False)
            except CollectiveMisuse as e:
                strict.forget()
                return str(e)
            receiving.wait()
            sending.wait()
            return got.tolist()
    finally:
        strict.P2P_TIMEOUT = previous


def test_a_receive_posted_before_the_send_it_waits_for_deadlocks_as_on_nccl():
    # NCCL runs a group's batches one after another and a send may wait for its receive: both ranks would hang.
    # gloo runs them independently; strict mode does what NCCL does and names both batches after a timeout.
    assert run_on_ranks(2, _receive_first_then_send, False) == [[1.0] * 3, [0.0] * 3]
    for e in run_on_ranks(2, _receive_first_then_send, True):
        assert "the group's previous point-to-point batch (started at tests/test_strict_collectives.py:" in e, e
        assert "did not complete within 3 s. NCCL runs a group's batches one after another" in e


def _never_waited(strict_on: bool):
    from tpzoo.parallel import CollectiveMisuse, comm, strict, strict_collectives

    dims = _world()
    with strict_collectives(strict_on):
        pending = comm.all_reduce_start(torch.ones(2), dims.dp_group)
        try:
            strict.check_all_waited("the end of training step 7")
        except CollectiveMisuse as e:
            return str(e)
        finally:
            pending.work.wait()  # (let gloo finish before the next test uses the group)
        return None


def test_a_collective_never_waited_is_an_error_naming_where_it_started():
    assert run_on_ranks(2, _never_waited, False) == [None, None]
    for e in run_on_ranks(2, _never_waited, True):
        assert "1 collective(s) started and never waited by the end of training step 7" in e
        assert "all_reduce on group dp, started at tests/test_strict_collectives.py:" in e and "_never_waited" in e


def _leaves_one_in_flight():
    from tpzoo.parallel import comm, strict_collectives

    dims = _world()
    with strict_collectives(True):
        pending = comm.all_reduce_start(torch.ones(2), dims.dp_group)
    pending.work.wait()  # gloo's transfer is over; the handle itself was never waited
    return "returned"


def test_the_rank_pool_checks_each_call_like_a_process_exit():
    with pytest.raises(RankFailure, match="never waited by the end of _leaves_one_in_flight"):
        run_on_ranks(2, _leaves_one_in_flight)


def _train_with_a_stray_collective(cfg, strict_on: bool):
    from tpzoo.parallel import CollectiveMisuse, comm, strict_collectives
    from tpzoo.train import train
    from tpzoo.train.optim import DistributedAdamW

    original = DistributedAdamW.reduce_grads

    def reduce_grads(self, *a, **kw):  # the planted bug: one more bucket started, never waited
        out = original(self, *a, **kw)
        self._stray = comm.all_reduce_start(torch.ones(3), self.dp_group)
        return out

    DistributedAdamW.reduce_grads = reduce_grads
    try:
        with strict_collectives(strict_on):
            try:
                return train(cfg)["status"]
            except CollectiveMisuse as e:
                return str(e)
    finally:
        DistributedAdamW.reduce_grads = original


def test_a_training_step_that_leaves_a_collective_in_flight_fails_at_its_end(tmp_path):
    import sysconfig

    from tpzoo.train import load_config

    text = str(Path(sysconfig.get_paths()["stdlib"]) / "textwrap.py")
    cfg = load_config(None, dict(model="nano-gpt", data=[text], seq_len=16, global_batch_size=4, micro_batch_size=2,
                                 steps=2, tp=1, pp=1, dp=2, save="", sample_prompt="", quiet=True, eval_fraction=0.0, seed=0,
                                 data_cache=str(tmp_path / "cache")))
    assert run_on_ranks(2, _train_with_a_stray_collective, cfg, False) == ["ok", "ok"]
    for e in run_on_ranks(2, _train_with_a_stray_collective, cfg, True):
        assert "never waited by the end of training step 1" in e and "reduce_grads" in e, e


def test_a_collective_left_at_process_exit_fails_the_process():
    # strict mode registers every transfer it starts (a Guard): one still registered at exit fails the process
    code = ("import torch\nfrom tpzoo.parallel import strict\n"
            "g = strict.Guard('all_gather_into', 'dp', reads=[torch.ones(2)], writes=[torch.zeros(4)])\n")
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1, proc.stderr
    assert "started and never waited by process exit: all_gather_into on group dp, started at" in proc.stderr


def test_poison_is_nan_whose_bits_any_arithmetic_changes_or_an_integer_sentinel():
    from tpzoo.parallel.strict import _same, poison_

    for dtype in (torch.float32, torch.bfloat16, torch.float16, torch.float64):
        t = poison_(torch.zeros(3, dtype=dtype))
        assert torch.isnan(t).all()
        before = t.clone()
        assert _same(t, before) and not _same(t.add_(1.0), before)  # NaN in, NaN out, and still seen as a write
    assert (poison_(torch.zeros(3, dtype=torch.int64)) == torch.iinfo(torch.int64).min).all()
    assert (poison_(torch.zeros(3, dtype=torch.int32)) == torch.iinfo(torch.int32).min).all()
    assert poison_(torch.zeros(3, dtype=torch.bool)).all()


def _strict_is_on() -> bool:
    from tpzoo.parallel import strict

    return strict.enabled()


def test_the_suite_runs_under_strict_mode():
    # conftest turns it on for every test process, rank pools and launched commands (unless the environment says 0)
    import os

    if os.environ.get("TPZOO_STRICT_COLLECTIVES") == "0":
        pytest.skip("TPZOO_STRICT_COLLECTIVES=0 was asked for")
    assert _strict_is_on() and run_on_ranks(2, _strict_is_on) == [True, True]
    code = "from tpzoo.parallel import strict; print(strict.enabled())"
    assert subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                          timeout=120).stdout.strip() == "True"
