"""CURVE between a run's members: per-member keys, only members connect, each frame names its sender."""

from __future__ import annotations

import zmq
import pytest

from base import curve


@pytest.fixture
def keys_dir(tmp_path):
    folder = tmp_path / "keys"
    curve.create_keys(folder, curve.member_names(2))
    yield folder
    curve.stop()
    curve.install(None, "")  # plain sockets again for the rest of the session


def member_client(ctx: zmq.Context, keys_dir, name: str, server: str, addr: str) -> zmq.Socket:
    k = curve.load_keys(keys_dir, name)
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.CURVE_SECRETKEY, k.secret)
    sock.setsockopt(zmq.CURVE_PUBLICKEY, k.public)
    sock.setsockopt(zmq.CURVE_SERVERKEY, k.public_of(server))
    sock.connect(addr)
    return sock


def test_keys_are_private_and_checked(keys_dir):
    assert keys_dir.stat().st_mode & 0o777 == 0o700
    assert all(p.stat().st_mode & 0o777 == 0o600 for p in keys_dir.glob("*.secret"))
    k = curve.load_keys(keys_dir, "cell-1")
    assert k.name_of(k.public) == "cell-1" and set(k.peers) == {"controller", "processor", "proxy", "cell-0", "cell-1"}
    (keys_dir / "cell-1.secret").chmod(0o644)
    with pytest.raises(curve.CurveError, match="want 0600"):
        curve.load_keys(keys_dir, "cell-1")
    with pytest.raises(curve.CurveError, match="No such file"):
        curve.load_keys(keys_dir, "cell-7")
    (keys_dir / "proxy.secret").write_bytes((keys_dir / "cell-0.secret").read_bytes())  # a swapped key
    with pytest.raises(curve.CurveError, match="not proxy's"):
        curve.load_keys(keys_dir, "proxy")


def test_only_members_connect_and_each_frame_names_its_sender(keys_dir):
    curve.install(keys_dir, "controller")
    ctx = zmq.Context()
    router = ctx.socket(zmq.ROUTER)
    router.setsockopt(zmq.LINGER, 0)
    curve.server(router)
    router.bind("tcp://127.0.0.1:0")
    addr = router.getsockopt_string(zmq.LAST_ENDPOINT)
    socks = [router]
    try:
        # a stranger without keys, and one with its own key pair and the server's (public) key
        plain = ctx.socket(zmq.DEALER)
        plain.setsockopt(zmq.LINGER, 0)
        plain.connect(addr)
        public, secret = zmq.curve_keypair()
        own = ctx.socket(zmq.DEALER)
        own.setsockopt(zmq.LINGER, 0)
        own.setsockopt(zmq.CURVE_SECRETKEY, secret)
        own.setsockopt(zmq.CURVE_PUBLICKEY, public)
        own.setsockopt(zmq.CURVE_SERVERKEY, curve.keys().public_of("controller"))
        own.connect(addr)
        socks += [plain, own]
        plain.send(b"plain")
        own.send(b"own key")
        assert not router.poll(1500)
        member = member_client(ctx, keys_dir, "cell-1", "controller", addr)
        socks.append(member)
        member.send(b"hello")
        assert router.poll(5000)
        _, body = router.recv_multipart(copy=False)
        assert (body.bytes, curve.sender(body)) == (b"hello", "cell-1")
    finally:
        for s in socks:
            s.close(0)
        curve.stop()
        ctx.term()


def test_without_keys_sockets_are_plain():
    curve.install(None, "controller")
    ctx = zmq.Context()
    a, b = ctx.socket(zmq.PULL), ctx.socket(zmq.PUSH)
    try:
        curve.server(a)
        curve.client(b, "controller")
        assert a.getsockopt(zmq.MECHANISM) == zmq.NULL and b.getsockopt(zmq.MECHANISM) == zmq.NULL
        port = a.bind_to_random_port("tcp://127.0.0.1")
        b.connect(f"tcp://127.0.0.1:{port}")
        b.send(b"x")
        assert a.poll(5000)
        assert curve.sender(a.recv(copy=False)) is None
    finally:
        a.close(0)
        b.close(0)
        ctx.term()


def test_attempts_in_one_process_each_own_their_context_and_zap_handler(keys_dir):
    """What ``run.auto_resume`` does: attempt after attempt in one process, each on a context of its
    own that it terminates at its end. Every attempt gets a working ZAP handler (a stranger with the
    server's public key is refused, a member admitted) and its context terminates: none is left
    holding the handler's inproc endpoint for the next (once 'Address already in use')."""
    curve.install(keys_dir, "controller")
    for _ in range(12):
        ctx = zmq.Context()
        router = ctx.socket(zmq.ROUTER)
        router.setsockopt(zmq.LINGER, 0)
        curve.server(router)
        router.bind("tcp://127.0.0.1:0")
        addr = router.getsockopt_string(zmq.LAST_ENDPOINT)
        public, secret = zmq.curve_keypair()
        stranger = ctx.socket(zmq.DEALER)
        stranger.setsockopt(zmq.LINGER, 0)
        stranger.setsockopt(zmq.CURVE_SECRETKEY, secret)
        stranger.setsockopt(zmq.CURVE_PUBLICKEY, public)
        stranger.setsockopt(zmq.CURVE_SERVERKEY, curve.keys().public_of("controller"))
        stranger.connect(addr)
        member = member_client(ctx, keys_dir, "cell-1", "controller", addr)
        stranger.send(b"stranger")
        member.send(b"member")
        assert router.poll(5000)
        _, body = router.recv_multipart(copy=False)
        assert (body.bytes, curve.sender(body)) == (b"member", "cell-1")
        assert not router.poll(300)
        for s in (router, stranger, member):
            s.close(0)
        curve.stop(ctx)
        ctx.term()  # returns only once every socket of the context, the handler's included, is gone
