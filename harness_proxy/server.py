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
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import orjson
from aiohttp import web

from base import engine_key, wire
from harness_proxy import anthropic_api
from harness_proxy.abuse import AbuseLog, ConnectionGuard, peer_of
from base.execution_token import verify_token
from harness_proxy.auth import Revocations, bearer_token
from harness_proxy.budget import BudgetState, budget_refusal
from harness_proxy.config import ProxyConfig
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

RETRY_BACKOFF_S = 0.05
"""First pause before re-routing a call; doubles per attempt up to RETRY_BACKOFF_MAX_S."""
RETRY_BACKOFF_MAX_S = 1.0
ROUTE_POLL_S = 0.05
"""How often a call with no engine to go to looks at the routing table again."""
ABORT_TIMEOUT_S = 5.0
SHUTDOWN_TIMEOUT_S = 5.0
MAX_TOKEN_ID = 2**31 - 1
MAX_REVOKED_EXECUTIONS = 65_536
"""Sealed executions held exactly (about 150 bytes each); past them ``auth.Revocations`` evicts by floor."""
CALL_ID_HEADER = "x-gyre-call-id"
EXECUTION_TOKEN_HEADER = "x-gyre-execution-token"


# ---------------------------------------------------------------- the engine (SGLang's native API)


class EngineUnavailable(Exception):
    """The engine did not produce a usable answer; the call may be retried elsewhere."""


@dataclass(frozen=True, slots=True)
class EngineResult:
    route: wire.EngineRoute
    output_ids: list[int]
    output_logprobs: list[float]
    weight_version: int
    finish: str
    """stop | length | abort (abort: the cell is draining; never recorded)."""


def parse_generate_response(data: Any, route: wire.EngineRoute) -> EngineResult:
    """Validate a ``/generate`` answer; raise EngineUnavailable naming what is wrong."""
    meta = data.get("meta_info") if isinstance(data, dict) else None
    if not isinstance(meta, dict):
        raise EngineUnavailable("response: want an object with meta_info")
    fr = meta.get("finish_reason")
    finish = fr.get("type") if isinstance(fr, dict) else fr
    if finish not in ("stop", "length", "abort"):
        raise EngineUnavailable(f"meta_info.finish_reason: want stop|length|abort, got {fr!r}")
    if finish == "abort":
        return EngineResult(route, [], [], 0, "abort")
    ids = data.get("output_ids")
    if not isinstance(ids, list) or not all(type(t) is int and 0 <= t <= MAX_TOKEN_ID for t in ids):
        raise EngineUnavailable("output_ids: want a list of token ids")
    entries = meta.get("output_token_logprobs")
    if not isinstance(entries, list) or len(entries) != len(ids):
        raise EngineUnavailable("meta_info.output_token_logprobs: want one entry per output id")
    logprobs = []
    for i, entry in enumerate(entries):
        lp = entry[0] if isinstance(entry, list) and len(entry) >= 2 else None
        if isinstance(lp, bool) or not isinstance(lp, (int, float)) or not lp <= 1e-4 or lp != lp:
            raise EngineUnavailable(f"output_token_logprobs[{i}]: want [logprob <= 0, id, ...], got {entry!r:.60}")
        if entry[1] != ids[i]:
            raise EngineUnavailable(f"output_token_logprobs[{i}]: id {entry[1]!r} != output id {ids[i]}")
        logprobs.append(min(float(lp), 0.0))  # float rounding may leave a hair above 0
    if any(lp == float("-inf") for lp in logprobs):
        raise EngineUnavailable("output_token_logprobs: -inf")
    version = meta.get("weight_version")
    try:
        weight_version = int(version)  # SGLang reports it as a string
    except (TypeError, ValueError):
        raise EngineUnavailable(f"meta_info.weight_version: want an integer, got {version!r}") from None
    if weight_version < 0 or isinstance(version, (bool, float)):
        raise EngineUnavailable(f"meta_info.weight_version: want an integer >= 0, got {version!r}")
    return EngineResult(route, ids, logprobs, weight_version, finish)


# ---------------------------------------------------------------- the server


@dataclass
class _Execution:
    """A live execution's state; dropped when it is sealed."""

    first_call_at: float
    """Monotonic seconds of its first call (``proxy.execution_budget.max_wall_s`` counts from here)."""
    num_calls: int = 0
    """CallRecords queued so far; the next record's call_index."""
    num_sent: int = 0
    """Calls sent to an engine (``max_calls``)."""
    num_tokens: int = 0
    """Prompt plus output ids of the calls whose result is known (``max_tokens``)."""
    in_flight: set[asyncio.Task[EngineResult]] = field(default_factory=set)

    def budget_state(self) -> BudgetState:
        return BudgetState(first_call_at=self.first_call_at, num_calls=self.num_sent, num_tokens=self.num_tokens,
                           num_in_flight=len(self.in_flight))


@dataclass(frozen=True, slots=True)
class _Call:
    execution_id: str
    agent: str
    """The session and routing key: whose line of calls this one extends."""
    call_id: str
    prompt_ids: list[int]
    sampling_params: dict[str, Any]
    asked: tuple[float, float] = (1.0, 1.0)
    """The harness's own temperature and top_p, recorded beside what the engine used."""
    lineage: wire.Lineage = "main"
    agent_id: str = ""
    """The harness's agent id, recorded on the CallRecord ('' for the main agent)."""
    lineage_reason: str = ""
    capped_by_run: bool = False
    """The run's own cap (``max_new_tokens_cap``), not the harness's ``max_tokens``, bounds this call."""

    def harness_finish(self, engine_finish: str, ends_turn: bool) -> str:
        """The finish the harness is told: with ``proxy.truncation_ends_turn``, a turn the run's cap cut
        is an ended turn (the harness goes on instead of asking the model to continue); the
        CallRecord keeps the engine's own ``length``."""
        return "stop" if ends_turn and engine_finish == "length" and self.capped_by_run else engine_finish


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
        self.router = Router()
        self.sessions = SessionStore(tokenizer, memory_bytes=cfg.session_memory_bytes)
        self.minted = anthropic_api.MintedToolUses()
        self.url = ""
        self._secret = secret
        self._engine_api_key = engine_api_key
        self._executions: dict[str, _Execution] = {}
        self.revoked = Revocations(max_revoked)
        self.abuse = AbuseLog()
        self.guard = ConnectionGuard(read_timeout_s=cfg.read_timeout_s, abuse=self.abuse)
        self.num_records = 0
        self.num_refused_backlog = 0
        self.num_refused_sessions = 0
        self.num_restored_executions = 0
        self.num_restored_calls = 0
        self._opening: dict[str, asyncio.Future[_Execution]] = {}
        self.trim = TrimAfterSeals()
        self._min_version: dict[str, int] = {}  # execution id -> oldest weight version it accepts (its token)
        self._evals: set[str] = set()  # live executions whose token says eval: the harness's sampling stands
        self._background: set[asyncio.Task[Any]] = set()
        self._http: aiohttp.ClientSession | None = None
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
        self._http = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=self.cfg.engine_timeout_s),
                                           headers=engine_key.headers(self._engine_api_key))
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
        if self._background:
            await asyncio.wait(self._background, timeout=ABORT_TIMEOUT_S)
        if self._http is not None:
            await self._http.close()
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
    ) -> tuple[_Call, EngineResult, dict[str, Any]]:
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

    async def _open_execution(self, execution_id: str) -> _Execution:
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

    async def _restore(self, execution_id: str) -> _Execution:
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
        exe = self._executions[execution_id] = _Execution(first_call_at=time.monotonic())
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

    def _check_budget(self, execution_id: str, exe: _Execution) -> None:
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
    ) -> tuple[_Call, bool]:
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
        call = _Call(
            execution_id=execution_id, agent=plan.agent, call_id=call_id, prompt_ids=plan.prompt_ids,
            sampling_params=sampling, asked=(chat.temperature, chat.top_p), lineage=plan.lineage, agent_id=plan.agent_id,  # type: ignore[arg-type]
            lineage_reason=plan.reason,
            capped_by_run=max_new == cap and (chat.max_tokens is None or cap < chat.max_tokens),
        )
        return call, plan.spliced

    def _record(
        self, exe: _Execution, call: _Call, result: EngineResult, *, started_at: float, finished_at: float,
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
        )
        record.check()
        exe.num_calls += 1
        self.num_records += 1
        return record, self.sink.put(record)

    def _record_hang_up(self, exe: _Execution, call: _Call) -> None:
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

    async def _generate_tracked(self, exe: _Execution, call: _Call) -> EngineResult:
        """Run the engine call as a task a seal can cancel; tell a seal from a hang-up."""
        task = asyncio.ensure_future(self._generate(call))
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

    async def _generate(self, call: _Call) -> EngineResult:
        """Generate on some engine: on a dead, unavailable or draining one, the same prompt ids go
        to another engine from the (re-read) routing table, up to cfg.retry_attempts engines."""
        tried: list[str] = []
        last = "no serving engine in the routing table"
        attempts = max(1, self.cfg.retry_attempts)
        for attempt in range(attempts):
            if attempt:
                await asyncio.sleep(min(RETRY_BACKOFF_S * 2 ** (attempt - 1), RETRY_BACKOFF_MAX_S))
            route = await self._wait_for_route(call, tried)
            if route is None:
                continue
            tried.append(route.url)
            try:
                with self.router.track(route.url):
                    result = await self._engine_generate(route, call)
            except EngineUnavailable as exc:
                last = f"cell {route.cell_id} ({route.url}): {exc}"
                self.router.failed(route.url)  # its other sessions move on without a failed try each
            else:
                self.router.succeeded(route.url)
                floor = self._min_version.get(call.execution_id, 0)
                if result.finish != "abort" and result.weight_version >= floor:
                    return result
                if result.finish == "abort":
                    last = f"cell {route.cell_id} ({route.url}) aborted the request (draining)"
                else:  # the table listed it too new: never hand the harness (or training) a too-stale call
                    last = f"cell {route.cell_id} ({route.url}) served weight v{result.weight_version} < v{floor}"
            log.warning(
                "call %s (execution %s) attempt %d/%d failed: %s", call.call_id, call.execution_id,
                attempt + 1, attempts, last,
            )
        raise ApiError(
            503, f"no engine could serve the call after {attempts} attempt(s): {last}",
            type="server_error", code="engine_unavailable",
        )

    async def _wait_for_route(self, call: _Call, tried: list[str]) -> wire.EngineRoute | None:
        """An engine for the call; while none is serving (cells mid-switch), wait for the next
        routing table up to cfg.route_wait_s, so the harness sees a slower answer, not an error."""
        deadline = asyncio.get_running_loop().time() + self.cfg.route_wait_s
        version = self.router.table.version
        while True:
            route = self.router.choose(
                call.execution_id, call.agent, exclude=tried, min_version=self._min_version.get(call.execution_id, 0)
            )
            if route is not None or asyncio.get_running_loop().time() >= deadline:
                return route
            await asyncio.sleep(ROUTE_POLL_S)
            if self.router.table.version != version:
                version = self.router.table.version
                tried.clear()  # a new table: engines that failed before may be serving again

    async def _engine_generate(self, route: wire.EngineRoute, call: _Call) -> EngineResult:
        assert self._http is not None, "start() first"
        payload = {
            "input_ids": call.prompt_ids, "sampling_params": call.sampling_params,
            "return_logprob": True, "rid": call.call_id,
        }
        try:
            # orjson: a 100k-id prompt is most of the proxy's time when json.dumps encodes it.
            body = orjson.dumps(payload)
            async with self._http.post(
                f"{route.url}/generate", data=body, headers={"Content-Type": "application/json"}
            ) as resp:
                if resp.status == 400:
                    text = (await resp.text())[:500]
                    raise ApiError(400, f"the engine refused the request: {text}", code="engine_rejected")
                if resp.status != 200:
                    raise EngineUnavailable(f"HTTP {resp.status}")
                data = await resp.json(content_type=None)
        except asyncio.CancelledError:
            self._spawn(self._abort(route.url, call.call_id))
            raise
        except TimeoutError:
            self._spawn(self._abort(route.url, call.call_id))
            raise EngineUnavailable(f"no answer within {self.cfg.engine_timeout_s} s") from None
        except (aiohttp.ClientError, ValueError) as exc:  # ValueError: a body that is not JSON
            raise EngineUnavailable(f"{type(exc).__name__}: {exc}") from None
        return parse_generate_response(data, route)

    async def _abort(self, url: str, rid: str) -> None:
        assert self._http is not None
        try:
            async with self._http.post(
                f"{url}/abort_request", json={"rid": rid}, timeout=aiohttp.ClientTimeout(total=ABORT_TIMEOUT_S)
            ) as resp:
                await resp.read()
        except (aiohttp.ClientError, TimeoutError) as exc:
            log.info("abort of %s on %s failed: %s", rid, url, exc)

    def _spawn(self, coro: Any) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)


def _log_unsent(what: str) -> Any:
    def callback(fut: asyncio.Future[None]) -> None:
        if not fut.cancelled() and fut.exception() is not None:
            log.error("%s not sent to the processor: %s", what, fut.exception())

    return callback
