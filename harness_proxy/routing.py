"""Which serving engine takes a call: the latest routing table, stickiness, least load.

The controller sends ``RoutingTable``s; a newer ``version`` replaces the one held, an older or
equal one is ignored (messages may arrive late). A call goes to the engine its (execution id,
agent) last used while that engine is still in the table, so the engine's prefix cache keeps the
agent's history warm; otherwise to the engine with the fewest in-flight calls, ties broken by the
fewest sticky agents, then by cell id and url, so the choice is reproducible. Engines whose listed
weight version is below the call's ``min_version`` (from the execution's token) are never chosen. The choice itself is
the pure function ``pick_engine``; ``Router`` holds the state around it. No I/O here.
"""

from __future__ import annotations

import contextlib
import logging
from collections import Counter
from collections.abc import Collection, Iterator, Mapping, Sequence

from controller.wire import EngineRoute, RoutingTable

log = logging.getLogger(__name__)


def pick_engine(
    engines: Sequence[EngineRoute],
    *,
    in_flight: Mapping[str, int],
    num_sticky: Mapping[str, int],
    sticky_url: str | None = None,
    exclude: Collection[str] = (),
    min_version: int = 0,
) -> EngineRoute | None:
    """The engine for one call, or None when no engine has ``weight_version >= min_version``.

    ``exclude`` holds engines that already failed this call; when every new-enough engine is
    excluded the choice falls back to all of them (one may have recovered).
    """
    fresh = [e for e in engines if e.weight_version >= min_version]
    candidates = [e for e in fresh if e.url not in exclude] or fresh
    if not candidates:
        return None
    if sticky_url is not None:
        for e in candidates:
            if e.url == sticky_url:
                return e
    return min(candidates, key=lambda e: (in_flight.get(e.url, 0), num_sticky.get(e.url, 0), e.cell_id, e.url))


class Router:
    """The routing table, in-flight counts and sticky bindings of one proxy (one event loop)."""

    def __init__(self) -> None:
        self.table = RoutingTable(version=-1, engines=[])
        self._in_flight: Counter[str] = Counter()
        self._sticky: dict[str, dict[str, str]] = {}  # execution id -> agent -> engine url
        self._num_sticky: Counter[str] = Counter()

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
        )
        if route is not None:
            self._bind(execution_id, agent, route.url)
        return route

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
