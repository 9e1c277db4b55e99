"""The proxy under abuse, over real HTTP: slow-loris heads and bodies, oversize bodies, tokens of
sealed, evicted and foreign executions. Each is refused in the API's own error shape (official
``openai`` and ``anthropic`` SDKs where an SDK can send the request, raw sockets where none would),
counted at ``GET /stats`` and logged once per source."""

from __future__ import annotations

import json
import logging
import select
import socket
import threading
import time
from typing import Any
from urllib.parse import urlsplit

import anthropic
import openai
import pytest
from hypothesis import given
from hypothesis import strategies as st

from base.execution_token import TokenClaims, mint_token
from harness_proxy.auth import Revocations
from harness_proxy.main import serve_unix_socket
from tests.harness_proxy import SECRET, LiveProxy

READ_TIMEOUT_S = 1.0
LIMIT = 65536
MSGS = [{"role": "user", "content": "hi"}]


@pytest.fixture
def proxy():
    p = LiveProxy(num_engines=1, read_timeout_s=READ_TIMEOUT_S, max_request_bytes=LIMIT)
    yield p
    p.close()


# ---------------------------------------------------------------- helpers


def stats(proxy: LiveProxy) -> dict[str, Any]:
    sock = connect(proxy)
    sock.sendall(b"GET /stats HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
    status, _, body = read_response(sock)
    sock.close()
    assert status == 200
    return json.loads(body)


def connect(proxy: LiveProxy) -> socket.socket:
    parts = urlsplit(proxy.url)
    return socket.create_connection((parts.hostname, parts.port), timeout=30)


def read_response(sock: socket.socket) -> tuple[int, dict[str, str], bytes]:
    """One HTTP response: status, headers (lower-case names), body (by Content-Length)."""
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(65536)
        assert chunk, f"connection closed before a response head: {data!r}"
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    headers = {k.strip().lower(): v.strip() for k, _, v in (ln.partition(":") for ln in lines[1:])}
    length = int(headers.get("content-length", "0"))
    while len(body) < length:
        chunk = sock.recv(65536)
        assert chunk, "connection closed mid-body"
        body += chunk
    return int(lines[0].split(" ")[1]), headers, body[:length]


def closed_by_peer(sock: socket.socket) -> bool:
    try:
        return sock.recv(1) == b""
    except ConnectionResetError:
        return True


def trickle(sock: socket.socket, first: bytes, drip: bytes, *, every_s: float = 0.05, limit_s: float = 30.0) -> int:
    """Send ``first``, then one byte of ``drip`` every ``every_s`` until the proxy answers; return bytes dripped."""
    sock.sendall(first)
    deadline = time.monotonic() + limit_s
    n = 0
    while time.monotonic() < deadline:
        readable, _, _ = select.select([sock], [], [], every_s)
        if readable:
            return n
        sock.sendall(drip[n % len(drip):][:1])
        n += 1
    raise AssertionError(f"no answer within {limit_s} s while trickling")


def head(path: str, token: str | None, *, extra: str = "") -> bytes:
    auth = f"Authorization: Bearer {token}\r\n" if token else ""
    return f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n{auth}{extra}".encode()


def abuse_lines(caplog: pytest.LogCaptureFixture, kind: str, source: str) -> list[str]:
    want = f"refused {kind} from {source}:"
    return [r.getMessage() for r in caplog.records if r.name == "harness_proxy.abuse" and want in r.getMessage()]


def is_anthropic_error(body: dict[str, Any], kind: str) -> bool:
    return set(body) == {"type", "error"} and body["type"] == "error" and body["error"]["type"] == kind \
        and isinstance(body["error"]["message"], str) and body["error"]["message"]


def is_openai_error(body: dict[str, Any], code: str) -> bool:
    return set(body) == {"error"} and {"message", "type", "code"} <= set(body["error"]) \
        and body["error"]["code"] == code and body["error"]["message"]


# ---------------------------------------------------------------- slow-loris


def test_slow_loris_heads_are_dropped_while_other_clients_are_served(proxy, caplog):
    caplog.set_level(logging.WARNING, logger="harness_proxy.abuse")
    paths = ["/v1/messages", "/v1/chat/completions"] * 3
    socks = [connect(proxy) for _ in paths]
    silent = connect(proxy)  # opens and never sends
    results: dict[int, tuple[int, Any, bool]] = {}

    def slow(i: int) -> None:
        # The head trickles one byte at a time, forever: the deadline is not pushed back by bytes.
        trickle(socks[i], head(paths[i], None) + b"X-Slow: ", b"abcdefgh")
        status, _, body = read_response(socks[i])
        results[i] = (status, json.loads(body), closed_by_peer(socks[i]))

    threads = [threading.Thread(target=slow, args=(i,)) for i in range(len(paths))]
    for t in threads:
        t.start()
    # Meanwhile everyone else is served, through both APIs.
    reply = proxy.client("ex-ok").chat.completions.create(model="m", messages=MSGS)
    assert reply.choices[0].message.content == "ok"
    msg = anthropic.Anthropic(base_url=proxy.url, api_key=mint_token(SECRET, "ex-ok2"), max_retries=0).messages.create(
        model="m", max_tokens=5, messages=MSGS)
    assert msg.content[0].text == "ok"
    for t in threads:
        t.join(60)
    assert len(results) == len(paths)
    for i, path in enumerate(paths):
        status, body, closed = results[i]
        assert status == 408 and closed, (path, status)
        if path == "/v1/messages":
            assert is_anthropic_error(body, "timeout_error"), body
        else:
            assert is_openai_error(body, "request_timeout"), body
    silent.settimeout(30)
    assert closed_by_peer(silent)  # closed without an answer
    assert stats(proxy)["refused"]["slow_headers"] == len(paths) + 1
    assert len(abuse_lines(caplog, "slow_headers", "127.0.0.1")) == 1
    for s in (*socks, silent):
        s.close()


def test_slow_loris_on_the_unix_socket_is_dropped_too(proxy, tmp_path, caplog):
    caplog.set_level(logging.WARNING, logger="harness_proxy.abuse")
    path = tmp_path / "proxy.sock"
    proxy.lt.run(serve_unix_socket(proxy.server, path))
    for _ in range(2):
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(30)
        sock.connect(str(path))
        trickle(sock, head("/v1/messages", None), b"X-Slow: abc")
        status, _, body = read_response(sock)
        assert status == 408 and is_anthropic_error(json.loads(body), "timeout_error")
        sock.close()
    assert stats(proxy)["refused"]["slow_headers"] == 2
    assert len(abuse_lines(caplog, "slow_headers", "unix")) == 1


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/messages"])
def test_a_trickling_body_gets_408_in_the_api_shape_and_its_connection_closed(proxy, path, caplog):
    caplog.set_level(logging.WARNING, logger="harness_proxy.abuse")
    for _ in range(3):  # the same execution three times: counted three times, logged once
        sock = connect(proxy)
        trickle(sock, head(path, mint_token(SECRET, "ex-slow"), extra="Content-Length: 5000\r\n\r\n") + b'{"messages": [',
                b"1, ")
        status, headers, body = read_response(sock)
        assert status == 408 and headers.get("connection", "").lower() == "close"
        if path == "/v1/messages":
            assert is_anthropic_error(json.loads(body), "timeout_error")
        else:
            assert is_openai_error(json.loads(body), "request_timeout")
        assert closed_by_peer(sock)
        sock.close()
    assert stats(proxy)["refused"]["slow_body"] == 3
    assert len(abuse_lines(caplog, "slow_body", "ex-slow")) == 1
    assert proxy.engines[0].requests == [] and proxy.recv_all(50) == []


# ---------------------------------------------------------------- oversize bodies


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/messages"])
def test_oversize_bodies_get_413_in_the_api_shape_without_being_read(proxy, path, caplog):
    caplog.set_level(logging.WARNING, logger="harness_proxy.abuse")
    token = mint_token(SECRET, "ex-big")

    def check(status: int, headers: dict[str, str], body: bytes) -> None:
        assert status == 413 and headers.get("connection", "").lower() == "close"
        if path == "/v1/messages":
            assert is_anthropic_error(json.loads(body), "request_too_large")
        else:
            assert is_openai_error(json.loads(body), "request_too_large")

    # A terabyte announced: refused from its Content-Length, before a byte of the body is sent.
    sock = connect(proxy)
    sock.sendall(head(path, token, extra=f"Content-Length: {2**40}\r\n\r\n"))
    check(*read_response(sock))
    sock.close()
    # A chunked body that never ends: refused once LIMIT bytes are in; the answer comes while it
    # is still being sent (what was sent before it is the limit plus the sockets' buffers).
    sock = connect(proxy)
    sock.sendall(head(path, token, extra="Transfer-Encoding: chunked\r\n\r\n"))
    chunk = b"4000\r\n" + b"x" * 0x4000 + b"\r\n"
    sent = 0
    while not select.select([sock], [], [], 0)[0]:
        sock.sendall(chunk)
        sent += len(chunk)
        assert sent < 256 * LIMIT + (64 << 20), "no answer: the proxy is reading the whole endless body"
    check(*read_response(sock))
    sock.close()
    got = stats(proxy)["refused"]
    assert got["oversize"] == 2
    assert len(abuse_lines(caplog, "oversize", "ex-big")) == 1
    assert proxy.engines[0].requests == [] and proxy.recv_all(50) == []
    assert proxy.client("ex-after").chat.completions.create(model="m", messages=MSGS).choices[0].message.content == "ok"


# ---------------------------------------------------------------- tokens


def anthropic_client(proxy: LiveProxy, token: str) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=proxy.url, api_key=token, max_retries=0, timeout=30)


def test_a_sealed_executions_token_is_refused_every_time_it_is_replayed(proxy, caplog):
    caplog.set_level(logging.WARNING, logger="harness_proxy.abuse")
    oa = proxy.client("ex-oa")
    oa.chat.completions.create(model="m", messages=MSGS)
    an = anthropic_client(proxy, mint_token(SECRET, "ex-an"))
    an.messages.create(model="m", max_tokens=5, messages=MSGS)
    assert proxy.seal("ex-oa") == 1 and proxy.seal("ex-an") == 1
    for _ in range(5):
        with pytest.raises(openai.AuthenticationError) as err:
            oa.chat.completions.create(model="m", messages=MSGS)
        assert err.value.status_code == 401 and is_openai_error(err.value.response.json(), "invalid_api_key")
        assert "sealed" in err.value.message
        with pytest.raises(anthropic.AuthenticationError) as aerr:
            an.messages.create(model="m", max_tokens=5, messages=MSGS)
        assert aerr.value.status_code == 401 and is_anthropic_error(aerr.value.body, "authentication_error")
    assert stats(proxy)["refused"]["token_revoked"] == 10
    assert len(abuse_lines(caplog, "token_revoked", "ex-oa")) == 1
    assert len(abuse_lines(caplog, "token_revoked", "ex-an")) == 1
    assert len(proxy.engines[0].requests) == 2  # the replays never reached an engine


def test_tokens_of_another_run_are_refused(proxy, monkeypatch, caplog):
    """A run's tokens end with it: each run (each controller start) draws a fresh secret, so a token
    minted for one proxy's run verifies in no other."""
    caplog.set_level(logging.WARNING, logger="harness_proxy.abuse")
    other_secret = b"another run's secret, 32 bytes.."
    monkeypatch.setattr("tests.harness_proxy.SECRET", other_secret)
    other = LiveProxy(num_engines=1)  # another run's proxy
    try:
        theirs = mint_token(other_secret, "ex-1")
        assert other.client(token=theirs).chat.completions.create(model="m", messages=MSGS).choices[0].message.content
        with pytest.raises(openai.AuthenticationError):  # and ours in theirs
            other.client(token=mint_token(SECRET, "ex-1")).chat.completions.create(model="m", messages=MSGS)
        caplog.clear()  # (that proxy's own log line)
        for _ in range(3):
            with pytest.raises(openai.AuthenticationError) as err:
                proxy.client(token=theirs).chat.completions.create(model="m", messages=MSGS)
            assert is_openai_error(err.value.response.json(), "invalid_api_key")
            with pytest.raises(anthropic.AuthenticationError) as aerr:
                anthropic_client(proxy, theirs).messages.create(model="m", max_tokens=5, messages=MSGS)
            assert is_anthropic_error(aerr.value.body, "authentication_error")
    finally:
        other.close()
    sock = connect(proxy)  # no token at all
    sock.sendall(head("/v1/messages", None, extra="Content-Length: 2\r\n\r\n{}"))
    status, _, body = read_response(sock)
    sock.close()
    assert status == 401 and is_anthropic_error(json.loads(body), "authentication_error")
    got = stats(proxy)["refused"]
    assert got["token_invalid"] == 6 and got["token_missing"] == 1 and got["token_revoked"] == 0
    assert len(abuse_lines(caplog, "token_invalid", "127.0.0.1")) == 1
    assert proxy.engines[0].requests == []


def test_sealed_executions_are_held_in_bounded_memory_and_evicted_ones_stay_refused(proxy):
    capacity = 4
    proxy.lt.call(setattr, proxy.server, "revoked", Revocations(capacity))
    proxy.engines[0].weight_version = 20  # serves every floor below
    proxy.set_routes(proxy.engines)
    proxy.client("ex-long", token=mint_token(SECRET, "ex-long", min_version=0)).chat.completions.create(
        model="m", messages=MSGS)  # a live execution from before every seal below
    tokens = {f"ex-{v}": mint_token(SECRET, f"ex-{v}", min_version=v) for v in range(12)}
    for eid, token in tokens.items():
        proxy.client(eid, token=token).chat.completions.create(model="m", messages=MSGS)
        proxy.seal(eid)
    sealed = stats(proxy)["sealed"]
    assert sealed["held"] == capacity and sealed["evicted"] == 12 - capacity and sealed["floor"] == 12 - capacity
    for eid, token in tokens.items():  # evicted or held, every sealed token is still refused
        with pytest.raises(openai.AuthenticationError) as err:
            proxy.client(eid, token=token).chat.completions.create(model="m", messages=MSGS)
        assert ("expired" if int(eid[3:]) < 12 - capacity else "sealed") in err.value.message
    # The live execution keeps being served although its floor is below the proxy's now.
    assert proxy.client(token=mint_token(SECRET, "ex-long", min_version=0)).chat.completions.create(
        model="m", messages=MSGS).choices[0].message.content == "ok"
    assert proxy.client(token=mint_token(SECRET, "ex-new", min_version=12)).chat.completions.create(
        model="m", messages=MSGS).choices[0].message.content == "ok"
    assert stats(proxy)["refused"]["token_revoked"] == 12


# ---------------------------------------------------------------- Revocations, no HTTP


@given(st.lists(st.tuples(st.integers(0, 50), st.integers(0, 30) | st.none()), max_size=200), st.integers(1, 16))
def test_revocations_never_forget_a_revocation_they_know_the_floor_of(seals, capacity):
    rev = Revocations(capacity)
    for i, (version, calls) in enumerate(seals):
        assert rev.revoke(f"ex-{i}", calls or 0, version) == (calls or 0)
        assert len(rev) <= capacity
    for i, (version, _) in enumerate(seals):
        assert rev.refusal(TokenClaims(f"ex-{i}", version), live=False) is not None
    assert rev.num_evicted == max(0, len(seals) - capacity) and rev.num_evicted_unfloored == 0


def test_revocations_keep_the_first_count_and_evict_unknown_floors_last_and_oldest_first():
    rev = Revocations(3)
    assert rev.revoke("a", 2, None) == 2 and rev.revoke("a", 5, 7) == 2  # sealing again keeps the count
    rev.revoke("b", 1, None)
    rev.revoke("c", 4, 9)
    rev.revoke("d", 0, 3)  # over capacity: the lowest known floor goes (d), the floor passes it
    assert not rev.is_sealed("d") and rev.floor == 4 and rev.num_calls("a") == 2
    assert rev.refusal(TokenClaims("d", 3), live=False) is not None
    assert rev.refusal(TokenClaims("d", 3), live=True) is None  # (a live execution is never "d": it was sealed)
    assert rev.refusal(TokenClaims("e", 4), live=False) is None
    rev.revoke("f", 0, None)  # c (known) goes before a and b (unknown)
    assert not rev.is_sealed("c") and rev.floor == 10
    rev.revoke("g", 0, None)  # only unknown ones left: the oldest goes, counted
    assert not rev.is_sealed("a") and rev.is_sealed("b") and rev.num_evicted_unfloored == 1
    assert rev.stats() == {"held": 3, "capacity": 3, "floor": 10, "evicted": 3, "evicted_unfloored": 1}
    with pytest.raises(ValueError):
        Revocations(0)
