"""Per-execution bearer tokens: stateless, HMAC-signed, one per harness run.

A token is ``gyre.<execution_id>.<min_version>.<t|e>.<hex HMAC-SHA256(secret, all three)>``.
Whoever holds the secret (the controller mints, the proxy verifies) can check a token without a
table, so a proxy restart loses nothing. ``min_version`` is the oldest weight version the
execution's step accepts (step - staleness): it travels with every call, so the proxy never routes
a call to an engine that is too old, even before the routing table that drops that engine arrives.
``t``/``e`` says whether the execution trains (the proxy then samples at the run's rollout
parameters, whatever the harness asks) or is evaluated (the harness's own parameters stand).

Tokens end with their run: the controller draws a fresh secret each time it starts (a resumed run
too), so no token of another run, or of an earlier attempt of this one, verifies. Revoking the
tokens of sealed executions is the proxy's (``harness_proxy.auth.Revocations``). Standard library only.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import re
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
