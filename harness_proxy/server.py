"""The proxy's HTTP face: harness calls in, engine calls out, one CallRecord per successful call.

``POST /v1/chat/completions`` walks: bearer token -> execution id (refused once sealed) -> body
(size-capped) -> validated request -> prompt ids (``SessionStore``: the engine's exact ids for
echoed turns) -> an engine from the ``Router`` (retried on other engines while a cell drains) ->
CallRecord pushed to the trajectory processor -> only then the HTTP response (persist, then
acknowledge). A harness that hangs up mid-call gets its engine request aborted and a record
with ``finish_reason="abort"`` and no output says so. ``seal`` revokes an execution and queues ``ExecutionSealed`` behind its last record.

Abuse is refused in the API's own error shape, counted per kind and logged once per source
(``harness_proxy.abuse``; counters at ``GET /stats``): a request head or body not in within
``proxy.read_timeout_s`` (408, the connection closed), a body over ``proxy.max_request_bytes``
(413, refused from its Content-Length before any of it is read, or once that many bytes of a
chunked body are in), a missing or foreign token, or a sealed execution's (401: the token is not,
or no longer, valid, as both APIs answer for a revoked key; 403 would say a valid key lacks a
permission). Sealed executions are held in bounded memory (``auth.Revocations``). An execution
over its budget (``proxy.execution_budget``: calls, tokens, wall time, calls at once) is refused
before any engine time: 403 once a budget is used up, 429 while too many of its calls are at an
engine (``harness_proxy.budget``, which also says what a proxy restarted in place forgets).

One asyncio event loop owns everything here; the control plane (``harness_proxy.main``) calls
``apply_routing_table`` and ``seal`` on the same loop.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import socket
import time
from typing import Any

from aiohttp import web

from base import wire
from harness_proxy import anthropic_api
from harness_proxy.abuse import AbuseLog, ConnectionGuard, peer_of
from base.execution_token import verify_token
from harness_proxy.auth import Revocations, bearer_token
from harness_proxy.budget import budget_refusal
from harness_proxy.call_state import LiveExecution, PlannedCall
from harness_proxy.config import ProxyConfig
from harness_proxy.engine_client import EngineClient, EngineResult
from harness_proxy.memory import TrimAfterSeals
from harness_proxy.openai_api import (
    ApiError, ChatRequest, completion_body, finish_reason, models_body, new_call_id, parse_chat_request,
    reply_message, stream_events, usage,
)
from harness_proxy.record_sink import RecordSink
from harness_proxy.routing import Router
from harness_proxy.sessions import SessionStore
from harness_proxy.template import ParsedOutput, parse_output, render_messages
from base.tokenizer import QwenTokenizer
from base.algo_config import RolloutSampling

log = logging.getLogger(__name__)

SHUTDOWN_TIMEOUT_S = 5.0
MAX_REVOKED_EXECUTIONS = 65_536
"""Sealed executions held exactly (about 150 bytes each); past them ``auth.Revocations`` evicts by floor."""
CALL_ID_HEADER = "x-gyre-call-id"
EXECUTION_TOKEN_HEADER = "x-gyre-execution-token"


# ---------------------------------------------------------------- the server


class PromptTooLong(ApiError):
    def __init__(self, num_prompt: int, limit: int):
        super().__init__(
            400, f"This model's maximum context length is {limit} tokens. However, your messages resulted in "
            f"{num_prompt} tokens. Please reduce the length of the messages.",  # OpenAI's own words
            param="messages", code="context_length_exceeded",
        )
        self.num_prompt = num_prompt
        self.limit = limit


class Refusal(ApiError):
    """An ``ApiError`` that is abuse (``abuse.KINDS``): counted, and logged once per ``source``."""

    def __init__(self, status: int, message: str, *, kind: str, source: str, code: str | None = None,
                 close: bool = False, type: str = "invalid_request_error"):
        super().__init__(status, message, code=code, type=type)
        self.kind = kind
        self.source = source
        self.close = close
        """Close the connection once the refusal is written (its request is not whole)."""


class ProxyServer:
    """One proxy: the aiohttp app, the router, the sessions, the record sink."""

    def __init__(
        self, cfg: ProxyConfig, *, tokenizer: QwenTokenizer, secret: bytes, sink: RecordSink,
        rollout: RolloutSampling,
        max_revoked: int = MAX_REVOKED_EXECUTIONS, engine_api_key: str = "",
    ):
        """``engine_api_key``: the run's engine key (``base.engine_key``), sent to every engine.
        ``rollout``: what training executions sample at (``algo.rollout``), whatever the harness asks."""
        if not secret:
            raise ValueError("secret: empty")
        self.cfg = cfg
        self.tok = tokenizer
        self.rollout = rollout
        self.sink = sink
        self.router = Router(affinity_slack=cfg.affinity_slack, min_prefix=cfg.affinity_min_prefix)
        self.sessions = SessionStore(tokenizer, memory_bytes=cfg.session_memory_bytes)
        self.minted = anthropic_api.MintedToolUses()
        self.url = ""
        self._secret = secret
        self._executions: dict[str, LiveExecution] = {}
        self.revoked = Revocations(max_revoked)
        self.abuse = AbuseLog()
        self.guard = ConnectionGuard(read_timeout_s=cfg.read_timeout_s, abuse=self.abuse)
        self.num_records = 0
        self.num_refused_backlog = 0
        self.num_refused_sessions = 0
        self.num_restored_executions = 0
        self.num_restored_calls = 0
        self._opening: dict[str, asyncio.Future[LiveExecution]] = {}
        self.trim = TrimAfterSeals()
        self._min_version: dict[str, int] = {}  # execution id -> oldest weight version it accepts (its token)
        self._evals: set[str] = set()  # live executions whose token says eval: the harness's sampling stands
        self.engine = EngineClient(cfg, self.router, min_version=lambda eid: self._min_version.get(eid, 0),
                                   engine_api_key=engine_api_key)
        self._runner: web.AppRunner | None = None

    # ------------------------------------------------------------ lifecycle

    def make_app(self) -> web.Application:
        app = web.Application(client_max_size=self.cfg.max_request_bytes, middlewares=[self.guard.middleware])
        app.router.add_post("/v1/chat/completions", self._chat_completions)
        app.router.add_post("/v1/messages", self._messages)
        app.router.add_post("/v1/messages/count_tokens", self._count_tokens)
        app.router.add_route("HEAD", "/", self._hello)
        app.router.add_route("HEAD", "/api/hello", self._hello)
        app.router.add_get("/v1/models", self._models)
        app.router.add_get("/health", self._health)
        app.router.add_get("/stats", self._stats)
        return app

    async def start(self) -> str:
        """Listen on cfg.host:cfg.port (0: a free port); return the base URL."""
        self.engine.start()
        # handler_cancellation: a harness that hangs up cancels its handler, which aborts the engine call.
        # The guard's runner: every site (this TCP one, main's Unix socket) drops slow request heads.
        self._runner = self.guard.runner(
            self.make_app(), handler_cancellation=True, shutdown_timeout=SHUTDOWN_TIMEOUT_S, access_log=None
        )
        await self._runner.setup()
        sock = socket.socket(socket.AF_INET6 if ":" in self.cfg.host else socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((self.cfg.host, self.cfg.port))
        await web.SockSite(self._runner, sock).start()
        port = sock.getsockname()[1]
        host = self.cfg.host
        if host in ("0.0.0.0", "::", ""):
            host = socket.gethostname()
        self.url = f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"
        log.info("proxy listening on %s (model %s)", self.url, self.cfg.model_name)
        return self.url

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
        await self.engine.close()
        log.info("proxy stopped: %d calls recorded; refused %s; sealed %s", self.num_records,
                 self.abuse.snapshot(), self.revoked.stats())

    # ------------------------------------------------------------ control plane

    def apply_routing_table(self, table: wire.RoutingTable) -> bool:
        return self.router.update(table)

    def is_sealed(self, execution_id: str) -> bool:
        return self.revoked.is_sealed(execution_id)

    def seal(self, execution_id: str) -> int:
        """Refuse the execution's token from now on, cancel its in-flight calls (nothing recorded),
        forget its sessions, and queue ExecutionSealed behind its records; return num_calls.

        Sealing twice sends ExecutionSealed again with the same count (the controller may resend).
        """
        held = self.revoked.num_calls(execution_id)
        if held is not None:
            num_calls = held
            log.info("execution %s sealed again (%d calls)", execution_id, num_calls)
        else:
            exe = self._executions.pop(execution_id, None)
            in_flight = exe.in_flight if exe is not None else set()
            num_calls = self.revoked.revoke(execution_id, exe.num_calls if exe is not None else 0,
                                            self._min_version.pop(execution_id, None))
            self._evals.discard(execution_id)
            for task in in_flight:
                task.cancel()
            self.sessions.drop_execution(execution_id)
            self.minted.drop_execution(execution_id)
            self.router.forget(execution_id)
            self.trim.sealed()
            log.info(
                "execution %s sealed: %d calls recorded, %d in flight cancelled",
                execution_id, num_calls, len(in_flight),
            )
        sent = self.sink.put(wire.ExecutionSealed(execution_id=execution_id, num_calls=num_calls))
        sent.add_done_callback(_log_unsent(f"ExecutionSealed({execution_id})"))
        return num_calls

    # ------------------------------------------------------------ HTTP handlers

    async def _health(self, request: web.Request) -> web.Response:
        table = self.router.table
        return web.json_response({"status": "ok", "routing_version": table.version, "num_engines": len(table.engines)})

    async def _models(self, request: web.Request) -> web.Response:
        return web.json_response(models_body(self.cfg.model_name))

    async def _stats(self, request: web.Request) -> web.Response:
        """The proxy's counters: refusals per kind (``abuse.KINDS``), sealed executions held, live
        ones, the calls in flight per engine URL, the records the processor has not yet
        acknowledged (held and resent by the sink), what the sessions hold against
        ``proxy.max_session_bytes``, and the executions rebuilt from the processor's log."""
        return web.json_response({
            "refused": self.abuse.snapshot(), "sealed": self.revoked.stats(),
            "executions_live": len(self._executions), "sessions": self.sessions.num_executions(),
            "calls_recorded": self.num_records, "in_flight": self.router.in_flight_by_url(),
            "records": {"unacked": self.sink.num_unacked, "unacked_bytes": self.sink.backlog_bytes,
                        "resent": self.sink.num_resent, "refused_backlog": self.num_refused_backlog},
            "session_memory": {"bytes": self.sessions.total_bytes(), "limit": self.cfg.max_session_bytes,
                               "refused": self.num_refused_sessions},
            "restored": {"executions": self.num_restored_executions, "calls": self.num_restored_calls},
        })

    async def _chat_completions(self, request: web.Request) -> web.StreamResponse:
        execution_id = None
        try:
            execution_id = self._authorize(request)
            chat = parse_chat_request(await self._read_body(request, execution_id))
            return await self._complete(request, execution_id, chat)
        except ApiError as err:
            if not isinstance(err, Refusal):
                log.warning(
                    "POST /v1/chat/completions refused %d (execution %s): %s",
                    err.status, execution_id or "-", err.message,
                )
            return await self._refuse(request, err, err.status, err.body())
        except Exception:  # a bug of ours: say so, keep serving
            log.exception("POST /v1/chat/completions failed (execution %s)", execution_id or "-")
            err = ApiError(500, "internal proxy error", type="server_error")
            return web.json_response(err.body(), status=500)

    async def _hello(self, request: web.Request) -> web.Response:
        """Claude Code's connectivity preflight (``HEAD /api/hello``; 2.1.197: ``HEAD /``)."""
        return web.Response(status=200)

    async def _messages(self, request: web.Request) -> web.StreamResponse:
        """Anthropic ``POST /v1/messages`` (``?beta=true`` alike): the same call path as chat completions."""
        execution_id = None
        try:
            execution_id = self._authorize(request)
            req = anthropic_api.parse_messages_request(await self._read_body(request, execution_id), request.headers)
            exe_id = execution_id
            # Echoed tool_use inputs back to the model's own, so a re-serialised turn still splices.
            chat = dataclasses.replace(req.chat, messages=self.minted.canonicalize(exe_id, req.chat.messages))

            def make_reply(parsed: ParsedOutput, output_ids: list[int]) -> dict[str, Any]:
                return self.minted.reply(exe_id, parsed, output_ids)

            call, result, reply = await self._run_call(
                execution_id, chat, agent=req.session_key, call_id=anthropic_api.new_message_id(),
                make_reply=make_reply, lineage=req.lineage, agent_id=req.agent_id,  # type: ignore[arg-type]
            )
            body = anthropic_api.message_body(
                message_id=call.call_id, model=chat.model or self.cfg.model_name, reply=reply,
                stop=anthropic_api.stop_reason(call.harness_finish(result.finish, self.cfg.truncation_ends_turn), reply),
                num_prompt=len(call.prompt_ids),
                num_output=len(result.output_ids),
            )
            return await self._respond_anthropic(request, body, stream=chat.stream)
        except ApiError as err:
            return await self._anthropic_refusal(request, "/v1/messages", execution_id, err)
        except Exception:  # a bug of ours: say so, keep serving
            log.exception("POST /v1/messages failed (execution %s)", execution_id or "-")
            return await self._anthropic_refusal(request, "/v1/messages", execution_id, ApiError(500, "internal proxy error"))

    async def _count_tokens(self, request: web.Request) -> web.Response:
        """``{"input_tokens": N}``: the prompt ids a fresh render of the request would have."""
        execution_id = None
        try:
            execution_id = self._authorize(request)
            messages, tools = anthropic_api.parse_count_tokens_request(await self._read_body(request, execution_id))
            return web.json_response({"input_tokens": len(render_messages(self.tok, messages, tools=tools))})
        except ApiError as err:
            return await self._anthropic_refusal(request, "/v1/messages/count_tokens", execution_id, err)

    async def _anthropic_refusal(
        self, request: web.Request, path: str, execution_id: str | None, err: ApiError,
    ) -> web.StreamResponse:
        too_long = (err.num_prompt, err.limit) if isinstance(err, PromptTooLong) else None
        status, body = anthropic_api.error_reply(err, too_long=too_long)
        if not isinstance(err, Refusal):
            log.warning("POST %s refused %d (execution %s): %s", path, status, execution_id or "-", body["error"]["message"])
        return await self._refuse(request, err, status, body)

    async def _refuse(self, request: web.Request, err: ApiError, status: int, body: dict[str, Any]) -> web.StreamResponse:
        """The error response; abuse is counted (and logged once per source), and a request that is
        not whole (its body timed out or is over the limit) gets its connection closed."""
        resp = web.json_response(body, status=status)
        if not isinstance(err, Refusal):
            return resp
        self.abuse.note(err.kind, err.source, err.message)
        if err.close:
            resp.force_close()  # Connection: close; aiohttp reads and drops what is left of the body
        if err.close and err.kind == "slow_body":
            # A trickling body is not waited for at all (aiohttp would linger on it): answer, then close.
            await resp.prepare(request)
            await resp.write_eof()
            if request.transport is not None:
                request.transport.close()
        return resp

    async def _respond_anthropic(self, request: web.Request, body: dict[str, Any], *, stream: bool) -> web.StreamResponse:
        headers = {CALL_ID_HEADER: body["id"], "request-id": body["id"]}
        if not stream:
            return web.json_response(body, headers=headers)
        resp = web.StreamResponse(headers={**headers, "Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        try:
            await resp.prepare(request)
            for event in anthropic_api.stream_events(body):
                await resp.write(event)
            await resp.write_eof()
        except ConnectionResetError:
            log.info("call %s: harness disconnected while its (recorded) answer streamed", body["id"])
        return resp

    def _authorize(self, request: web.Request) -> str:
        """The execution a call belongs to, from its per-execution token: the EXECUTION_TOKEN_HEADER
        header when present (a harness whose API key is fixed passes it through
        ``ANTHROPIC_CUSTOM_HEADERS``), else ``Authorization: Bearer`` or ``x-api-key``."""
        token = (
            request.headers.get(EXECUTION_TOKEN_HEADER)
            or bearer_token(request.headers.get("Authorization"))
            or request.headers.get("x-api-key")
        )
        peer = peer_of(request.transport) if request.transport is not None else "-"
        if not token:
            raise Refusal(401, "missing bearer token (Authorization: Bearer <token>)", kind="token_missing",
                          source=peer, code="invalid_api_key")
        claims = verify_token(self._secret, token)
        if claims is None:  # garbage, tampered, or signed with another run's secret
            raise Refusal(401, "invalid bearer token", kind="token_invalid", source=peer, code="invalid_api_key")
        execution_id = claims.execution_id
        why = self.revoked.refusal(claims, live=execution_id in self._min_version)
        if why is not None:
            raise Refusal(401, why, kind="token_revoked", source=execution_id, code="invalid_api_key")
        self._min_version[execution_id] = claims.min_version
        if not claims.train:
            self._evals.add(execution_id)
        return execution_id

    async def _read_body(self, request: web.Request, execution_id: str) -> bytes:
        """The whole body, within cfg.read_timeout_s and cfg.max_request_bytes (aiohttp stops reading
        a chunked body at that size), or a Refusal (408, 413) that closes the connection."""
        limit = self.cfg.max_request_bytes
        if request.content_length is not None and request.content_length > limit:
            raise Refusal(413, f"request body of {request.content_length} bytes is over the {limit}-byte limit",
                          kind="oversize", source=execution_id, code="request_too_large", close=True)
        try:
            async with asyncio.timeout(self.cfg.read_timeout_s):
                return await request.read()
        except web.HTTPRequestEntityTooLarge:
            raise Refusal(413, f"request body is over the {limit}-byte limit", kind="oversize", source=execution_id,
                          code="request_too_large", close=True) from None
        except TimeoutError:
            raise Refusal(408, f"request body not received within {self.cfg.read_timeout_s:g} s", kind="slow_body",
                          source=execution_id, code="request_timeout", close=True) from None

    async def _complete(self, request: web.Request, execution_id: str, chat: ChatRequest) -> web.StreamResponse:
        call, result, message = await self._run_call(
            execution_id, chat, agent="", call_id=new_call_id(), lineage=None,  # no header: the sessions derive it
            make_reply=lambda parsed, output_ids: reply_message(parsed),
        )
        return await self._respond(
            request, chat, call_id=call.call_id, message=message,
            finish=finish_reason(call.harness_finish(result.finish, self.cfg.truncation_ends_turn), message),
            num_prompt=len(call.prompt_ids), num_output=len(result.output_ids),
        )

    async def _run_call(
        self, execution_id: str, chat: ChatRequest, *, agent: str, call_id: str,
        make_reply: Any, lineage: wire.Lineage | None = None, agent_id: str = "",
    ) -> tuple[PlannedCall, EngineResult, dict[str, Any]]:
        """Plan, generate, record, remember: the API-independent part of one call.

        ``lineage`` (with ``agent`` and ``agent_id``) is what the harness's headers said (Claude
        Code); None: the SessionStore derives the call's line from the execution's earlier calls.

        ``make_reply(ParsedOutput, output_ids) -> dict`` builds the assistant message in template form (what
        the harness will be told, and what the session remembers for the next call's splice).
        Returns once the processor has the CallRecord in its log (persist, then acknowledge).
        """
        if self.revoked.is_sealed(execution_id):  # sealed while the body was read
            # (before the entry below is made: a sealed execution's would never be dropped)
            raise ApiError(401, f"execution {execution_id} is sealed; its token is revoked", code="invalid_api_key")
        if self.sink.backlog_bytes > self.cfg.max_unacked_record_bytes:
            # The processor is down or behind: refuse before any engine time is spent, rather
            # than hold more records than configured (the harness retries a 503 / 529).
            self.num_refused_backlog += 1
            raise ApiError(503, f"the trajectory processor is behind ({self.sink.backlog_bytes} bytes of records "
                                "not yet acknowledged); retry", type="server_error")
        held = self.sessions.total_bytes()
        if self.cfg.max_session_bytes and held > self.cfg.max_session_bytes:
            # Every live execution's sessions together: refused before memory runs out, retried
            # by the harness once executions end and their sessions are dropped.
            self.num_refused_sessions += 1
            raise ApiError(503, f"the proxy holds {held} bytes of sessions, over proxy.max_session_bytes "
                                f"{self.cfg.max_session_bytes}; retry", type="server_error")
        exe = self._executions.get(execution_id)
        if exe is None:
            exe = await self._open_execution(execution_id)
        self._check_budget(execution_id, exe)
        call, spliced = self._plan_call(
            execution_id, agent, chat, call_id=call_id, lineage=lineage, agent_id=agent_id
        )
        # No await from the budget check to the engine task joining exe.in_flight (in
        # _generate_tracked), so parallel calls of one execution cannot all pass the check at once.
        exe.num_sent += 1
        started_at = time.time()
        try:
            result = await self._generate_tracked(exe, call)
        except BaseException:
            self.sessions.discard_plan(execution_id, call.prompt_ids)  # its prompt ids held no more
            raise
        finished_at = time.time()

        parsed = parse_output(self.tok, result.output_ids)
        message = make_reply(parsed, result.output_ids)
        if self.revoked.is_sealed(execution_id):  # _record refuses it: remember nothing (its sessions are gone)
            self.sessions.discard_plan(execution_id, call.prompt_ids)
            session = None
        else:
            session = self.sessions.remember(
                execution_id, call.agent, messages=chat.messages, tools=chat.tools, reply=message,
                prompt_ids=call.prompt_ids, output_ids=result.output_ids, call_id=call.call_id,
            )
        record, pushed = self._record(exe, call, result, started_at=started_at, finished_at=finished_at,
                                      num_tool_calls=len(parsed.tool_calls), session=session)
        try:
            await asyncio.wait_for(asyncio.shield(pushed), self.cfg.record_ack_timeout_s)
        except asyncio.TimeoutError:
            # Still held and resent: it lands in the log when the processor is back. The harness
            # retries; the retry is a sibling call of the same prompt in the execution's tree.
            raise ApiError(503, f"the call is not yet recorded after {self.cfg.record_ack_timeout_s:.0f}s "
                                "(the trajectory processor is down or behind); retry", type="server_error") from None
        except Exception as exc:
            raise ApiError(503, f"the call could not be recorded ({exc}); retry", type="server_error") from None
        log.debug(
            "call %s execution %s #%d (%s %s): %d prompt ids (%s), %d output ids, %s, cell %d, weight v%d",
            call.call_id, execution_id, record.call_index, call.lineage, call.agent_id or "-", len(call.prompt_ids),
            "spliced" if spliced else "rendered", len(result.output_ids), result.finish,
            result.route.cell_id, result.weight_version,
        )
        return call, result, message

    async def _open_execution(self, execution_id: str) -> LiveExecution:
        """The entry of an execution this proxy has no calls of: a new one, or one that was live
        before the proxy restarted. Either way its logged CallRecords are asked of the processor
        first (``trajectory.session_replay``) and remembered again, so splicing, lineage, call
        indices and budgets go on as if the proxy had never stopped. Calls that arrive meanwhile
        wait for the same answer."""
        opening = self._opening.get(execution_id)
        if opening is None:
            opening = self._opening[execution_id] = asyncio.ensure_future(self._restore(execution_id))
            opening.add_done_callback(lambda _: self._opening.pop(execution_id, None))
        return await asyncio.shield(opening)

    async def _restore(self, execution_id: str) -> LiveExecution:
        try:
            replay = await asyncio.wait_for(asyncio.shield(self.sink.replay(execution_id)),
                                            self.cfg.record_ack_timeout_s)
        except (asyncio.TimeoutError, ConnectionError) as exc:
            raise ApiError(503, f"execution {execution_id}'s earlier calls could not be read from the trajectory "
                                f"processor ({exc or 'no answer'}); retry", type="server_error") from None
        if replay.sealed:
            self.revoked.revoke(execution_id, len(replay.records), None)
            raise ApiError(401, f"execution {execution_id} is sealed; its token is revoked", code="invalid_api_key")
        exe = self._executions.get(execution_id)
        if exe is not None:  # a call made the entry while the answer came (cannot: every first call waits here)
            return exe
        exe = self._executions[execution_id] = LiveExecution(first_call_at=time.monotonic())
        records = sorted(replay.records, key=lambda r: r.call_index)
        restored = 0
        for r in records:
            restored += self.sessions.restore(r)
            if r.session is not None and r.session.reply_tool_ids:  # tool_use ids the harness will echo
                self.minted.restore(execution_id, parse_output(self.tok, r.output_ids), r.output_ids,
                                    r.session.reply_tool_ids)
        if records:
            exe.num_calls = records[-1].call_index + 1
            exe.num_sent = len(records)
            exe.num_tokens = sum(len(r.prompt_ids) + len(r.output_ids) for r in records)
            self.num_restored_executions += 1
            self.num_restored_calls += restored
            log.info("execution %s: %d earlier call(s) read back from the processor, %d remembered again",
                     execution_id, len(records), restored)
        return exe

    def _check_budget(self, execution_id: str, exe: LiveExecution) -> None:
        """Refuse a call its execution's budget (``proxy.execution_budget``) does not allow: 429 while
        too many of its calls are at an engine (both SDKs retry it), 403 once a budget is used up
        (neither retries it, and retrying would not help)."""
        why = budget_refusal(exe.budget_state(), self.cfg.execution_budget, time.monotonic())
        if why is None:
            return
        if why.retriable:  # OpenAI's own shape for a request-rate limit
            raise Refusal(429, why.message, kind=why.kind, source=execution_id, code="rate_limit_exceeded",
                          type="requests")
        raise Refusal(403, why.message, kind=why.kind, source=execution_id, code="budget_exhausted")

    def _plan_call(
        self, execution_id: str, agent: str, chat: ChatRequest, *, call_id: str, lineage: wire.Lineage | None,
        agent_id: str,
    ) -> tuple[PlannedCall, bool]:
        """Prompt ids, line and sampling for one call; refuse (400) a prompt that leaves no room to answer."""
        plan = self.sessions.build_prompt(
            execution_id, agent, chat.messages, chat.tools, lineage=lineage, agent_id=agent_id
        )
        num_prompt = len(plan.prompt_ids)
        limit = self.cfg.max_context_tokens
        if num_prompt >= limit:
            raise PromptTooLong(num_prompt, limit)
        cap = self.cfg.max_new_tokens_cap
        max_new = min(chat.max_tokens or cap, cap, limit - num_prompt)
        if execution_id in self._evals:
            used = {"temperature": chat.temperature, "top_p": chat.top_p, "top_k": -1}
        else:  # training data must come from the distribution the trainer scores (algo.rollout)
            r = self.rollout
            used = {"temperature": r.temperature, "top_p": r.top_p, "top_k": r.top_k}
        sampling = {"max_new_tokens": max_new, **used, "stop_token_ids": [self.tok.im_end, self.tok.endoftext]}
        call = PlannedCall(
            execution_id=execution_id, agent=plan.agent, call_id=call_id, prompt_ids=plan.prompt_ids,
            sampling_params=sampling, asked=(chat.temperature, chat.top_p), lineage=plan.lineage, agent_id=plan.agent_id,  # type: ignore[arg-type]
            lineage_reason=plan.reason,
            capped_by_run=max_new == cap and (chat.max_tokens is None or cap < chat.max_tokens),
        )
        return call, plan.spliced

    def _record(
        self, exe: LiveExecution, call: PlannedCall, result: EngineResult, *, started_at: float, finished_at: float,
        num_tool_calls: int = 0, session: wire.SessionEntry | None = None,
    ) -> tuple[wire.CallRecord, asyncio.Future[None]]:
        """Queue the call's CallRecord. Synchronous, so no seal can slip between the check and the put:
        every record of an execution is queued before its ExecutionSealed."""
        if self.revoked.is_sealed(call.execution_id):
            raise ApiError(
                401, f"execution {call.execution_id} was sealed during the call; not recorded", code="invalid_api_key"
            )
        record = wire.CallRecord(
            execution_id=call.execution_id, call_id=call.call_id, call_index=exe.num_calls,
            prompt_ids=call.prompt_ids, output_ids=result.output_ids, output_logprobs=result.output_logprobs,
            weight_version=result.weight_version, cell_id=result.route.cell_id, finish_reason=result.finish,
            lineage=call.lineage, agent_id=call.agent_id, started_at=started_at, finished_at=finished_at,
            num_tool_calls=num_tool_calls, temperature=float(call.sampling_params["temperature"]),
            top_p=float(call.sampling_params["top_p"]), top_k=int(call.sampling_params["top_k"]),
            harness_temperature=float(call.asked[0]), harness_top_p=float(call.asked[1]),
            lineage_reason=call.lineage_reason, session=session,
            weight_versions=result.spans() if result.weight_versions else [],
        )
        record.check()
        exe.num_calls += 1
        self.num_records += 1
        return record, self.sink.put(record)

    def _record_hang_up(self, exe: LiveExecution, call: PlannedCall) -> None:
        """A CallRecord saying the harness hung up mid-call: the prompt, no output, finish ``abort``
        (cell -1: no engine answered). The trajectory tree counts it and adds no path."""
        if self.revoked.is_sealed(call.execution_id):
            return
        now = time.time()
        result = EngineResult(wire.EngineRoute(cell_id=-1, url=""), [], [], 0, "abort")
        _, pushed = self._record(exe, call, result, started_at=now, finished_at=now)
        pushed.add_done_callback(_log_unsent(f"abort record of {call.call_id}"))

    async def _respond(
        self, request: web.Request, chat: ChatRequest, *, call_id: str, message: dict[str, Any], finish: str,
        num_prompt: int, num_output: int,
    ) -> web.StreamResponse:
        model = chat.model or self.cfg.model_name
        created = int(time.time())
        used = usage(num_prompt, num_output)
        headers = {CALL_ID_HEADER: call_id}
        if not chat.stream:
            body = completion_body(call_id=call_id, created=created, model=model, message=message, finish=finish, usage=used)
            return web.json_response(body, headers=headers)
        resp = web.StreamResponse(headers={**headers, "Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        events = stream_events(
            call_id=call_id, created=created, model=model, message=message, finish=finish,
            usage=used if chat.include_usage else None,
        )
        try:
            await resp.prepare(request)
            for event in events:
                await resp.write(event)
            await resp.write_eof()
        except ConnectionResetError:
            log.info("call %s: harness disconnected while its (recorded) answer streamed", call_id)
        return resp

    # ------------------------------------------------------------ calling engines

    async def _generate_tracked(self, exe: LiveExecution, call: PlannedCall) -> EngineResult:
        """Run the engine call as a task a seal can cancel; tell a seal from a hang-up."""
        task = asyncio.ensure_future(self.engine.generate(call))
        exe.in_flight.add(task)
        try:
            result = await task
            exe.num_tokens += len(call.prompt_ids) + len(result.output_ids)
            return result
        except asyncio.CancelledError:
            me = asyncio.current_task()
            if me is not None and me.cancelling():
                log.info(
                    "call %s (execution %s): harness disconnected; engine request aborted, recorded as abort",
                    call.call_id, call.execution_id,
                )
                exe.num_tokens += len(call.prompt_ids)  # an engine may have prefilled them already
                self._record_hang_up(exe, call)
                raise
            raise ApiError(
                401, f"execution {call.execution_id} was sealed during the call; not recorded", code="invalid_api_key"
            ) from None
        finally:
            exe.in_flight.discard(task)


def _log_unsent(what: str) -> Any:
    def callback(fut: asyncio.Future[None]) -> None:
        if not fut.cancelled() and fut.exception() is not None:
            log.error("%s not sent to the processor: %s", what, fut.exception())

    return callback
