"""cellrunner.grads: a satellite's gradient reaches the core's inbox over real ZeroMQ, is checked
against the rank it reached and the core's buffer, and a refused step loses nothing.

(Rank by rank across two-rank cells: ``test_spmd_trainer.py``.)"""

from __future__ import annotations

import random
import time

import numpy as np
import pytest
import zmq

from cellrunner.grads import GradExchange, GradInbox, send_to_peer
from cellrunner.model import flatten_grads
from cellrunner.spmd import solo
from cellrunner.trainer import EmbeddedTrainer
from base import wire
from tests.cellrunner.test_trainer import VOCAB, assert_same_gradient, cfgs, make_shards, one_replica_grads


@pytest.fixture
def ctx():
    return zmq.Context.instance()


def test_the_inbox_keeps_frames_by_step_and_cell_and_refuses_the_wrong_ones(ctx):
    inbox = GradInbox(ctx, "127.0.0.1", rank=1)
    try:
        g = np.arange(6, dtype=np.float32)
        send_to_peer(ctx, inbox.addr, cell_id=2, step=5, rank=1, grads=g)
        # Frames on separate connections may land in any order: the first is in before the next go.
        deadline = time.monotonic() + 10
        while inbox.count(5) < 1 and time.monotonic() < deadline:
            inbox.drain(timeout_ms=100)
        send_to_peer(ctx, inbox.addr, cell_id=2, step=5, rank=1, grads=g + 9)  # a second from cell 2
        send_to_peer(ctx, inbox.addr, cell_id=3, step=5, rank=0, grads=g)  # rank 0's, sent to rank 1
        send_to_peer(ctx, inbox.addr, cell_id=3, step=4, rank=1, grads=g + 1)  # an older step's
        push = ctx.socket(zmq.PUSH)
        push.connect(inbox.addr)
        push.send_multipart([wire.encode(wire.GradsHeader(cell_id=3, step=5, rank=1, num_elements=9)), b"\0" * 8])
        push.close(linger=2000)
        assert inbox.take(5, [2, 3], timeout_s=1.0) is None  # the wrong rank's and the short one are refused
        assert inbox.missing(5, [2, 3]) == [3] and inbox.count(4) == 1  # what came stays
        send_to_peer(ctx, inbox.addr, cell_id=3, step=5, rank=1, grads=g * 2)
        got = inbox.take(5, [3, 2], timeout_s=10.0)
        assert [x.tolist() for x in got] == [(g * 2).tolist(), g.tolist()]  # in the order asked; cell 2's first one
        assert inbox.count(4) == 1 and inbox.count(5) == 0
        inbox.forget_through(5)  # step 5 applied: step 4's leftover can no longer count
        assert inbox.count(4) == 0
    finally:
        inbox.close()


def test_a_gradient_from_a_cell_not_named_never_counts(ctx):
    """A satellite lost after sending: the controller re-queued its shards (its GradsSent never
    came), so the core must not add its gradient, though it arrived, and must not take it in place
    of a named cell's."""
    inbox = GradInbox(ctx, "127.0.0.1", rank=0)
    try:
        lost, live = np.full(4, 7.0, dtype=np.float32), np.ones(4, dtype=np.float32)
        send_to_peer(ctx, inbox.addr, cell_id=3, step=2, rank=0, grads=lost)  # it may well land first
        send_to_peer(ctx, inbox.addr, cell_id=1, step=2, rank=0, grads=live)
        got = inbox.take(2, [1], timeout_s=10.0)
        assert [x.tolist() for x in got] == [live.tolist()]
        inbox.forget_through(2)
        assert inbox.count(2) == 0
    finally:
        inbox.close()


def test_header_fields_are_checked():
    with pytest.raises(wire.ProtocolError, match="rank"):
        wire.decode(wire.encode(wire.GradsHeader(cell_id=1, step=1, rank=-1, num_elements=3)))


def test_a_satellite_gradient_through_the_exchange_is_one_replicas_step(ctx):
    model_cfg, algo = cfgs()
    shards = make_shards(random.Random(4), 4)
    want = one_replica_grads(shards)

    core = EmbeddedTrainer(model_cfg=model_cfg, algo=algo, vocab_size=VOCAB, is_core=True)
    core.start(None)
    sat = EmbeddedTrainer(model_cfg=model_cfg, algo=algo, vocab_size=VOCAB, is_core=False)
    sat.start(core.weights())
    core_side = GradExchange(ctx, "127.0.0.1", rank=0, is_core=True)
    sat_side = GradExchange(ctx, "127.0.0.1", rank=0, is_core=False)
    try:
        assert sat_side.addr == "" and core_side.addr.startswith("tcp://127.0.0.1:")
        for i, sh in enumerate(shards):
            (core if i % 2 else sat).microstep(sh)
        sat_side.send(sat, [core_side.addr], cell_id=1, step=0, agree=solo)
        assert sat.num_microsteps == 0  # taken

        # One more satellite than came: refused after the timeout, and nothing is lost.
        before = core.weights().data.copy()
        with pytest.raises(ValueError, match=r"no gradient from cells \[2\]"):
            core_side.apply(core, step=0, satellites=[1, 2], num_executions=12, timeout_s=0.3, agree=solo)
        assert np.array_equal(core.weights().data, before) and core_side.inbox.count(0) == 1

        got = core_side.inbox.take(0, [1], timeout_s=1.0)
        core_side.inbox.pending_back(0, [1], got)
        assert_same_gradient(flatten_grads(core.model) + got[0], want)
        weights, norm = core_side.apply(core, step=0, satellites=[1], num_executions=12, timeout_s=5.0, agree=solo)
        assert weights.version == 1 and norm > 0
        with pytest.raises(RuntimeError, match="could not send"):  # no inbox named for this rank
            sat_side.send(sat, [], cell_id=1, step=1, agree=solo)
    finally:
        core_side.close()
        sat_side.close()


def test_a_gradient_of_the_wrong_size_is_refused_and_kept(ctx):
    model_cfg, algo = cfgs()
    core = EmbeddedTrainer(model_cfg=model_cfg, algo=algo, vocab_size=VOCAB, is_core=True)
    core.start(None)
    core_side = GradExchange(ctx, "127.0.0.1", rank=0, is_core=True)
    try:
        short = np.zeros(core.grad_numel() - 1, dtype=np.float32)
        send_to_peer(ctx, core_side.addr, cell_id=1, step=0, rank=0, grads=short)
        with pytest.raises(ValueError, match=f"has {short.size} elements, want {core.grad_numel()}"):
            core_side.apply(core, step=0, satellites=[1], num_executions=1, timeout_s=5.0, agree=solo)
        assert core_side.inbox.count(0) == 1 and core.version == 0
    finally:
        core_side.close()
