"""The bundled harness as a real subprocess against a small real OpenAI-compatible aiohttp server.

The server answers from a script (status, reply text), records every request (headers and JSON
body), and repeats the script's last entry once it runs out.
"""

from __future__ import annotations

import asyncio
import json
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from aiohttp import web

from workloads import harness

REPO = Path(__file__).resolve().parents[2]
TOKEN = "tok-execution-42"


@dataclass
class Reply:
    status: int = 200
    text: str | None = "return true"


@dataclass
class ScriptedServer:
    script: list[Reply]
    requests: list[dict] = field(default_factory=list)
    port: int = 0

    async def _chat(self, request: web.Request) -> web.Response:
        body = await request.json()
        self.requests.append({"auth": request.headers.get("Authorization"), "body": body})
        reply = self.script[min(len(self.requests) - 1, len(self.script) - 1)]
        if reply.status != 200:
            return web.json_response({"error": {"message": "scripted"}}, status=reply.status)
        return web.json_response({
            "id": f"chatcmpl-{len(self.requests)}", "object": "chat.completion", "model": body.get("model"),
            "choices": [{"index": 0, "finish_reason": "stop",
                         "message": {"role": "assistant", "content": reply.text}}],
        })

    def start(self) -> None:
        self._loop = asyncio.new_event_loop()
        ready = threading.Event()

        async def up() -> None:
            app = web.Application()
            app.router.add_post("/v1/chat/completions", self._chat)
            self._runner = web.AppRunner(app)
            await self._runner.setup()
            site = web.TCPSite(self._runner, "127.0.0.1", 0)
            await site.start()
            self.port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
            ready.set()

        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        self._thread.start()
        asyncio.run_coroutine_threadsafe(up(), self._loop)
        assert ready.wait(10), "test server did not start"

    def stop(self) -> None:
        asyncio.run_coroutine_threadsafe(self._runner.cleanup(), self._loop).result(10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)


@pytest.fixture
def serve():
    servers: list[ScriptedServer] = []

    def start(*script: Reply) -> ScriptedServer:
        server = ScriptedServer(list(script))
        server.start()
        servers.append(server)
        return server

    yield start
    for s in servers:
        s.stop()


def _workspace(tmp_path: Path, file_name: str = "out_12.txt", prompt: str = "Ticket #1: the success value.") -> Path:
    ws = tmp_path / "ws"
    ws.mkdir()
    (ws / "TASK.md").write_text(f"file: {file_name}\n\n{prompt}\n", encoding="utf-8")
    return ws


def _run(ws: Path, port: int, *, max_turns: int = 2, timeout_s: float = 60, extra: tuple[str, ...] = ()
         ) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "workloads.harness", "--base-url", f"http://127.0.0.1:{port}/v1",
         "--api-key", TOKEN, "--workspace", str(ws), "--max-turns", str(max_turns), "--max-tokens", "3",
         "--temperature", "1.0", "--model", "gyre-policy", *extra],
        cwd=REPO, capture_output=True, text=True, timeout=timeout_s,
    )


def test_writes_each_reply_and_follows_max_turns(tmp_path: Path, serve):
    server = serve(Reply(text="  first try \n"), Reply(text="return true"), Reply(text="never asked"))
    ws = _workspace(tmp_path)
    proc = _run(ws, server.port, max_turns=2)
    assert proc.returncode == 0, proc.stderr
    assert len(server.requests) == 2
    assert (ws / "out_12.txt").read_text(encoding="utf-8") == "return true"
    first, second = (r["body"] for r in server.requests)
    assert first["model"] == "gyre-policy" and first["max_tokens"] == 3 and first["temperature"] == 1.0
    assert first["stream"] is False
    assert first["messages"] == [
        {"role": "system", "content": harness.SYSTEM_PROMPT},
        {"role": "user", "content": "Ticket #1: the success value."},
    ]
    # The assistant turn is echoed exactly as received; the write is reported in stripped bytes.
    assert second["messages"][2:] == [
        {"role": "assistant", "content": "  first try \n"},
        {"role": "user", "content": harness.wrote_message(len("first try"), "out_12.txt")},
    ]
    assert sorted(p.name for p in ws.iterdir()) == ["TASK.md", "out_12.txt"]


def test_sends_the_bearer_token(tmp_path: Path, serve):
    server = serve(Reply(text="x"))
    assert _run(_workspace(tmp_path), server.port, max_turns=1).returncode == 0
    assert [r["auth"] for r in server.requests] == [f"Bearer {TOKEN}"]


@pytest.mark.parametrize("empty", ["", "  \n ", None])
def test_empty_reply_ends_the_run_early(tmp_path: Path, serve, empty):
    server = serve(Reply(text="return false"), Reply(text=empty), Reply(text="not reached"))
    ws = _workspace(tmp_path)
    proc = _run(ws, server.port, max_turns=5)
    assert proc.returncode == 0, proc.stderr
    assert len(server.requests) == 2
    assert (ws / "out_12.txt").read_text(encoding="utf-8") == "return false"


def test_empty_first_reply_writes_nothing(tmp_path: Path, serve):
    server = serve(Reply(text=""))
    ws = _workspace(tmp_path)
    assert _run(ws, server.port, max_turns=3).returncode == 0
    assert len(server.requests) == 1 and not (ws / "out_12.txt").exists()


def test_retries_429_and_503_then_succeeds(tmp_path: Path, serve):
    server = serve(Reply(status=429), Reply(status=503), Reply(text="return self"))
    ws = _workspace(tmp_path)
    proc = _run(ws, server.port, max_turns=1)
    assert proc.returncode == 0, proc.stderr
    assert len(server.requests) == 3
    assert (ws / "out_12.txt").read_text(encoding="utf-8") == "return self"


def test_gives_up_after_repeated_503_with_exit_2(tmp_path: Path, serve):
    server = serve(Reply(status=503))
    ws = _workspace(tmp_path)
    proc = _run(ws, server.port, max_turns=2)
    assert proc.returncode == 2
    assert len(server.requests) == harness.RETRY_ATTEMPTS
    line = proc.stderr.strip().splitlines()[-1]
    assert line.startswith("harness: error: POST ") and "gave up after" in line and "HTTP 503" in line
    assert not (ws / "out_12.txt").exists()


def test_non_retryable_status_fails_at_once(tmp_path: Path, serve):
    server = serve(Reply(status=401))
    proc = _run(_workspace(tmp_path), server.port)
    assert proc.returncode == 2 and len(server.requests) == 1
    assert "HTTP 401" in proc.stderr


def test_connection_refused_exits_2(tmp_path: Path):
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = _run(_workspace(tmp_path), port, max_turns=1)
    assert proc.returncode == 2
    assert "harness: error:" in proc.stderr and "gave up after" in proc.stderr


@pytest.mark.parametrize("task_md", [None, "no file line\n\nprompt\n", "file: ../escape.txt\n\nprompt\n", "file: a.txt\n\n\n"])
def test_bad_task_file_exits_2(tmp_path: Path, serve, task_md):
    server = serve(Reply())
    ws = tmp_path / "ws"
    ws.mkdir()
    if task_md is not None:
        (ws / "TASK.md").write_text(task_md, encoding="utf-8")
    proc = _run(ws, server.port)
    assert proc.returncode == 2 and proc.stderr.startswith("harness: error:")
    assert server.requests == []


def test_harness_imports_only_the_standard_library():
    code = (
        "import sys; before = set(sys.modules); import workloads.harness; "
        "new = {m.split('.')[0] for m in set(sys.modules) - before}; "
        "print(sorted(m for m in new if m not in sys.stdlib_module_names and m != 'workloads'))"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True)
    assert json.loads(out.stdout.replace("'", '"')) == []


# ---------------------------------------------------------------- think time (long-tailed run lengths)


def _think(execution_id: str, *, seed: int = 0, median_s: float = 2.0, sigma: float = 1.0, max_s: float = 40.0,
           turns: int = 3) -> list[float]:
    return harness.think_times(seed=seed, execution_id=execution_id, median_s=median_s, sigma=sigma, max_s=max_s,
                               turns=turns)


def test_think_times_are_a_function_of_seed_and_execution():
    assert _think("s3-g1-e5") == _think("s3-g1-e5")
    assert _think("s3-g1-e5") != _think("s3-g1-e6")
    assert _think("s3-g1-e5", seed=1) != _think("s3-g1-e5")
    split = _think("s0-g0-e0", turns=4)
    assert len(split) == 4 and len(set(split)) == 1  # split evenly over the turns


def test_think_times_are_long_tailed_around_the_median_and_capped():
    totals = sorted(sum(_think(f"s{i}-g0-e0", max_s=1e9)) for i in range(4000))
    assert 1.8 < totals[len(totals) // 2] < 2.2
    assert totals[int(0.95 * len(totals))] > 5 * 2.0 * 0.9  # sigma 1: ~5% of runs past 5x the median
    assert max(sum(_think(f"s{i}-g0-e0", max_s=3.0)) for i in range(500)) == pytest.approx(3.0)
    assert sum(_think("x", sigma=0.0, median_s=0.7)) == pytest.approx(0.7)


def test_think_time_runs_after_each_write_and_is_announced(tmp_path: Path, serve):
    server = serve(Reply(text="a"), Reply(text="b"))
    ws = _workspace(tmp_path)
    t0 = time.monotonic()
    proc = _run(ws, server.port, max_turns=2, extra=("--think-median-s", "0.6", "--think-sigma", "0"))
    elapsed = time.monotonic() - t0
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines() == ["harness: think 0.600s over 2 turns", "harness: answered chatcmpl-1",
                                        "harness: answered chatcmpl-2"]
    assert len(server.requests) == 2 and elapsed >= 0.6  # 0.3 s after each of the two writes


def test_no_think_time_by_default(tmp_path: Path, serve):
    server = serve(Reply(text="a"))
    proc = _run(_workspace(tmp_path), server.port, max_turns=1)
    assert proc.returncode == 0 and proc.stdout == "harness: answered chatcmpl-1\n"  # no think line


@pytest.mark.parametrize("bad", [("--think-median-s", "-1"), ("--think-max-s", "0"), ("--think-sigma", "-0.5"),
                                 ("--think-median-s", "nan")])
def test_bad_think_arguments_exit_2(tmp_path: Path, serve, bad):
    server = serve(Reply())
    proc = _run(_workspace(tmp_path), server.port, extra=bad)
    assert proc.returncode == 2 and "think" in proc.stderr and server.requests == []


def test_a_coding_task_writes_the_file_each_reply_names(tmp_path: Path, serve):
    """A workspace without TASK.md (an SWE-style row): the prompt comes from --prompt-file and each
    reply names the file it replaces; a reply naming no plain relative path writes nothing."""
    server = serve(Reply(text="file: pkg/fix.py\nVALUE = 2\n"), Reply(text="file: ../escape.py\nx = 1"),
                   Reply(text="no header at all"), Reply(text="file: /etc/passwd\nroot"))
    ws = tmp_path / "ws"
    ws.mkdir()
    prompt = tmp_path / "prompt.md"
    prompt.write_text("Fix VALUE in pkg/fix.py.", encoding="utf-8")
    proc = _run(ws, server.port, max_turns=4, extra=("--prompt-file", str(prompt)))
    assert proc.returncode == 0, proc.stderr
    assert (ws / "pkg" / "fix.py").read_text(encoding="utf-8") == "VALUE = 2"
    assert sorted(str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*")) == [
        "prompt.md", "ws", "ws/pkg", "ws/pkg/fix.py"]
    first, second, third, fourth = (r["body"]["messages"] for r in server.requests)
    assert first == [{"role": "system", "content": harness.CODING_SYSTEM_PROMPT},
                     {"role": "user", "content": "Fix VALUE in pkg/fix.py."}]
    assert second[-1] == {"role": "user", "content": harness.wrote_message(len("VALUE = 2"), "pkg/fix.py")}
    assert third[-1]["content"].startswith("Your reply named no file")
    assert fourth[-1]["content"].startswith("Your reply named no file")
