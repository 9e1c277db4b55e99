"""The proxy process as the controller starts it: ready file, Hello, control frames, records, SIGTERM."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import openai
import pytest
import zmq

from base import wire
from base.execution_token import mint_token, write_secret
from tests.harness_proxy import PROXY_CONFIG, ROLLOUT, SECRET, AckingInbox, LoopThread, ScriptedEngine

ROOT = Path(__file__).resolve().parents[2]


def secret_file(tmp_path: Path) -> Path:
    path = tmp_path / "proxy.secret"
    write_secret(path, SECRET)
    return path


def _spawn(tmp_path: Path, config: dict, controller: str, processor: str) -> subprocess.Popen:
    cfg = tmp_path / "proxy.json"
    cfg.write_text(json.dumps(config))
    return subprocess.Popen(
        [sys.executable, "-m", "harness_proxy.main", "--config-json", str(cfg), "--controller", controller,
         "--processor", processor, "--secret-file", str(secret_file(tmp_path)), "--ready-file", str(tmp_path / "proxy.ready")],
        cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)}, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
    )


def _recv(sock: zmq.Socket, what: str, timeout_ms: int = 20_000) -> list[bytes]:
    """The next frame but heartbeats (the proxy sends one a second)."""
    while True:
        assert sock.poll(timeout_ms), f"no {what}"
        parts = sock.recv_multipart()
        if not isinstance(wire.decode(parts[-1]), wire.ServiceHeartbeat):
            return parts


@pytest.fixture
def sockets():
    ctx = zmq.Context()
    router, records = ctx.socket(zmq.ROUTER), AckingInbox(ctx)
    router.setsockopt(zmq.LINGER, 0)
    r_port = router.bind_to_random_port("tcp://127.0.0.1")
    yield router, records, f"tcp://127.0.0.1:{r_port}", records.addr
    router.close()
    records.close()
    ctx.term()


def test_proxy_process_end_to_end(tmp_path, sockets):
    router, records, controller, processor = sockets
    lt = LoopThread()
    engine = ScriptedEngine(cell_id=4, weight_version=7)
    lt.run(engine.start())
    proc = _spawn(tmp_path, {"proxy": PROXY_CONFIG, "model": {"tokenizer": "qwen_compact", "compact_ranks": 4096}, "rollout": ROLLOUT},
                  controller, processor)
    try:
        ident, frame = _recv(router, "Hello")
        hello = wire.decode(frame)
        assert isinstance(hello, wire.Hello) and hello.peer == "proxy" and hello.pid == proc.pid
        ready = tmp_path / "proxy.ready"
        deadline = time.monotonic() + 20
        while not ready.exists():
            assert proc.poll() is None and time.monotonic() < deadline, "proxy not ready"
            time.sleep(0.02)
        url = json.loads(ready.read_text())["url"]

        router.send_multipart([ident, wire.encode(wire.RoutingTable(version=1, engines=[engine.route()]))])
        for bad in (b"not msgpack \xc1", wire.encode(wire.Heartbeat(cell_id=0, phase="serving", num_running=0,
                                                                        weight_version=0))):
            router.send_multipart([ident, bad])
            reply = wire.decode(_recv(router, "ErrorReply")[1])
            assert isinstance(reply, wire.ErrorReply) and reply.where == "proxy" and reply.message
        # control frames are handled in order, so the routing table is in place by now
        client = openai.OpenAI(base_url=f"{url}/v1", api_key=mint_token(SECRET, "ex-main"), max_retries=0, timeout=30)
        r = client.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}])
        assert r.choices[0].message.content == "ok"
        rec = records.recv()
        assert isinstance(rec, wire.CallRecord) and rec.call_id == r.id
        assert (rec.execution_id, rec.cell_id, rec.weight_version, rec.call_index) == ("ex-main", 4, 7, 0)

        router.send_multipart([ident, wire.encode(wire.SealExecution(execution_id="ex-main"))])
        assert records.recv() == wire.ExecutionSealed(execution_id="ex-main", num_calls=1)
        with pytest.raises(openai.AuthenticationError):
            client.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}])

        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        log = proc.stdout.read().decode(errors="replace")
        proc.stdout.close()
        lt.run(engine.stop())
        lt.close()
    assert "bad frame from the controller" in log and "proxy shutting down" in log


def test_bad_config_exits_with_a_clear_error(tmp_path, sockets):
    _, _, controller, processor = sockets
    proc = _spawn(tmp_path, {"proxy": {**PROXY_CONFIG, "port": "eighty"}, "model": {"tokenizer": "qwen_compact",
                                                                                  "compact_ranks": 4096}, "rollout": ROLLOUT},
                  controller, processor)
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 2 and b"proxy.port: want int" in out


def _get_over_unix(path: str, target: str) -> tuple[int, bytes]:
    import socket

    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(20)
        s.connect(path)
        s.sendall(f"GET {target} HTTP/1.1\r\nHost: proxy\r\nConnection: close\r\n\r\n".encode())
        data = b""
        while chunk := s.recv(65536):
            data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    return int(head.split()[1]), body


def test_unix_socket_serves_the_same_app(tmp_path, sockets):
    """--unix-socket: a stale socket file is replaced, mode 0600, announced, served, removed on exit."""
    import socket
    import stat

    _, _, controller, processor = sockets
    sock_path = tmp_path / "proxy.sock"
    stale = socket.socket(socket.AF_UNIX)
    stale.bind(str(sock_path))  # what a killed proxy leaves behind
    stale.close()
    cfg = tmp_path / "proxy.json"
    cfg.write_text(json.dumps({"proxy": PROXY_CONFIG, "model": {"tokenizer": "qwen_compact", "compact_ranks": 4096}, "rollout": ROLLOUT}))
    argv = [sys.executable, "-m", "harness_proxy.main", "--config-json", str(cfg), "--controller", controller,
            "--processor", processor, "--secret-file", str(secret_file(tmp_path)), "--ready-file", str(tmp_path / "proxy.ready")]
    proc = subprocess.Popen([*argv, "--unix-socket", str(sock_path)], cwd=ROOT,
                            env={**os.environ, "PYTHONPATH": str(ROOT)}, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT)
    try:
        ready = tmp_path / "proxy.ready"
        deadline = time.monotonic() + 20
        while not ready.exists():
            assert proc.poll() is None and time.monotonic() < deadline, "proxy not ready"
            time.sleep(0.02)
        announced = json.loads(ready.read_text())
        assert announced["unix_socket"] == str(sock_path) and announced["url"].startswith("http://")
        assert stat.S_IMODE(sock_path.stat().st_mode) == 0o600
        status, body = _get_over_unix(str(sock_path), "/health")
        assert status == 200 and json.loads(body)["status"] == "ok"
        status, body = _get_over_unix(str(sock_path), "/v1/models")
        assert status == 200 and b"gyre-policy" in body
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0
        assert not sock_path.exists()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        proc.stdout.close()

    # a path that is no socket is never removed: the proxy refuses to start
    sock_path.write_text("not a socket")
    out = subprocess.run([*argv, "--unix-socket", str(sock_path)], cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)},
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, timeout=60)
    assert out.returncode == 2 and b"exists and is not a socket" in out.stdout
    assert sock_path.read_text() == "not a socket"
