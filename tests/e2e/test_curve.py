"""CURVE on the embedded default, attacked while it runs: strangers cannot connect to the
controller, the processor's records socket, the core's weight server or its gradient inbox; a
member cannot speak as another (a Hello as the processor, a gradient in another cell's name); the
run goes on unharmed."""

from __future__ import annotations

import json
import time
from pathlib import Path

import numpy as np
import pytest
import zmq

from cellrunner.transfer import send_grads
from base import wire
from tests.e2e import member_socket, run_gyre_with


def plain(ctx: zmq.Context, kind: int) -> zmq.Socket:
    sock = ctx.socket(kind)
    sock.setsockopt(zmq.LINGER, 0)
    return sock


def stranger_with_own_key(ctx: zmq.Context, kind: int, server_public: bytes) -> zmq.Socket:
    """Knows the server's public key (peers.json is public) but holds no member's secret key."""
    public, secret = zmq.curve_keypair()
    sock = plain(ctx, kind)
    sock.setsockopt(zmq.CURVE_SECRETKEY, secret)
    sock.setsockopt(zmq.CURVE_PUBLICKEY, public)
    sock.setsockopt(zmq.CURVE_SERVERKEY, server_public)
    return sock


def attack(run_dir: Path, done, report: dict) -> None:
    try:
        _attack(run_dir, done, report)
    except Exception as exc:  # seen in the test's assertion, not lost in a thread
        report["error"] = repr(exc)


def _attack(run_dir: Path, done, report: dict) -> None:
    endpoints = run_dir / "endpoints.json"
    while not endpoints.exists() and not done.is_set():
        time.sleep(0.1)
    if done.is_set():
        return
    ep = json.loads(endpoints.read_text())
    peers = {k: v.encode() for k, v in json.loads((run_dir / "keys" / "peers.json").read_text()).items()}
    records_addr = json.loads((run_dir / "processor.ready").read_text())["records_addr"]
    ctx = zmq.Context()
    socks = []
    try:
        # 1. strangers at the controller: one taking cell 1's routing id, one with a key of its own
        for sock in (plain(ctx, zmq.DEALER), stranger_with_own_key(ctx, zmq.DEALER, peers["controller"])):
            sock.setsockopt(zmq.ROUTING_ID, b"cell-1")
            sock.connect(ep["controller"])
            sock.send(wire.encode(wire.Hello(peer="cell", cell_id=1)))
            sock.send(wire.encode(wire.Heartbeat(cell_id=1, phase="serving", num_running=0, weight_version=0)))
            sock.send(b"\x93\x01\xa5bogus\x80")  # would be answered with ErrorReply, were it let in
            socks.append(sock)
        # 2. strangers at the core's weight server and the processor's records socket
        weights = plain(ctx, zmq.DEALER)
        weights.connect(ep["core_weights"])
        weights.send(wire.encode(wire.PullWeights(min_version=0)))
        records = plain(ctx, zmq.DEALER)
        records.connect(records_addr)
        records.send(b"\x93\x01\xa5bogus\x80")
        socks += [weights, records]
        # 3. a stranger and a member (cell 2) each hand in a gradient in cell 1's name
        for sock in (plain(ctx, zmq.PUSH), member_socket(ctx, run_dir, "cell-2", zmq.PUSH, "cell-0")):
            sock.connect(ep["core_grads"][0])
            send_grads(sock, cell_id=1, step=10_000, grads=np.zeros(4, dtype=np.float32))
            socks.append(sock)
        # 4. a member says Hello as the processor (to get the grades and send shards in its name)
        imposter = member_socket(ctx, run_dir, "cell-1", zmq.DEALER, "controller")
        imposter.connect(ep["controller"])
        imposter.send(wire.encode(wire.Hello(peer="processor")))
        socks.append(imposter)
        report["imposter_reply"] = wire.decode(imposter.recv()) if imposter.poll(10_000) else None
        poller = zmq.Poller()
        for sock in socks[:3]:  # the two at the controller, the one at the weight server
            poller.register(sock, zmq.POLLIN)
        report["stranger_replies"] = len(poller.poll(3000))
        report["attacked_while_running"] = not done.is_set()
    finally:
        for s in socks:
            s.close(0)
        ctx.term()


@pytest.mark.e2e
def test_strangers_cannot_connect_and_members_cannot_impersonate(tmp_path):
    run_dir, report = run_gyre_with(tmp_path / "runs", attack, "run.steps=4")
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["steps"] == 4  # the run went on unharmed
    assert report.get("attacked_while_running"), report
    assert "error" not in report, report["error"]
    assert report["stranger_replies"] == 0
    reply = report["imposter_reply"]
    assert isinstance(reply, wire.ErrorReply) and "not processor" in reply.message
    ctl_log = (run_dir / "controller.log").read_text()
    assert "cell-1 said Hello as processor; refused" in ctl_log
    assert "unknown tag 'bogus'" not in ctl_log  # no stranger's frame reached the decoder
    core_log = (run_dir / "logs" / "cell0.log").read_text()
    assert "cell-2 sent a gradient in cell 1's name" in core_log
    assert core_log.count("rejected gradient frame") == 1  # the stranger's never arrived
    assert "bogus" not in (run_dir / "logs" / "processor.log").read_text()
