"""The proxy's side of execution tokens (``base.execution_token``): the bearer header, and the
executions it sealed, whose tokens it refuses from then on.

Within a run, ``Revocations`` holds the executions the proxy sealed, in bounded memory.
"""

from __future__ import annotations

import heapq
from collections import OrderedDict

from base.execution_token import TokenClaims

def bearer_token(authorization: str | None) -> str | None:
    """The token of an ``Authorization: Bearer <token>`` header value, or None."""
    if not authorization:
        return None
    scheme, _, value = authorization.strip().partition(" ")
    if scheme.lower() != "bearer" or not value.strip():
        return None
    return value.strip()


class Revocations:
    """Sealed executions, whose tokens are refused from then on, in at most ``capacity`` entries.

    Each seal is kept exactly (with the call count it was sealed with, so a repeated seal repeats
    it) until ``capacity`` are held. Past that, the entry with the lowest token floor
    (``min_version``, learnt from the token the execution last presented) is evicted and the
    *version floor* rises above it: from then on a token whose ``min_version`` is below the floor
    is refused unless its execution is live here (it presented its token before and is not sealed).

    Why that stays correct. The evicted execution's token has ``min_version`` below the floor, and
    its execution is no longer live (it was sealed), so its token is still refused: eviction loses
    no revocation. The floor never refuses an execution that has already called. It could only
    refuse one that has not called yet although ``capacity`` executions with a floor at least as
    high as its own have been sealed since it was minted; the controller mints a token when it
    launches the execution and keeps planned work within ``scheduler.staleness`` steps of the
    trained version, so a live execution's floor trails the sealed ones by a few steps' worth of
    executions, far fewer than ``capacity``. Such a refusal would be counted
    (``token_revoked``) and say "expired", never pass silently.

    An execution sealed before it ever called has no known ``min_version``: its entry is evicted
    only when no entry with a known one is left, oldest first, and is then no longer refused
    (``num_evicted_unfloored`` counts them). Its harness has exited by then (the controller seals
    an execution once its run ended), and a record it made would reach the processor after its
    ``ExecutionSealed`` and be dropped there as late. ``revoke`` takes ``min_version`` for the day
    ``SealExecution`` carries it.
    """

    def __init__(self, capacity: int):
        if capacity < 1:
            raise ValueError(f"capacity: want >= 1, got {capacity!r}")
        self.capacity = capacity
        self.floor = 0
        self.num_evicted = 0
        self.num_evicted_unfloored = 0
        self._known: dict[str, tuple[int, int]] = {}  # execution id -> (num_calls, min_version)
        self._heap: list[tuple[int, int, str]] = []  # (min_version, seal order, execution id)
        self._unknown: OrderedDict[str, int] = OrderedDict()  # execution id -> num_calls, oldest first
        self._order = 0

    def __len__(self) -> int:
        return len(self._known) + len(self._unknown)

    def num_calls(self, execution_id: str) -> int | None:
        """The call count ``execution_id`` was sealed with, or None when it is not held."""
        if execution_id in self._known:
            return self._known[execution_id][0]
        return self._unknown.get(execution_id)

    def is_sealed(self, execution_id: str) -> bool:
        return execution_id in self._known or execution_id in self._unknown

    def revoke(self, execution_id: str, num_calls: int, min_version: int | None) -> int:
        """Seal ``execution_id``; return the call count it was first sealed with (a repeat keeps it)."""
        held = self.num_calls(execution_id)
        if held is not None:
            return held
        if min_version is None:
            self._unknown[execution_id] = num_calls
        else:
            self._known[execution_id] = (num_calls, min_version)
            self._order += 1
            heapq.heappush(self._heap, (min_version, self._order, execution_id))
        while len(self) > self.capacity:
            self._evict()
        return num_calls

    def _evict(self) -> None:
        self.num_evicted += 1
        if self._heap:
            min_version, _, execution_id = heapq.heappop(self._heap)
            del self._known[execution_id]
            self.floor = max(self.floor, min_version + 1)
        else:
            self._unknown.popitem(last=False)
            self.num_evicted_unfloored += 1

    def refusal(self, claims: TokenClaims, *, live: bool) -> str | None:
        """Why a verified token is refused, or None when it is not. ``live``: its execution has
        presented a token here before and is not sealed."""
        if self.is_sealed(claims.execution_id):
            return f"execution {claims.execution_id} is sealed; its token is revoked"
        if claims.min_version < self.floor and not live:
            return (f"execution {claims.execution_id}'s token has expired (weight floor v{claims.min_version}"
                    f" < v{self.floor}, the oldest this proxy still takes from a new execution)")
        return None

    def stats(self) -> dict[str, int]:
        return {"held": len(self), "capacity": self.capacity, "floor": self.floor, "evicted": self.num_evicted,
                "evicted_unfloored": self.num_evicted_unfloored}
