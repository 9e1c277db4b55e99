"""Per-execution bearer tokens: stateless, HMAC-signed, one per harness run.

A token is ``gyre.<execution_id>.<min_version>.<t|e>.<hex HMAC-SHA256(secret, all three)>``.
Whoever holds the secret (the controller mints, the proxy verifies) can check a token without a
table, so a proxy restart loses nothing. ``min_version`` is the oldest weight version the
execution's step accepts (step - staleness): it travels with every call, so the proxy never routes
a call to an engine that is too old, even before the routing table that drops that engine arrives.
``t``/``e`` says whether the execution trains (the proxy then samples at the run's rollout
parameters, whatever the harness asks) or is evaluated (the harness's own parameters stand).

Tokens end with their run: the controller draws a fresh secret each time it starts (a resumed run
too), so no token of another run, or of an earlier attempt of this one, verifies. Within a run,
``Revocations`` holds the executions the proxy sealed, whose tokens it refuses, in bounded memory.
Standard library only, so the controller can import it.
"""

from __future__ import annotations

import hashlib
import heapq
import hmac
import os
import re
from collections import OrderedDict
from pathlib import Path
from typing import NamedTuple

TOKEN_PREFIX = "gyre"
EXECUTION_ID_RE = re.compile(r"[A-Za-z0-9_-]{1,64}")
_VERSION_RE = re.compile(r"0|[1-9][0-9]{0,9}")
_MAC_HEX_LEN = 64
_MODES = {"t": True, "e": False}
_DOMAIN = b"gyre-execution-token/3:"  # keeps these MACs distinct from any other use of the secret


class TokenClaims(NamedTuple):
    execution_id: str
    min_version: int
    train: bool = True
    """A training execution (sampled at the run's rollout parameters), not an eval one."""


def _mac(secret: bytes, execution_id: str, min_version: int, mode: str) -> str:
    return hmac.new(secret, _DOMAIN + f"{execution_id}.{min_version}.{mode}".encode("ascii"), hashlib.sha256).hexdigest()


def mint_token(secret: bytes, execution_id: str, *, min_version: int = 0, train: bool = True) -> str:
    """The bearer token for one execution; raise ValueError for an id outside ``[A-Za-z0-9_-]{1,64}``
    or a ``min_version`` that is not an integer in [0, 10**10)."""
    if not secret:
        raise ValueError("secret: empty")
    if not EXECUTION_ID_RE.fullmatch(execution_id):
        raise ValueError(f"execution_id: want [A-Za-z0-9_-]{{1,64}}, got {execution_id!r}")
    if isinstance(min_version, bool) or not isinstance(min_version, int) or not 0 <= min_version < 10**10:
        raise ValueError(f"min_version: want an integer in [0, 10**10), got {min_version!r}")
    mode = "t" if train else "e"
    return f"{TOKEN_PREFIX}.{execution_id}.{min_version}.{mode}.{_mac(secret, execution_id, min_version, mode)}"


def verify_token(secret: bytes, token: str) -> TokenClaims | None:
    """What a token was minted for, or None for anything else (never raises)."""
    if not isinstance(token, str) or len(token) > 200 or not secret:
        return None
    parts = token.split(".")
    if len(parts) != 5 or parts[0] != TOKEN_PREFIX:
        return None
    _, execution_id, version, mode, mac = parts
    if (not EXECUTION_ID_RE.fullmatch(execution_id) or not _VERSION_RE.fullmatch(version) or mode not in _MODES
            or len(mac) != _MAC_HEX_LEN):
        return None
    min_version = int(version)
    want = _mac(secret, execution_id, min_version, mode)
    if not hmac.compare_digest(mac.encode("ascii", "replace"), want.encode("ascii")):
        return None
    return TokenClaims(execution_id, min_version, _MODES[mode])


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


def write_secret(path: Path, secret: bytes) -> None:
    """The secret as hex in a new file only this user can read: never on a command line, where
    every local user reads it from /proc/<pid>/cmdline."""
    path.unlink(missing_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(secret.hex())


def read_secret(path: Path) -> bytes:
    """The secret ``write_secret`` left; ValueError if the file is readable by others or not a secret."""
    st = os.stat(path)
    if st.st_mode & 0o077:
        raise ValueError(f"{path}: mode {oct(st.st_mode & 0o777)}, want 0600 (a secret other users can read)")
    secret = bytes.fromhex(path.read_text().strip())
    if len(secret) < 16:
        raise ValueError(f"{path}: want at least 16 bytes of secret, hex")
    return secret
