"""The run's engine API key: only the run's own processes may call its engines' HTTP routes.

An engine (the embedded one, or SGLang with ``--api-key``) serves ``/generate``, weight loading
and aborts on the node's address, where every user of a shared node can reach it. The controller
draws a fresh key each time it starts, writes it to a 0600 file in the run folder (a command line
is readable by every local user through ``/proc/<pid>/cmdline``; the file is not), and hands the
file's path to the cells and the proxy. Requests carry ``Authorization: Bearer <key>``, as SGLang
checks them; ``/health`` (and SGLang's ``/metrics``) stay open. SGLang itself gets the key through
its environment (``ENV``), appended to its arguments inside its own process.

Standard library only: the controller, cells and proxy all import it.
"""

from __future__ import annotations

import hmac
import os
import secrets
from pathlib import Path

ENV = "GYRE_ENGINE_API_KEY"
"""Where a launched SGLang server finds the key (a process's environment is its owner's only)."""
OPEN_PREFIXES = ("/health", "/metrics")
"""Routes answered without the key, as SGLang does: liveness probes and Prometheus."""


def write_key(path: Path) -> Path:
    """A new key in a new 0600 file at ``path``; returns ``path``."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.unlink(missing_ok=True)
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(secrets.token_hex(32))
    os.replace(tmp, path)
    return path


def read_key(path: str | Path) -> str:
    """The key ``write_key`` left; ValueError if others can read the file or it is not a key."""
    st = os.stat(path)
    if st.st_mode & 0o077:
        raise ValueError(f"{path}: mode {oct(st.st_mode & 0o777)}, want 0600 (a key other users can read)")
    key = Path(path).read_text().strip()
    if len(key) < 32 or not all(c in "0123456789abcdef" for c in key):
        raise ValueError(f"{path}: want a hex key of at least 32 characters")
    return key


def headers(key: str) -> dict[str, str]:
    """What a request to an engine carries (nothing when the engine is open)."""
    return {"Authorization": f"Bearer {key}"} if key else {}


def allowed(key: str, path: str, authorization: str | None) -> bool:
    """Whether a request for ``path`` with that Authorization header may pass (``key`` "" = open)."""
    if not key or path.startswith(OPEN_PREFIXES):
        return True
    return hmac.compare_digest((authorization or "").encode(), f"Bearer {key}".encode())
