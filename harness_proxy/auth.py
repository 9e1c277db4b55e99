"""Per-execution bearer tokens: stateless, HMAC-signed, one per harness run.

A token is ``gyre.<execution_id>.<hex HMAC-SHA256(secret, execution_id)>``. Whoever holds the
secret (the controller mints, the proxy verifies) can check a token without a table, so a proxy
restart loses nothing. Revocation is not here: the proxy refuses tokens of sealed executions from
its own set. Standard library only, so the controller can import it.
"""

from __future__ import annotations

import hashlib
import hmac
import re

TOKEN_PREFIX = "gyre"
EXECUTION_ID_RE = re.compile(r"[A-Za-z0-9_-]{1,64}")
_MAC_HEX_LEN = 64
_DOMAIN = b"gyre-execution-token/1:"  # keeps these MACs distinct from any other use of the secret


def _mac(secret: bytes, execution_id: str) -> str:
    return hmac.new(secret, _DOMAIN + execution_id.encode("ascii"), hashlib.sha256).hexdigest()


def mint_token(secret: bytes, execution_id: str) -> str:
    """The bearer token for one execution; raise ValueError for an id outside ``[A-Za-z0-9_-]{1,64}``."""
    if not secret:
        raise ValueError("secret: empty")
    if not EXECUTION_ID_RE.fullmatch(execution_id):
        raise ValueError(f"execution_id: want [A-Za-z0-9_-]{{1,64}}, got {execution_id!r}")
    return f"{TOKEN_PREFIX}.{execution_id}.{_mac(secret, execution_id)}"


def verify_token(secret: bytes, token: str) -> str | None:
    """The execution id a token was minted for, or None for anything else (never raises)."""
    if not isinstance(token, str) or len(token) > 200 or not secret:
        return None
    parts = token.split(".")
    if len(parts) != 3 or parts[0] != TOKEN_PREFIX:
        return None
    _, execution_id, mac = parts
    if not EXECUTION_ID_RE.fullmatch(execution_id) or len(mac) != _MAC_HEX_LEN:
        return None
    if not hmac.compare_digest(mac.encode("ascii", "replace"), _mac(secret, execution_id).encode("ascii")):
        return None
    return execution_id


def bearer_token(authorization: str | None) -> str | None:
    """The token of an ``Authorization: Bearer <token>`` header value, or None."""
    if not authorization:
        return None
    scheme, _, value = authorization.strip().partition(" ")
    if scheme.lower() != "bearer" or not value.strip():
        return None
    return value.strip()
