"""The processor gives a restarted proxy an execution's logged CallRecords back: from its log, in
log order, once each, after its own restart too, and never those of a sealed execution."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from base import wire
from tests.trajectory import Run
from tests.trajectory.test_processor import processor
from trajectory.delivery import ProcessorService
from trajectory.log import AppendLog


def service(path: Path) -> ProcessorService:
    s = ProcessorService(processor(), AppendLog(path, fsync=False))
    s.replay()
    return s


def ask(s: ProcessorService, execution_id: str) -> tuple[list[wire.CallRecord], wire.SessionReplayEnd]:
    request = wire.encode(wire.SessionReplayRequest(execution_id=execution_id))
    rest, answers = s.session_replays([(b"proxy", request)])
    assert rest == [] and all(ident == b"proxy" for ident, _ in answers)
    msgs = [wire.decode(frame) for _, frame in answers]
    *records, end = msgs
    assert isinstance(end, wire.SessionReplayEnd) and end.num_records == len(records)
    return records, end  # type: ignore[return-value]


def frames(records) -> list[tuple[bytes, bytes]]:
    return [(b"proxy", wire.encode(r)) for r in records]


def test_an_executions_records_come_back_as_logged_after_a_processor_restart_too(tmp_path: Path):
    a, b = Run("ex-a"), Run("ex-b")
    ctx = a.call([1, 2, 3], [10, 11])
    b.call([4, 5], [20])
    a.call(ctx + [4], [12], lineage="sub-agent", agent_id="sub-1")
    s = service(tmp_path / "p.log")
    batch = frames(a.records[:1]) + frames(b.records) + frames(a.records[1:]) + frames(a.records[:1])  # a resend
    rest, answers = s.session_replays(batch)
    assert rest == batch and answers == []  # records are left for take_records, untouched
    s.take_records(rest)
    records, end = ask(s, "ex-a")
    assert records == a.records and not end.sealed  # each call once, in log order, byte for byte
    assert ask(s, "ex-new")[0] == []  # an execution the processor never saw: nothing, said at once

    s.log.close()
    again = service(tmp_path / "p.log")  # the processor restarted: the index comes back from its log
    assert ask(again, "ex-a")[0] == a.records and ask(again, "ex-b")[0] == b.records


def test_a_sealed_execution_is_answered_sealed_with_no_records(tmp_path: Path):
    run = Run("ex-a")
    run.call([1, 2], [3])
    s = service(tmp_path / "p.log")
    s.take_records(frames(run.records) + [(b"proxy", wire.encode(run.sealed()))])
    records, end = ask(s, "ex-a")
    assert records == [] and end.sealed


def test_a_replay_request_is_answered_after_the_records_of_its_own_batch(tmp_path: Path):
    run = Run("ex-a")
    run.call([1, 2], [3])
    s = service(tmp_path / "p.log")
    request = (b"proxy", wire.encode(wire.SessionReplayRequest(execution_id="ex-a")))
    rest, answers = s.session_replays(frames(run.records) + [request])
    s.take_records(rest)  # the serve loop: log the batch, then answer (session_replays reads the index now)
    rest, answers = s.session_replays([request])
    assert [wire.decode(f) for _, f in answers][:-1] == run.records


def test_a_bad_replay_request_is_rejected_and_not_logged(tmp_path: Path):
    s = service(tmp_path / "p.log")
    bad = wire.encode(wire.SessionReplayRequest(execution_id="x"))[:-3] + b"\xc1\xc1\xc1"
    rest, answers = s.session_replays([(b"proxy", bad)])
    assert rest == [] and answers == [] and s.counters.num_rejected == 1
    assert dataclasses.asdict(s.counters)["num_records"] == 0
