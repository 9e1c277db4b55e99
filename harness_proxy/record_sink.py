"""The proxy's end of the record stream to the trajectory processor, acknowledged end to end.

Every CallRecord and ``ExecutionSealed`` is kept until the processor answers ``RecordsAck`` for it
(``trajectory.inbox``: the processor acknowledges what is in its log), and sent again while it is
not. So a processor killed and restarted on the same address loses nothing: what it logged it
replays, what it did not the proxy resends, and it drops duplicates by ``wire.record_key``.

- ``put`` queues a message in order; its future completes once the processor has it logged. The
  server answers a harness only then (persist, then acknowledge).
- A seal goes out only once every earlier record of its execution is acknowledged: the processor
  reads a seal as "no more calls", so a record resent after it would arrive late and cut the run.
- What is unacknowledged after ``resend_s`` is sent again, oldest first.
- ``backlog_bytes`` is what is held; the server refuses new calls above its limit (503, which the
  Anthropic API calls 529) rather than hold records without bound.
- ``replay`` asks the processor for an execution's logged CallRecords (``SessionReplayRequest``) and
  resolves with them once ``SessionReplayEnd`` says all came (``trajectory.session_replay``): a
  restarted proxy rebuilds the execution's sessions from them before it answers its next call.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Protocol

import zmq
import zmq.asyncio

from base import curve, wire

log = logging.getLogger(__name__)

RECORD_SNDHWM = 100_000
"""Frames queued on the processor socket before a send waits (back-pressure, never a drop)."""


class RecordSink(Protocol):
    backlog_bytes: int
    num_resent: int

    @property
    def num_unacked(self) -> int: ...

    def put(self, msg: wire.CallRecord | wire.ExecutionSealed) -> asyncio.Future[None]:
        """Queue ``msg`` behind everything put before; the future completes once the processor has
        it (in its log)."""
        ...

    def replay(self, execution_id: str) -> asyncio.Future[SessionReplay]:
        """The execution's CallRecords as the processor logged them (see the module docstring)."""
        ...


@dataclass(frozen=True)
class SessionReplay:
    records: list[wire.CallRecord]
    """In log order, one per call id."""
    sealed: bool


@dataclass
class _Replay:
    future: asyncio.Future[SessionReplay]
    records: list[wire.CallRecord] = field(default_factory=list)
    """Of the answer now arriving."""
    num_asked: int = 0
    """Requests out and not yet answered by a ``SessionReplayEnd``."""
    asked_at: float = 0.0


@dataclass
class _Pending:
    frame: bytes
    future: asyncio.Future[None]
    sent_at: float | None  # None: a seal held until its execution's records are acknowledged


class ZmqRecordSink:
    """A DEALER connected to the processor's records ROUTER; see the module docstring."""

    def __init__(self, ctx: zmq.asyncio.Context, addr: str, *, resend_s: float = 2.0):
        self._sock = ctx.socket(zmq.DEALER)
        self._sock.setsockopt(zmq.SNDHWM, RECORD_SNDHWM)
        self._sock.setsockopt(zmq.RCVHWM, RECORD_SNDHWM)  # a session replay comes one frame per call
        self._sock.setsockopt(zmq.LINGER, 0)  # close() waits for acknowledgements, not for ZMQ
        curve.client(self._sock, "processor")  # no-op unless this process installed the run's keys
        self._sock.connect(addr)
        self.addr = addr
        self.resend_s = resend_s
        self._pending: dict[tuple[str, str], _Pending] = {}  # insertion order = send order
        self._open_records: Counter[str] = Counter()  # execution -> its unacknowledged records
        self._queue: asyncio.Queue[bytes] = asyncio.Queue()
        self._tasks: list[asyncio.Task[None]] = []
        self.backlog_bytes = 0
        self.num_acked = 0
        self.num_resent = 0
        self.num_bad_acks = 0
        self._replays: dict[str, _Replay] = {}
        self.num_replays = 0

    def start(self) -> None:
        loop = asyncio.get_running_loop()
        self._tasks = [loop.create_task(coro, name=name) for name, coro in (
            ("record-send", self._send_loop()), ("record-acks", self._ack_loop()),
            ("record-resend", self._resend_loop()))]

    @property
    def num_unacked(self) -> int:
        return len(self._pending)

    def put(self, msg: wire.CallRecord | wire.ExecutionSealed) -> asyncio.Future[None]:
        key = wire.record_key(msg)
        held = self._pending.get(key)
        if held is not None:  # a seal asked for again while the first is unacknowledged
            return held.future
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        if not self._tasks or any(t.done() for t in self._tasks):
            fut.set_exception(ConnectionError(f"record sink to {self.addr} is not running"))
            return fut
        frame = wire.encode(msg)
        entry = self._pending[key] = _Pending(frame, fut, sent_at=None)
        self.backlog_bytes += len(frame)
        if isinstance(msg, wire.CallRecord):
            self._open_records[msg.execution_id] += 1
            self._send(entry)
        elif not self._open_records[msg.execution_id]:
            self._send(entry)
        return fut

    def replay(self, execution_id: str) -> asyncio.Future[SessionReplay]:
        held = self._replays.get(execution_id)
        if held is not None and not held.future.done():
            return held.future
        fut: asyncio.Future[SessionReplay] = asyncio.get_running_loop().create_future()
        if not self._tasks or any(t.done() for t in self._tasks):
            fut.set_exception(ConnectionError(f"record sink to {self.addr} is not running"))
            return fut
        held = self._replays[execution_id] = _Replay(fut)
        self._ask_replay(execution_id, held)
        return fut

    def _ask_replay(self, execution_id: str, held: _Replay) -> None:
        held.asked_at = time.monotonic()
        held.num_asked += 1
        self._queue.put_nowait(wire.encode(wire.SessionReplayRequest(execution_id=execution_id)))

    def _on_replayed(self, msg: wire.CallRecord | wire.SessionReplayEnd) -> None:
        """Frames answering replay requests, in order: each answer's records, then its end."""
        held = self._replays.get(msg.execution_id)
        if held is None:
            return  # not asked for (any more)
        if isinstance(msg, wire.CallRecord):
            held.records.append(msg)
            return
        held.num_asked -= 1
        records, held.records = held.records, []
        if len(records) != msg.num_records and held.num_asked > 0:
            return  # frames of this answer were lost, and another request is out: wait for its answer
        del self._replays[msg.execution_id]
        if held.future.done():
            return
        if len(records) != msg.num_records:
            held.future.set_exception(ConnectionError(
                f"session replay of {msg.execution_id}: {len(records)} of {msg.num_records} records arrived"))
            return
        self.num_replays += 1
        held.future.set_result(SessionReplay(list({r.call_id: r for r in records}.values()), msg.sealed))

    def _send(self, entry: _Pending) -> None:
        entry.sent_at = time.monotonic()
        self._queue.put_nowait(entry.frame)

    def on_ack(self, ack: wire.RecordsAck) -> None:
        for key in zip(ack.execution_ids, ack.call_ids):
            entry = self._pending.pop(key, None)
            if entry is None:
                continue  # acknowledged twice (a resend of a frame that had landed)
            self.backlog_bytes -= len(entry.frame)
            self.num_acked += 1
            if not entry.future.done():
                entry.future.set_result(None)
            execution_id, call_id = key
            if call_id:
                self._open_records[execution_id] -= 1
                if self._open_records[execution_id] <= 0:
                    del self._open_records[execution_id]
                    seal = self._pending.get((execution_id, ""))
                    if seal is not None and seal.sent_at is None:
                        self._send(seal)

    async def _send_loop(self) -> None:
        while True:
            frame = await self._queue.get()
            try:
                await self._sock.send(frame, copy=False)
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # a ZMQ error: the resend loop tries again
                log.error("record send to %s failed: %s", self.addr, exc)

    async def _ack_loop(self) -> None:
        while True:
            frame = await self._sock.recv()
            try:
                msg = wire.decode(frame, expect=(wire.RecordsAck, wire.CallRecord, wire.SessionReplayEnd))
            except wire.ProtocolError as exc:
                self.num_bad_acks += 1
                log.error("records socket: not an acknowledgement or a session replay (%s); ignored", exc)
                continue
            if isinstance(msg, wire.RecordsAck):
                self.on_ack(msg)
            else:
                self._on_replayed(msg)  # type: ignore[arg-type]

    async def _resend_loop(self) -> None:
        while True:
            await asyncio.sleep(self.resend_s / 2)
            self.resend_due(time.monotonic())

    def resend_due(self, now: float) -> int:
        """Send again, oldest first, what went out ``resend_s`` ago without an acknowledgement."""
        due = [e for e in self._pending.values() if e.sent_at is not None and now - e.sent_at >= self.resend_s]
        for entry in due:
            self._send(entry)
        for execution_id, held in list(self._replays.items()):  # a processor restarting: ask again
            if held.future.done():
                del self._replays[execution_id]
            elif now - held.asked_at >= self.resend_s:
                self._ask_replay(execution_id, held)
        if due:
            self.num_resent += len(due)
            log.warning("resending %d record(s) the processor has not acknowledged in %.1fs (%d held, %d bytes)",
                        len(due), self.resend_s, len(self._pending), self.backlog_bytes)
        return len(due)

    async def close(self, *, timeout_s: float = 10.0) -> None:
        """Wait (up to ``timeout_s``) for what is held to be acknowledged, then close."""
        deadline = time.monotonic() + timeout_s
        while self._pending and time.monotonic() < deadline and self._tasks and not any(t.done() for t in self._tasks):
            await asyncio.sleep(0.01)
        if self._pending:
            log.error("record sink closing with %d message(s) unacknowledged", len(self._pending))
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        for entry in self._pending.values():
            if not entry.future.done():
                entry.future.set_exception(ConnectionError("record sink closed"))
        for held in self._replays.values():
            if not held.future.done():
                held.future.set_exception(ConnectionError("record sink closed"))
        self._sock.close()
