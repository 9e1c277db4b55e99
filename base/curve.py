"""CURVE on every ZeroMQ socket between a run's processes, and who sent each frame.

Each member of a run (``controller``, ``processor``, ``proxy``, ``cell-<i>``) has its own CURVE
key pair. The keys folder (``runs/<id>/keys/``, mode 0700, made per attempt, or a site folder made
once with ``python -m base.curve DIR --cells N``) holds ``peers.json``, every member's public
key by name, and ``<name>.secret``, each member's secret key (0600). A process is told the folder
(``--curve-keys DIR``, a path, never a key, on its command line) and its own name.

Every bound socket is a CURVE server with this process's key, and its context runs a ZAP handler
that admits only the run's members and names the connection's User-Id after the member; every
connecting socket authenticates with its own key and pins the server's public key. So a process
without a member's secret key cannot connect at all, and a receiver learns from a frame's
User-Id (``sender``) which member sent it, whatever the frame claims.

With no folder (``install`` not called) sockets are plain: the unit tests that drive one process
by hand, and ``cluster.curve=false``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import sys
import threading
from dataclasses import dataclass
from pathlib import Path

import zmq
from zmq.auth.thread import ThreadAuthenticator
from zmq.utils import z85

log = logging.getLogger(__name__)

PEERS_FILE = "peers.json"
ZAP_DOMAIN = "gyre"


class CurveError(RuntimeError):
    pass


@dataclass(frozen=True)
class RunKeys:
    name: str
    public: bytes
    secret: bytes
    peers: dict[str, bytes]
    """Every member's public key (z85) by name."""
    core: str = ""
    """The core cell's name, for ``public_of("core")``: the weight and gradient servers are its."""

    def public_of(self, name: str) -> bytes:
        if name == "core" and self.core:
            name = self.core
        try:
            return self.peers[name]
        except KeyError:
            raise CurveError(f"no member {name!r} in the run's keys ({sorted(self.peers)})") from None

    def name_of(self, public: bytes) -> str | None:
        return next((n for n, k in self.peers.items() if k == public), None)


def member_names(num_cells: int) -> list[str]:
    return ["controller", "processor", "proxy", *(f"cell-{i}" for i in range(num_cells))]


def create_keys(folder: Path, names: list[str]) -> None:
    """A fresh key pair per member; the folder private to this user."""
    folder.mkdir(parents=True, exist_ok=True)
    folder.chmod(0o700)
    peers = {}
    for name in names:
        public, secret = zmq.curve_keypair()
        path = folder / f"{name}.secret"
        path.unlink(missing_ok=True)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "wb") as f:
            f.write(secret)
        peers[name] = public.decode("ascii")
    tmp = folder / (PEERS_FILE + ".tmp")
    tmp.write_text(json.dumps(peers, indent=1))
    os.replace(tmp, folder / PEERS_FILE)


def load_keys(folder: Path, name: str) -> RunKeys:
    """This member's keys; CurveError naming the file when something is missing or open to others."""
    secret_path = folder / f"{name}.secret"
    try:
        st = secret_path.stat()
        if st.st_mode & 0o077:
            raise CurveError(f"{secret_path}: mode {oct(st.st_mode & 0o777)}, want 0600")
        secret = secret_path.read_bytes().strip()
        peers_raw = json.loads((folder / PEERS_FILE).read_text())
    except OSError as exc:
        raise CurveError(f"CURVE keys: {exc}") from None
    except ValueError as exc:
        raise CurveError(f"{folder / PEERS_FILE}: {exc}") from None
    if not isinstance(peers_raw, dict) or not all(isinstance(v, str) and len(v) == 40 for v in peers_raw.values()):
        raise CurveError(f"{folder / PEERS_FILE}: want {{name: 40-character z85 public key}}")
    peers = {str(n): v.encode("ascii") for n, v in peers_raw.items()}
    if len(secret) != 40:
        raise CurveError(f"{secret_path}: want a 40-character z85 secret key")
    public = zmq.curve_public(secret)
    if peers.get(name) != public:
        raise CurveError(f"{secret_path}: its public key is not {name}'s in {PEERS_FILE}")
    return RunKeys(name=name, public=public, secret=secret, peers=peers)


# ---------------------------------------------------------------- this process's keys and sockets

_keys: RunKeys | None = None
_auth: dict[zmq.Context, ThreadAuthenticator] = {}
_lock = threading.Lock()


def install(folder: str | Path | None, name: str, *, core: str = "") -> RunKeys | None:
    """Load this process's keys (None, plain sockets, when ``folder`` is empty)."""
    global _keys
    _keys = dataclasses.replace(load_keys(Path(folder), name), core=core) if folder else None
    return _keys


def keys() -> RunKeys | None:
    return _keys


class _Members:
    """ZAP: admit the run's members only."""

    def __init__(self, run_keys: RunKeys):
        self.allowed = set(run_keys.peers.values())

    def callback(self, domain: str, key: bytes) -> bool:
        return key in self.allowed


class _Authenticator(ThreadAuthenticator):
    def __init__(self, context: zmq.Context, run_keys: RunKeys):
        super().__init__(context, log=logging.getLogger("base.curve.zap"))
        self.run_keys = run_keys

    def curve_user_id(self, client_public_key: bytes) -> str:
        # libzmq hands over the raw 32 bytes; the run's keys are z85
        return self.run_keys.name_of(z85.encode(client_public_key)) or "?"


def _ensure_authenticator(ctx: zmq.Context, run_keys: RunKeys) -> None:
    """One ZAP handler per context, started before its first server socket binds: without one,
    libzmq would admit any client that knows the server's (public) key. Keyed by the context
    itself, not its ``id()``: a new context may reuse a closed one's id, and must get its own."""
    with _lock:
        if ctx in _auth:
            return
        auth = _Authenticator(ctx, run_keys)
        auth.start()
        auth.configure_curve_callback(domain=ZAP_DOMAIN, credentials_provider=_Members(run_keys))
        _auth[ctx] = auth


def server(sock: zmq.Socket) -> None:
    """Make ``sock`` (before it binds) a CURVE server admitting the run's members."""
    if _keys is None:
        return
    _ensure_authenticator(sock.context, _keys)
    sock.setsockopt(zmq.ZAP_DOMAIN, ZAP_DOMAIN.encode())
    sock.setsockopt(zmq.CURVE_SERVER, 1)
    sock.setsockopt(zmq.CURVE_SECRETKEY, _keys.secret)
    sock.setsockopt(zmq.CURVE_PUBLICKEY, _keys.public)


def client(sock: zmq.Socket, server_name: str) -> None:
    """Make ``sock`` (before it connects) a CURVE client of member ``server_name``."""
    if _keys is None:
        return
    sock.setsockopt(zmq.CURVE_SECRETKEY, _keys.secret)
    sock.setsockopt(zmq.CURVE_PUBLICKEY, _keys.public)
    sock.setsockopt(zmq.CURVE_SERVERKEY, _keys.public_of(server_name))


def sender(frame: zmq.Frame) -> str | None:
    """The member that sent ``frame`` (received with ``copy=False``), None when CURVE is off."""
    if _keys is None:
        return None
    try:
        return frame.get("User-Id")
    except zmq.ZMQError:
        return "?"


def stop(ctx: zmq.Context | None = None) -> None:
    """Stop the ZAP handler of ``ctx`` (every context's when None, at exit), so the context can be
    terminated: the handler's sockets live in it."""
    with _lock:
        for c in [ctx] if ctx is not None else list(_auth):
            auth = _auth.pop(c, None)
            if auth is not None:
                auth.stop()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m base.curve",
                                description="Make a site keys folder for cluster.curve_keys")
    p.add_argument("folder", type=Path)
    p.add_argument("--cells", type=int, required=True)
    args = p.parse_args(argv)
    create_keys(args.folder, member_names(args.cells))
    print(f"CURVE keys for {args.cells} cells in {args.folder} (peers.json public, *.secret 0600)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
