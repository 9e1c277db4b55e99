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
are never chosen.

A new session (no server pinned yet: a new execution, a sub-agent) prefers the server that holds
the longest prefix of its prompt, since each engine keeps one prefix cache across sessions: the
executions of a group start with the same harness prompt, and one server computes it instead of
every server it lands on. ``PrefixIndex`` remembers the first prompts of the sessions each server
took under its current weight version (a new version empties that server's cache). The preference
never starves the others: a holder is chosen only while its in-flight calls are at most
``affinity_slack`` above the least-loaded candidate's, as SGLang's cache-aware router balances
load before cache hits. The choice itself is the pure function ``pick_engine``; ``Router`` holds
the state around it (its clock passed in). No I/O here.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections import Counter
from collections.abc import Callable, Collection, Iterator, Mapping, Sequence

import numpy as np

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
    prefix_match: Mapping[str, int] | None = None,
    min_prefix: int = 1,
    affinity_slack: int = 0,
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
    load = {e.url: in_flight.get(e.url, 0) for e in candidates}
    least = min(load.values())
    holders = [e for e in candidates if (prefix_match or {}).get(e.url, 0) >= max(1, min_prefix)
               and load[e.url] <= least + affinity_slack]
    if holders:  # the longest prefix held; ties as below
        return min(holders, key=lambda e: (-prefix_match[e.url], load[e.url], num_sticky.get(e.url, 0), e.cell_id, e.url))
    return min(candidates, key=lambda e: (load[e.url], num_sticky.get(e.url, 0), e.cell_id, e.url))


class PrefixIndex:
    """The first prompts of the sessions each server took, per server, while its weights stay.

    ``match`` gives, per server, the longest common prefix of a prompt with any prompt it holds:
    what that server's prefix cache can at best serve. Bounded: ``per_server`` prompts per server,
    each cut to ``max_ids`` ids (the shared part of harness prompts is their head); the oldest go
    first. An engine's cache holds more than this index (every call's history), and may have
    evicted some of it: the index is a hint for routing, never a claim about KV.
    """

    def __init__(self, *, per_server: int = 64, max_ids: int = 65536) -> None:
        self.per_server, self.max_ids = per_server, max_ids
        self._prompts: dict[str, list[np.ndarray]] = {}
        self._versions: dict[str, int] = {}

    def record(self, url: str, version: int, prompt_ids: Sequence[int]) -> None:
        if self._versions.get(url) != version:
            self._prompts[url], self._versions[url] = [], version
        held = self._prompts[url]
        held.append(np.asarray(prompt_ids[: self.max_ids], dtype=np.int64))
        del held[: max(0, len(held) - self.per_server)]

    def match(self, engines: Sequence[EngineRoute], prompt_ids: Sequence[int]) -> dict[str, int]:
        ids = np.asarray(prompt_ids[: self.max_ids], dtype=np.int64)
        out: dict[str, int] = {}
        for e in engines:
            if self._versions.get(e.url) == e.weight_version and self._prompts.get(e.url):
                out[e.url] = max(_common_prefix(ids, held) for held in self._prompts[e.url])
        return out


def _common_prefix(a: np.ndarray, b: np.ndarray) -> int:
    n = min(len(a), len(b))
    differ = np.flatnonzero(a[:n] != b[:n])
    return int(differ[0]) if len(differ) else n


class Router:
    """The routing table, in-flight counts and sticky bindings of one proxy (one event loop)."""

    def __init__(self, *, clock: Callable[[], float] = time.monotonic, down_s: float = DOWN_S,
                 affinity_slack: int = 0, min_prefix: int = 1) -> None:
        """``affinity_slack``, ``min_prefix``: a new session goes to a server holding at least
        ``min_prefix`` ids of its prompt while that server has at most ``affinity_slack`` more
        calls in flight than the least-loaded one (ProxyConfig has their meaning)."""
        self.table = RoutingTable(version=-1, engines=[])
        self.prefixes = PrefixIndex()
        self._affinity_slack, self._min_prefix = affinity_slack, min_prefix
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
        self, execution_id: str, agent: str, *, exclude: Collection[str] = (), min_version: int = 0,
        prompt_ids: Sequence[int] = (),
    ) -> EngineRoute | None:
        """Pick an engine (none older than ``min_version``) and make it the agent's sticky one; a
        new session's ``prompt_ids`` steer it to a server holding their prefix."""
        sticky = self.sticky_url(execution_id, agent)
        new_session = sticky is None and len(prompt_ids) > 0
        route = pick_engine(
            self.table.engines, in_flight=self._in_flight, num_sticky=self._num_sticky,
            sticky_url=sticky, exclude=exclude, min_version=min_version, down=self.down(),
            prefix_match=self.prefixes.match(self.table.engines, prompt_ids) if new_session else None,
            min_prefix=self._min_prefix, affinity_slack=self._affinity_slack,
        )
        if route is not None:
            self._bind(execution_id, agent, route.url)
            if new_session:
                self.prefixes.record(route.url, route.weight_version, prompt_ids)
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
