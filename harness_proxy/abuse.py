"""What the proxy refuses to whom: counted per kind, logged once per source, slow clients dropped.

``AbuseLog`` counts each kind of refusal (``KINDS``) and logs the first one per kind per source
(the execution, or the peer's address when no token says which execution it is), then only
counts: a flood of bad requests grows a counter, not the log. The sources logged are themselves
bounded (``MAX_LOGGED_SOURCES`` per kind); past that one line says the rest are counted only. The
counters are served at ``GET /stats`` (``ProxyServer``).

``ConnectionGuard`` bounds how long a connection may take to deliver a request's head: the first
request must arrive whole within ``read_timeout_s`` of the connection opening, and each later one
within ``read_timeout_s`` of its first byte. A connection that trickles its request line or headers
(a slow-loris) is answered 408, in the shape of the API its request line names when it got that
far, and closed; one that sent nothing is closed without an answer. No task or thread waits on it meanwhile: the asyncio loop only holds its socket
and a small buffer, and serves everyone else. A body that trickles once the head is in is the
handler's to time out (``ProxyServer._read_body``), as only the handler knows when it wants it.

The guard wraps aiohttp's own per-connection protocol, forwarding every callback, and learns
when a request's head is complete from a middleware (the handler only runs once it is); it needs
nothing of aiohttp but the runner's protocol factory, obtained by subclassing ``AppRunner``.
"""

from __future__ import annotations

import asyncio
import logging
from collections import Counter
from typing import Any

import orjson
from aiohttp import web

from harness_proxy.budget import BUDGET_KINDS

log = logging.getLogger(__name__)

KINDS = ("slow_headers", "slow_body", "oversize", "token_missing", "token_invalid", "token_revoked", *BUDGET_KINDS)
"""``slow_headers``: no whole request head within the read timeout (a slow-loris, or a connection
that never sends); ``slow_body``: the body not in within the read timeout (408); ``oversize``: a
body over ``proxy.max_request_bytes`` (413); ``token_missing`` / ``token_invalid`` (not signed with
this run's secret: garbage, tampered, or another run's) / ``token_revoked`` (a sealed execution's,
replays included) (401); ``budget_calls`` / ``budget_tokens`` / ``budget_wall`` (an execution's
budget used up, 403) / ``budget_concurrency`` (too many of its calls at once, 429), see
``harness_proxy.budget``."""
MAX_LOGGED_SOURCES = 1024
"""Sources (executions, peers) logged per kind; past them a kind is only counted."""
HEAD_KEPT_BYTES = 256
"""Bytes of a pending request kept to tell which API its 408 should speak."""


class AbuseLog:
    """Counters per kind, and one log line per (kind, source); see the module docstring."""

    def __init__(self, *, max_logged_sources: int = MAX_LOGGED_SOURCES):
        self.counts: Counter[str] = Counter({kind: 0 for kind in KINDS})
        self._max_sources = max_logged_sources
        self._logged: dict[str, set[str]] = {kind: set() for kind in KINDS}
        self._muted: set[str] = set()

    def note(self, kind: str, source: str, detail: str) -> None:
        """Count one refusal of ``kind`` from ``source``; log it if it is the first from there."""
        assert kind in self._logged, kind
        self.counts[kind] += 1
        logged = self._logged[kind]
        if source in logged or kind in self._muted:
            return
        if len(logged) >= self._max_sources:
            self._muted.add(kind)
            log.warning("refused %s: more than %d sources; further ones are counted (GET /stats), not logged",
                        kind, self._max_sources)
            return
        logged.add(source)
        log.warning("refused %s from %s: %s (further %s from %s are counted, not logged)",
                    kind, source, detail, kind, source)

    def snapshot(self) -> dict[str, int]:
        return dict(self.counts)


# ---------------------------------------------------------------- slow request heads


def timeout_body(message: str, *, anthropic: bool) -> dict[str, Any]:
    """A 408 in Anthropic's or OpenAI's error shape."""
    if anthropic:
        return {"type": "error", "error": {"type": "timeout_error", "message": message}}
    return {"error": {"message": message, "type": "invalid_request_error", "param": None, "code": "request_timeout"}}


def is_anthropic_path(path: str) -> bool:
    return path.startswith("/v1/messages")


class _GuardedProtocol(asyncio.Protocol):
    """One connection: aiohttp's protocol inside, a deadline on each request head around it."""

    def __init__(self, inner: Any, guard: ConnectionGuard):
        self.inner = inner
        self.guard = guard
        self.transport: asyncio.Transport | None = None
        self.timer: asyncio.TimerHandle | None = None
        self.busy = 0
        """Requests whose head is in and whose handler has not returned."""
        self.payload: Any = None
        """The last request's body stream: bytes while it is not at EOF are its body, not a new head."""
        self.head = bytearray()

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport
        self.guard.protocols[self.inner] = self
        self.inner.connection_made(transport)
        self._arm()  # a connection that never sends a request is dropped too

    def data_received(self, data: bytes) -> None:
        waiting_for_head = not self.busy and (self.payload is None or self.payload.is_eof())
        if waiting_for_head and len(self.head) < HEAD_KEPT_BYTES:
            self.head += data[: HEAD_KEPT_BYTES - len(self.head)]
        self.inner.data_received(data)
        if waiting_for_head:
            self._arm()

    def eof_received(self) -> bool | None:
        return self.inner.eof_received()

    def pause_writing(self) -> None:
        self.inner.pause_writing()

    def resume_writing(self) -> None:
        self.inner.resume_writing()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        self.guard.protocols.pop(self.inner, None)
        self.inner.connection_lost(exc)

    # ------------------------------------------------------------ told by the middleware

    def request_started(self, request: web.BaseRequest) -> None:
        self._disarm()
        self.busy += 1
        self.payload = request.content
        self.head.clear()

    def request_ended(self) -> None:
        self.busy -= 1

    # ------------------------------------------------------------ the deadline

    def _arm(self) -> None:
        if self.timer is None:
            self.timer = asyncio.get_running_loop().call_later(self.guard.read_timeout_s, self._expired)

    def _disarm(self) -> None:
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None

    def _expired(self) -> None:
        self.timer = None
        transport = self.transport
        if self.busy or transport is None or transport.is_closing():
            return
        line = bytes(self.head).split(b"\r\n", 1)[0].decode("latin-1")
        path = line.split(" ")[1] if line.count(" ") >= 1 else ""
        peer = peer_of(transport)
        t = self.guard.read_timeout_s
        detail = (f"no whole request head within {t:g} s (got {len(self.head)} byte(s): {line[:80]!r})"
                  if self.head else f"no request within {t:g} s of connecting")
        self.guard.abuse.note("slow_headers", peer, detail)
        if self.head:  # a connection that sent nothing is closed without a word, as a client may
            # still write a request onto it and would read an unasked-for 408 as that request's answer
            body = orjson.dumps(timeout_body(f"request not received within {t:g} s", anthropic=is_anthropic_path(path)))
            transport.write(
                b"HTTP/1.1 408 Request Timeout\r\nContent-Type: application/json\r\nConnection: close\r\n"
                + f"Content-Length: {len(body)}\r\n\r\n".encode() + body
            )
        transport.close()  # flushes the 408, then connection_lost tells aiohttp


def peer_of(transport: asyncio.BaseTransport) -> str:
    """The peer's address without its port (one source per host), or ``unix`` on a Unix socket."""
    peer = transport.get_extra_info("peername")
    if isinstance(peer, (tuple, list)) and peer:
        return str(peer[0])
    return "unix"


class _GuardedFactory:
    """aiohttp's ``web.Server`` as the runner knows it, making guarded protocols."""

    def __init__(self, server: web.Server, guard: ConnectionGuard):
        self._server = server
        self._guard = guard

    def __call__(self) -> _GuardedProtocol:
        return _GuardedProtocol(self._server(), self._guard)

    def __getattr__(self, name: str) -> Any:  # pre_shutdown, shutdown, connections, ...
        return getattr(self._server, name)


class ConnectionGuard:
    """Deadlines on request heads for every site of one runner; see the module docstring."""

    def __init__(self, *, read_timeout_s: float, abuse: AbuseLog):
        if not read_timeout_s > 0:
            raise ValueError(f"read_timeout_s: want > 0, got {read_timeout_s!r}")
        self.read_timeout_s = read_timeout_s
        self.abuse = abuse
        self.protocols: dict[Any, _GuardedProtocol] = {}
        """aiohttp's protocol of each open connection -> its guard (how the middleware finds it)."""

    @web.middleware
    async def middleware(self, request: web.Request, handler: Any) -> web.StreamResponse:
        guarded = self.protocols.get(request.protocol)
        if guarded is None:
            return await handler(request)
        guarded.request_started(request)
        try:
            return await handler(request)
        finally:
            guarded.request_ended()

    def runner(self, app: web.Application, **kwargs: Any) -> web.AppRunner:
        """An ``AppRunner`` whose sites (TCP, Unix, any added later) all make guarded connections."""
        guard = self

        class GuardedRunner(web.AppRunner):
            async def _make_server(self) -> Any:
                return _GuardedFactory(await super()._make_server(), guard)

        return GuardedRunner(app, **kwargs)
