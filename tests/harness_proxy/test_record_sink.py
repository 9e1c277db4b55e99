"""Records reach the processor's log before the harness hears back, and none is lost while the
processor is down: the live proxy against the processor's real ``RecordInbox``, acknowledgements
held back to play a dead processor."""

from __future__ import annotations

import asyncio
import threading
import time

import openai
import pytest
import zmq
import zmq.asyncio

from base import wire
from harness_proxy.record_sink import ZmqRecordSink
from tests.harness_proxy import LiveProxy
from tests.harness_proxy.test_server import get_raw
from trajectory.inbox import RecordInbox

HI = [{"role": "user", "content": "hi"}]


def call_in_thread(proxy: LiveProxy, execution_id: str) -> tuple[threading.Thread, dict]:
    out: dict = {}

    def go() -> None:
        try:
            out["reply"] = proxy.client(execution_id).chat.completions.create(model="m", messages=HI)
        except Exception as exc:  # the test reads it
            out["error"] = exc

    t = threading.Thread(target=go)
    t.start()
    return t, out


def open_execution(proxy: LiveProxy, execution_id: str) -> None:
    """One call while the processor is up: the proxy has read the execution's (empty) log, so a
    later call's only wait is for its own record."""
    proxy.client(execution_id).chat.completions.create(model="m", messages=[{"role": "user", "content": "first"}])
    assert isinstance(proxy.recv(), wire.CallRecord)


def test_a_call_is_answered_only_once_its_record_is_in_the_log_and_survives_a_dead_processor():
    proxy = LiveProxy(record_resend_s=0.3)
    try:
        open_execution(proxy, "ex-1")
        proxy.inbox.acking.clear()  # the processor is down: what reaches it is lost
        t, out = call_in_thread(proxy, "ex-1")
        t.join(1.5)
        assert t.is_alive() and not out, "the harness heard back before its record was acknowledged"
        assert proxy.inbox.num_dropped >= 2  # sent, then resent
        _, stats = get_raw(proxy.url, "/stats")
        assert stats["records"]["unacked"] == 1 and stats["records"]["resent"] >= 1
        proxy.inbox.acking.set()  # the processor is back (same address): the resend lands
        t.join(10)
        assert "reply" in out, out
        got = proxy.recv_all(settle_ms=800)  # a resend already on its way may land twice
        assert {m.call_id for m in got} == {out["reply"].id}
        assert all(isinstance(m, wire.CallRecord) and m.execution_id == "ex-1" for m in got)
        assert get_raw(proxy.url, "/stats")[1]["records"]["unacked"] == 0
    finally:
        proxy.close()


def test_a_processor_that_stays_down_gets_retriable_errors_then_refusals_not_unbounded_memory():
    proxy = LiveProxy(record_resend_s=0.3, record_ack_timeout_s=1.0, max_unacked_record_bytes=1)
    try:
        open_execution(proxy, "ex-1")
        proxy.inbox.acking.clear()
        with pytest.raises(openai.InternalServerError) as first:
            proxy.client("ex-1").chat.completions.create(model="m", messages=HI)
        assert first.value.status_code == 503 and "not yet recorded" in str(first.value)
        engine_calls = sum(len(e.requests) for e in proxy.engines)
        with pytest.raises(openai.InternalServerError) as second:  # over the backlog: refused up front
            proxy.client("ex-2").chat.completions.create(model="m", messages=HI)
        assert "processor is behind" in str(second.value)
        assert sum(len(e.requests) for e in proxy.engines) == engine_calls  # no engine time spent
        assert get_raw(proxy.url, "/stats")[1]["records"]["refused_backlog"] == 1
        proxy.inbox.acking.set()
        got = proxy.recv(timeout_ms=5000)  # the first call's record still lands: it was held
        assert isinstance(got, wire.CallRecord) and got.execution_id == "ex-1"
        deadline = time.monotonic() + 5
        while get_raw(proxy.url, "/stats")[1]["records"]["unacked"] and time.monotonic() < deadline:
            time.sleep(0.05)
        reply = proxy.client("ex-2").chat.completions.create(model="m", messages=HI)  # room again
        assert reply.choices[0].message.content == "ok"
    finally:
        proxy.close()


def test_a_seal_goes_out_only_after_every_record_of_its_execution_is_acknowledged():
    async def scenario() -> list[str]:
        ctx, actx = zmq.Context(), zmq.asyncio.Context()
        inbox = RecordInbox(ctx, "tcp://127.0.0.1:0", only=None)
        sink = ZmqRecordSink(actx, inbox.addr, resend_s=60.0)
        sink.start()
        seen: list[str] = []

        async def take(n: int) -> list[tuple[bytes, wire.Message]]:
            got: list[tuple[bytes, wire.Message]] = []
            deadline = time.monotonic() + 5
            while len(got) < n and time.monotonic() < deadline:
                got += [(i, wire.decode(f)) for i, f in inbox.drain(10)]
                await asyncio.sleep(0.01)
            seen.extend(type(m).__name__ for _, m in got)
            return got

        try:
            record = wire.CallRecord(
                execution_id="ex", call_id="c0", call_index=0, prompt_ids=[1], output_ids=[2], output_logprobs=[-0.1],
                weight_version=0, cell_id=0, finish_reason="stop", started_at=0.0, finished_at=0.0)
            rec_done = sink.put(record)
            seal_done = sink.put(wire.ExecutionSealed(execution_id="ex", num_calls=1))
            first = await take(2)  # only the record comes
            assert [type(m) for _, m in first] == [wire.CallRecord]
            assert sink.num_unacked == 2 and not rec_done.done()
            inbox.ack(first)  # type: ignore[arg-type]
            await asyncio.wait_for(rec_done, 5)
            second = await take(1)  # now the seal
            assert [m for _, m in second] == [wire.ExecutionSealed(execution_id="ex", num_calls=1)]
            assert not seal_done.done()
            inbox.ack(second)  # type: ignore[arg-type]
            await asyncio.wait_for(seal_done, 5)
            assert (sink.num_unacked, sink.backlog_bytes) == (0, 0)
            return seen
        finally:
            await sink.close(timeout_s=0.1)
            inbox.close()
            actx.term()
            ctx.term()

    assert asyncio.run(scenario()) == ["CallRecord", "ExecutionSealed"]
