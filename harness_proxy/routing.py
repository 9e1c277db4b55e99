"""Which serving engine takes a call: the latest routing table, session affinity, least load.

The controller sends ``RoutingTable``s; a newer ``version`` replaces the one held, an older or
equal one is ignored (messages may arrive late). The table lists every server of every serving
cell (a cell larger than one SGLang server runs several, ``cellrunner.servers``), so the choice
is per server. A call goes to the server its (execution id, agent) session last used while that
server is still in the table and not down, so the server's radix cache keeps the session's
history warm; otherwise to the server with the fewest in-flight calls, ties broken by the fewest
pinned sessions, then by cell id and url, so the choice is reproducible, and the session is
pinned there. A server that just failed a call (refused the connection, answered 5xx, timed
out) is *down* for ``DOWN_S``: no session is sent there while another server can take it, and a
session pinned to it is re-pinned where its call lands; a success clears it at once. Servers
whose listed weight version is below the call's ``min_version`` (from the execution's token)
are never chosen. The choice itself is the pure function ``pick_engine``; ``Router`` holds the
state around it (its clock passed in). No I/O here.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections import Counter
from collections.abc import Callable, Collection, Iterator, Mapping, Sequence

from base.wire import EngineRoute, RoutingTable

log = logging.getLogger(__name__)

DOWN_S = 10.0
"""How long a server that failed a call is avoided (unless no other can take the call): long
enough that the sessions pinned to a dead server move on their next call without each paying a
failed try, short enough that a server back from a hiccup gets new sessions again soon."""


def pick_engine(
    engines: Sequence[EngineRoute],
    *,
    in_flight: Mapping[str, int],
    num_sticky: Mapping[str, int],
    sticky_url: str | None = None,
    exclude: Collection[str] = (),
    min_version: int = 0,
    down: Collection[str] = (),
) -> EngineRoute | None:
    """The engine for one call, or None when no engine has ``weight_version >= min_version``.

    ``exclude`` holds engines that already failed this call, ``down`` those that failed a recent
    one: both are passed over, the sticky one too, while another new-enough engine is left; when
    none is, the choice falls back to the down ones not excluded, then to all (one may have
    recovered).
    """
    fresh = [e for e in engines if e.weight_version >= min_version]
    tried = [e for e in fresh if e.url not in exclude]
    candidates = [e for e in tried if e.url not in down] or tried or fresh
    if not candidates:
        return None
    if sticky_url is not None:
        for e in candidates:
            if e.url == sticky_url:
                return e
    return min(candidates, key=lambda e: (in_flight.get(e.url, 0), num_sticky.get(e.url, 0), e.cell_id, e.url))


class Router:
    """The routing table, in-flight counts and sticky bindings of one proxy (one event loop)."""

    def __init__(self, *, clock: Callable[[], float] = time.monotonic, down_s: float = DOWN_S) -> None:
        self.table = RoutingTable(version=-1, engines=[])
        self._in_flight: Counter[str] = Counter()
        self._sticky: dict[str, dict[str, str]] = {}  # execution id -> agent -> engine url
        self._num_sticky: Counter[str] = Counter()
        self._clock, self._down_s = clock, down_s
        self._down_until: dict[str, float] = {}  # url -> when it may take new sessions again

    def update(self, table: RoutingTable) -> bool:
        """Adopt ``table`` if it is newer than the one held; return whether it was adopted."""
        if table.version <= self.table.version:
            log.info("routing table v%d ignored: v%d is held", table.version, self.table.version)
            return False
        self.table = table
        log.info(
            "routing table v%d: %s", table.version,
            ", ".join(f"cell {e.cell_id} {e.url}" for e in table.engines) or "no engines",
        )
        return True

    def engines(self) -> list[EngineRoute]:
        return list(self.table.engines)

    def choose(
        self, execution_id: str, agent: str, *, exclude: Collection[str] = (), min_version: int = 0
    ) -> EngineRoute | None:
        """Pick an engine (none older than ``min_version``) and make it the agent's sticky one."""
        route = pick_engine(
            self.table.engines, in_flight=self._in_flight, num_sticky=self._num_sticky,
            sticky_url=self.sticky_url(execution_id, agent), exclude=exclude, min_version=min_version,
            down=self.down(),
        )
        if route is not None:
            self._bind(execution_id, agent, route.url)
        return route

    def failed(self, url: str) -> None:
        """A call to ``url`` found it unusable (no answer, 5xx): avoid it for ``down_s``."""
        if url not in self.down():
            log.warning("engine %s failed a call: avoided for %.0f s unless no other can take a call", url, self._down_s)
        self._down_until[url] = self._clock() + self._down_s

    def succeeded(self, url: str) -> None:
        """A call to ``url`` was answered: it takes new sessions again."""
        if self._down_until.pop(url, None) is not None:
            log.info("engine %s answers again", url)

    def down(self) -> set[str]:
        now = self._clock()
        for url in [u for u, t in self._down_until.items() if t <= now]:
            del self._down_until[url]
        return set(self._down_until)

    @contextlib.contextmanager
    def track(self, url: str) -> Iterator[None]:
        """Count a call as in flight on ``url`` for the duration of the block."""
        self._in_flight[url] += 1
        try:
            yield
        finally:
            self._in_flight[url] -= 1
            if self._in_flight[url] <= 0:
                del self._in_flight[url]

    def in_flight_by_url(self) -> dict[str, int]:
        return dict(self._in_flight)

    def in_flight(self, url: str) -> int:
        return self._in_flight.get(url, 0)

    def sticky_url(self, execution_id: str, agent: str) -> str | None:
        return self._sticky.get(execution_id, {}).get(agent)

    def forget(self, execution_id: str) -> None:
        """Drop every sticky binding of a sealed execution."""
        for url in self._sticky.pop(execution_id, {}).values():
            self._release(url)

    def _bind(self, execution_id: str, agent: str, url: str) -> None:
        agents = self._sticky.setdefault(execution_id, {})
        old = agents.get(agent)
        if old == url:
            return
        if old is not None:
            self._release(old)
        agents[agent] = url
        self._num_sticky[url] += 1

    def _release(self, url: str) -> None:
        self._num_sticky[url] -= 1
        if self._num_sticky[url] <= 0:
            del self._num_sticky[url]
