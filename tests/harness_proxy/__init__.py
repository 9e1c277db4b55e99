"""Shared pieces of the proxy tests: an event loop in a thread, a scripted engine, a live proxy.

The engine is a real aiohttp server speaking SGLang's native ``/generate`` and ``/abort_request``
(the real engines are built elsewhere; this one plays back scripted outputs). The proxy is the
real ``ProxyServer`` with its real ZMQ record sink; tests receive CallRecords on the processor's
real ``RecordInbox`` (a ROUTER), acknowledged as they come in unless a test holds the
acknowledgements back, and decode them with ``base.wire``. Clients are the official ``openai`` SDK and
``http.client``, from the test thread.
"""

from __future__ import annotations

import asyncio
import dataclasses
import queue
import tempfile
import threading
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import openai
import zmq
import zmq.asyncio
from aiohttp import web

from base import wire
from base.typed_config import build
from base.execution_token import mint_token
from harness_proxy.config import ProxyConfig
from harness_proxy.record_sink import ZmqRecordSink
from harness_proxy.server import ProxyServer
from base.tokenizer import get_tokenizer
from base.algo_config import RolloutSampling
from trajectory.inbox import RecordInbox
from trajectory.log import AppendLog
from trajectory.session_replay import SessionIndex, split_requests

SECRET = b"test-secret-0123456789abcdef"
TOK = get_tokenizer("qwen_compact", 4096)

PROXY_CONFIG = {
    "host": "127.0.0.1", "port": 0, "model_name": "gyre-policy", "max_request_bytes": 65536, "read_timeout_s": 30.0,
    "max_context_tokens": 2048, "max_new_tokens_cap": 64, "truncation_ends_turn": False, "engine_timeout_s": 20.0,
    "retry_attempts": 3, "route_wait_s": 0.3, "affinity_slack": 0, "affinity_min_prefix": 1024, "record_ack_timeout_s": 10.0, "record_resend_s": 0.5,
    "max_unacked_record_bytes": 1 << 30, "session_memory_bytes": 64 << 20, "max_session_bytes": 8 << 30,
    "execution_budget": {"max_calls": 2000, "max_tokens": 50_000_000, "max_wall_s": 14400.0, "max_concurrent_calls": 8},
}


ROLLOUT = {"temperature": 1.0, "top_p": 1.0, "top_k": -1}
"""algo.rollout as conf/algo/gspo.yaml has it: what training executions sample at."""


def proxy_config(**overrides: Any) -> ProxyConfig:
    return build(ProxyConfig, {**PROXY_CONFIG, **overrides})


class LoopThread:
    """An asyncio loop on a daemon thread; ``run`` a coroutine or ``call`` a function on it."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name="test-loop", daemon=True)
        self._thread.start()

    def run(self, coro: Any, timeout_s: float = 30.0) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout_s)

    def call(self, fn: Callable[..., Any], *args: Any) -> Any:
        async def wrapper() -> Any:
            return fn(*args)

        return self.run(wrapper())

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(10)
        self.loop.close()


# ---------------------------------------------------------------- the engine double


def text_ids(text: str) -> list[int]:
    return TOK.encode(text)


@dataclass
class Step:
    """One scripted engine answer."""

    output_ids: list[int] = field(default_factory=lambda: text_ids("ok") + [TOK.im_end])
    finish: str = "stop"
    status: int = 200
    hang: bool = False
    """Wait until /abort_request names this request, then answer with an abort finish."""
    until: asyncio.Event | None = None
    """A slow engine: hold the answer until this is set (on the test loop), then answer as scripted."""


class ScriptedEngine:
    """A real HTTP server speaking SGLang's native generate API, playing back ``script``."""

    def __init__(self, cell_id: int, *, weight_version: int = 3):
        self.cell_id = cell_id
        self.weight_version = weight_version
        self.script: deque[Step] = deque()
        self.policy: Callable[[list[int]], Step] | None = None
        """When set, answers come from ``policy(input_ids)`` instead of ``script``."""
        self.requests: list[dict[str, Any]] = []
        self.aborted: list[str] = []
        self.url = ""
        self.hanging = asyncio.Event()
        self._abort_events: dict[str, asyncio.Event] = {}
        self._runner: web.AppRunner | None = None

    def route(self) -> wire.EngineRoute:
        return wire.EngineRoute(cell_id=self.cell_id, url=self.url, weight_version=self.weight_version)

    async def start(self) -> str:
        app = web.Application(client_max_size=64 * 1024 * 1024)
        app.router.add_post("/generate", self._generate)
        app.router.add_post("/abort_request", self._abort)
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        port = self._runner.addresses[0][1]
        self.url = f"http://127.0.0.1:{port}"
        return self.url

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()

    async def _abort(self, request: web.Request) -> web.Response:
        rid = (await request.json())["rid"]
        self.aborted.append(rid)
        if rid in self._abort_events:
            self._abort_events[rid].set()
        return web.Response(status=200)

    async def _generate(self, request: web.Request) -> web.Response:
        body = await request.json()
        assert isinstance(body["input_ids"], list) and body["return_logprob"] is True
        assert set(body["sampling_params"]) <= {"max_new_tokens", "temperature", "top_p", "top_k", "stop_token_ids"}
        self.requests.append(body)
        if self.policy is not None:
            step = self.policy(body["input_ids"])
        else:
            step = self.script.popleft() if self.script else Step()
        if step.status != 200:
            return web.json_response({"error": {"message": "engine unavailable"}}, status=step.status)
        if step.hang:
            event = self._abort_events.setdefault(body["rid"], asyncio.Event())
            self.hanging.set()
            await event.wait()
            return web.json_response(self._answer([], {"type": "abort", "message": "Abort before prefill"}))
        if step.until is not None:
            await step.until.wait()
        ids = step.output_ids[: body["sampling_params"]["max_new_tokens"]]
        if step.finish == "abort":
            finish: dict[str, Any] = {"type": "abort", "message": "draining"}
        elif step.finish == "length" or len(ids) < len(step.output_ids):
            finish = {"type": "length", "length": len(ids)}
        else:
            finish = {"type": "stop", "matched": ids[-1] if ids else TOK.im_end}
        return web.json_response(self._answer(ids, finish, prompt_tokens=len(body["input_ids"])))

    def _answer(self, ids: list[int], finish: dict[str, Any], prompt_tokens: int = 0) -> dict[str, Any]:
        return {
            "output_ids": ids,
            "meta_info": {
                "id": "x", "finish_reason": finish, "weight_version": str(self.weight_version),
                "prompt_tokens": prompt_tokens, "completion_tokens": len(ids),
                "output_token_logprobs": [[-0.25 - (i % 3) * 0.5, t, None] for i, t in enumerate(ids)],
            },
        }


# ---------------------------------------------------------------- a live proxy


class AckingInbox:
    """The processor's real ``RecordInbox`` on a thread that logs each record as it comes in (the
    processor's real ``AppendLog``), acknowledges it and queues it for ``recv``, and answers a
    proxy's session replay from that log with the processor's own ``SessionIndex``. Clear ``acking``
    to play a processor that is down: what arrives meanwhile is dropped unacknowledged, as a dead
    process would drop it."""

    def __init__(self, ctx: zmq.Context):
        self.inbox = RecordInbox(ctx, "tcp://127.0.0.1:0", only=None)
        self.addr = self.inbox.addr
        self.records: queue.Queue[wire.Message] = queue.Queue()
        self.acking = threading.Event()
        self.acking.set()
        self.num_dropped = 0
        self.num_duplicates = 0
        self._seen: set[tuple[str, str]] = set()
        self._dir = tempfile.TemporaryDirectory(prefix="gyre-acking-inbox-")
        self.log = AppendLog(Path(self._dir.name) / "records.log", fsync=False)
        self.sessions = SessionIndex(self.log)
        self.sealed: set[str] = set()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._take_records, daemon=True)
        self._thread.start()

    def _take_records(self) -> None:
        while not self._stop.is_set():
            if not self.inbox.poll(20):
                continue
            batch = self.inbox.drain(512)
            if not self.acking.is_set():
                self.num_dropped += len(batch)
                continue
            batch, requests = split_requests(batch, _replay_request)
            msgs = [(ident, wire.decode(frame)) for ident, frame in batch]
            for (_, msg), offset in zip(msgs, self.log.append_many(frame for _, frame in batch)):
                self.sessions.logged(msg, offset)
                if isinstance(msg, wire.ExecutionSealed):
                    self.sealed.add(msg.execution_id)
            self.inbox.ack(msgs)  # type: ignore[arg-type]
            self.inbox.send([[ident, frame] for ident, req in requests
                             for frame in self.sessions.answer(req, self.sealed.__contains__)])
            for _, msg in msgs:
                # A resend of a record that did land (its ack was late) is acknowledged again and
                # dropped by its key, as the processor drops it (trajectory/inbox.py, processor.py).
                key = wire.record_key(msg)
                if key in self._seen:
                    self.num_duplicates += 1
                    continue
                self._seen.add(key)
                self.records.put(msg)

    def recv(self, timeout_ms: int = 10_000) -> wire.Message:
        try:
            return self.records.get(timeout=timeout_ms / 1000)
        except queue.Empty:
            raise AssertionError("no message from the proxy") from None

    def recv_all(self, settle_ms: int = 200) -> list[wire.Message]:
        out = []
        while True:
            try:
                out.append(self.records.get(timeout=settle_ms / 1000))
            except queue.Empty:
                return out

    def close(self) -> None:
        self._stop.set()
        self._thread.join()
        self.inbox.close()
        self.log.close()
        self._dir.cleanup()


def _replay_request(frame: bytes) -> wire.SessionReplayRequest | bool:
    try:
        msg = wire.decode(frame, expect=(wire.SessionReplayRequest,))
    except wire.ProtocolError:
        return False  # a record (the test fails on a bad one where it decodes it)
    return msg  # type: ignore[return-value]



class LiveProxy:
    """A started ProxyServer with ``num_engines`` scripted engines and an ``AckingInbox``."""

    def __init__(self, *, num_engines: int = 2, rollout: dict[str, Any] | None = None, **cfg_overrides: Any):
        self.rollout = build(RolloutSampling, rollout or ROLLOUT)
        self.lt = LoopThread()
        self.ctx = zmq.Context()
        self.inbox = AckingInbox(self.ctx)
        self.records_addr = self.inbox.addr
        self.recv, self.recv_all = self.inbox.recv, self.inbox.recv_all
        self.cfg = proxy_config(**cfg_overrides)
        self.engines = [ScriptedEngine(cell_id=i) for i in range(num_engines)]
        self.routing_version = 0
        self.server: ProxyServer = self.lt.run(self._start())
        self.url = self.server.url
        self.set_routes(self.engines)

    async def _start(self) -> ProxyServer:
        for e in self.engines:
            await e.start()
        self.azctx = zmq.asyncio.Context()
        self.sink = ZmqRecordSink(self.azctx, self.records_addr, resend_s=self.cfg.record_resend_s)
        self.sink.start()
        server = ProxyServer(self.cfg, tokenizer=TOK, rollout=self.rollout, secret=SECRET, sink=self.sink)
        await server.start()
        return server

    def restart(self, while_stopping: Callable[[], None] | None = None) -> None:
        """Stop this proxy and start a new one on the same port, with the same processor: what the old
        one held in memory (sessions, call counts) is gone, as after a crash. ``while_stopping`` runs on
        the loop once the old proxy has stopped listening (its calls in flight may still finish)."""
        async def go() -> ProxyServer:
            stopping = asyncio.ensure_future(self.server.stop())
            await asyncio.sleep(0.2)
            if while_stopping is not None:
                while_stopping()
            await stopping
            await self.sink.close(timeout_s=1)
            port = int(self.url.rsplit(":", 1)[1])
            self.sink = ZmqRecordSink(self.azctx, self.records_addr, resend_s=self.cfg.record_resend_s)
            self.sink.start()
            server = ProxyServer(dataclasses.replace(self.cfg, port=port), tokenizer=TOK, rollout=self.rollout,
                                 secret=SECRET, sink=self.sink)
            await server.start()
            return server

        self.server = self.lt.run(go())
        assert self.server.url == self.url
        self.routing_version += 1
        self.set_routes(self.engines)

    def set_routes(self, engines: list[ScriptedEngine]) -> None:
        self.routing_version += 1
        table = wire.RoutingTable(version=self.routing_version, engines=[e.route() for e in engines])
        assert self.lt.call(self.server.apply_routing_table, table)

    def seal(self, execution_id: str) -> int:
        return self.lt.call(self.server.seal, execution_id)

    def client(self, execution_id: str = "ex-1", *, token: str | None = None) -> openai.OpenAI:
        return openai.OpenAI(
            base_url=f"{self.url}/v1", api_key=token or mint_token(SECRET, execution_id), max_retries=0, timeout=30,
        )

    def close(self) -> None:
        async def stop() -> None:
            await self.server.stop()
            await self.sink.close(timeout_s=1)
            for e in self.engines:
                await e.stop()
            self.azctx.term()

        self.lt.run(stop())
        self.lt.close()
        self.inbox.close()
        self.ctx.term()
