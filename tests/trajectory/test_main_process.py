"""`python -m trajectory.main` as a real process with real ZMQ sockets, killed and restarted.

The test plays the controller (a ROUTER the processor's DEALER connects to, answering each shard
and group with ``Delivered``) and the proxy (a DEALER connected to the processor's records
ROUTER, resending only what no ``RecordsAck`` covered). It SIGKILLs the processor while records
stream in, restarts it on the same log, and checks that every shard arrives exactly once with the
contents an in-process Processor computes from the same messages.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import pytest
import zmq

from base.typed_config import to_dict
from base.wire import (
    Delivered,
    ExecutionFacts,
    GroupDone,
    Hello,
    Message,
    RecordsAck,
    ServiceHeartbeat,
    ShardReady,
    decode,
    encode,
    record_key,
)
from tests.trajectory import REPO, algo
from tests.trajectory.test_processor import feed, group_messages, processor

pytestmark = pytest.mark.e2e

DEADLINE_S = 30.0  # generous: only a hung process gets near it


class Harness:
    def __init__(self, tmp_path: Path) -> None:
        self.tmp = tmp_path
        self.ctx = zmq.Context()
        self.router = self.ctx.socket(zmq.ROUTER)
        self.router.setsockopt(zmq.LINGER, 0)
        self.router.bind("tcp://127.0.0.1:0")
        self.controller_addr = self.router.getsockopt_string(zmq.LAST_ENDPOINT)
        self.push: zmq.Socket | None = None
        self.config = tmp_path / "processor.json"
        cfg = algo(max_tokens_per_microstep=20)
        self.config.write_text(json.dumps({
            "algo": to_dict(cfg), "workload": {"min_usable_per_group": 1},
        }))
        self.proc: subprocess.Popen | None = None
        self.ident = b""
        self.received: list[Message] = []
        self.facts: list[ExecutionFacts] = []
        self.acked: set[tuple[str, str]] = set()
        self.heartbeats = 0

    def start(self, bind: str) -> str:
        ready = self.tmp / "processor.ready"
        ready.unlink(missing_ok=True)
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "trajectory.main", "--config-json", str(self.config),
             "--controller", self.controller_addr, "--bind-records", bind,
             "--log-dir", str(self.tmp / "log"), "--ready-file", str(ready)],
            cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)},
            stdout=subprocess.DEVNULL, stderr=open(self.tmp / "processor.stderr", "ab"),
        )
        deadline = time.monotonic() + DEADLINE_S
        while not ready.exists():
            assert self.proc.poll() is None, (self.tmp / "processor.stderr").read_text()
            assert time.monotonic() < deadline, "processor not ready"
            time.sleep(0.02)
        records_addr = json.loads(ready.read_text())["records_addr"]
        ident, hello = self._recv()
        assert hello == Hello(peer="processor", pid=self.proc.pid)
        self.ident = ident
        if self.push is None:
            self.push = self.ctx.socket(zmq.DEALER)
            self.push.setsockopt(zmq.LINGER, 0)
            self.push.connect(records_addr)
        return records_addr

    def _recv(self) -> tuple[bytes, Message]:
        """The next data or control message; ExecutionFacts (the report's, counted apart) are kept aside."""
        while True:
            assert self.router.poll(int(DEADLINE_S * 1000)), "nothing from the processor"
            ident, frame = self.router.recv_multipart()
            msg = decode(frame)
            if isinstance(msg, ServiceHeartbeat):
                self.heartbeats += 1
                continue
            if not isinstance(msg, ExecutionFacts):
                return ident, msg
            self.facts.append(msg)

    def send_records(self, messages: list[Message]) -> None:
        assert self.push is not None
        for m in messages:
            self.push.send(encode(m))

    def take_acks(self, settle_ms: int = 300) -> None:
        assert self.push is not None
        while self.push.poll(settle_ms):
            ack = decode(self.push.recv())
            assert isinstance(ack, RecordsAck)
            self.acked.update(zip(ack.execution_ids, ack.call_ids))

    def send_grades(self, messages: list[Message]) -> None:
        for m in messages:
            self.router.send_multipart([self.ident, encode(m)])

    def collect_until_done(self, group_ids: set[str]) -> None:
        waiting = set(group_ids)
        while waiting:
            _, msg = self._recv()
            self.received.append(msg)
            if isinstance(msg, GroupDone):
                waiting.discard(msg.group_id)
            self.send_grades([Delivered(shard_ids=[msg.shard.shard_id]) if isinstance(msg, ShardReady)
                              else Delivered(group_ids=[msg.group_id])])

    def close(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        self.ctx.destroy(linger=0)


@pytest.fixture
def harness(tmp_path: Path):
    h = Harness(tmp_path)
    yield h
    h.close()


def test_sigkill_mid_stream_then_restart_every_shard_exactly_once(harness: Harness) -> None:
    groups = {g: group_messages(g, [1.0, 0.0, 0.5]) for g in ("g1", "g2", "g3", "g4")}
    reference: list[Message] = []
    for records, seals, grades in groups.values():
        reference += feed(processor(max_tokens=20), records + seals + grades)
    want_shards = Counter(m.shard.shard_id for m in reference if isinstance(m, ShardReady))
    assert len(want_shards) > 4  # some groups are split into several shards

    records_addr = harness.start("tcp://127.0.0.1:0")
    harness.send_grades([g for _, _, grades in groups.values() for g in grades])
    for g in ("g1", "g2"):
        records, seals, _ = groups[g]
        harness.send_records(records + seals)
    harness.collect_until_done({"g1", "g2"})

    # Mid-stream: g3 and g4 records in flight, g3 half sealed; no group can complete yet.
    r3, s3, _ = groups["g3"]
    r4, _, _ = groups["g4"]
    harness.send_records(r3 + s3[:1] + r4[:3])
    harness.take_acks()
    assert {record_key(m) for m in r3 + s3[:1] + r4[:3]} <= harness.acked  # acked: in the log
    assert harness.proc is not None
    harness.proc.send_signal(signal.SIGKILL)
    harness.proc.wait()

    harness.start(records_addr)  # same port: the proxy's PUSH reconnects by itself
    # The controller resends the grades of open groups (idempotent), the proxy only what was not
    # acknowledged: what was is in the log, and the restart replays it.
    harness.send_grades([g for name in ("g3", "g4") for g in groups[name][2]])
    for g in ("g3", "g4"):
        records, seals, _ = groups[g]
        harness.send_records([m for m in records + seals if record_key(m) not in harness.acked])
    harness.collect_until_done({"g3", "g4"})

    got_shards = Counter(m.shard.shard_id for m in harness.received if isinstance(m, ShardReady))
    assert got_shards == want_shards
    done = Counter(m.group_id for m in harness.received if isinstance(m, GroupDone))
    assert done == Counter({"g1": 1, "g2": 1, "g3": 1, "g4": 1})
    by_id = {m.shard.shard_id: m.shard for m in reference if isinstance(m, ShardReady)}
    for m in harness.received:
        if isinstance(m, ShardReady):
            assert m.shard == by_id[m.shard.shard_id]

    harness.proc.send_signal(signal.SIGTERM)
    assert harness.proc.wait(timeout=DEADLINE_S) == 0
    left = []
    while harness.router.poll(200):
        left.append(decode(harness.router.recv_multipart()[1]))
    assert all(isinstance(m, (ExecutionFacts, ServiceHeartbeat)) for m in left), left  # no data sent twice
    assert harness.heartbeats >= 1


def test_bad_config_fails_fast(tmp_path: Path) -> None:
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"algo": {}, "workload": {"min_usable_per_group": 1}}))
    proc = subprocess.run(
        [sys.executable, "-m", "trajectory.main", "--config-json", str(bad), "--controller", "tcp://127.0.0.1:1",
         "--bind-records", "tcp://127.0.0.1:0", "--log-dir", str(tmp_path), "--ready-file", str(tmp_path / "r")],
        cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)}, capture_output=True, text=True, timeout=DEADLINE_S,
    )
    assert proc.returncode == 2
    assert "missing key(s)" in proc.stderr
