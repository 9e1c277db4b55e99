"""Harness proxy: the latency it adds per call, the sessions it holds, and LiteLLM's proxy as the peer.

    .venv/bin/python -m bench.proxy [--quick] [--tokenizer qwen|qwen_compact] [--sessions-per-size 20]
                                    [--calls-per-session 10] [--hold-sessions 48] [--no-litellm]

Four real processes on loopback: this client; an *instant engine* (``--serve-engine``, below) that
answers SGLang's ``POST /generate`` and OpenAI's ``POST /v1/chat/completions`` at once with a
short scripted output; the real proxy (``python -m harness_proxy.main``, its CallRecords pushed
to the engine process, which checks them); and LiteLLM's proxy (``litellm --config``) from its own
venv, pointed at the engine's OpenAI endpoint. The client plays a harness: per execution, one
growing OpenAI chat conversation (system prompt, tools, then assistant tool calls and tool
results); each call appends the reply it got and a new tool result (about 1% of the context).

Per call, back to back, each timed from the first byte sent to the last byte read:

- ``proxy``: the conversation to the Gyre proxy (which calls the engine's ``/generate``);
- ``direct``: the exact ``/generate`` body the proxy sent for that call (fetched from the engine
  untimed), straight to the engine;
- ``litellm``: the same conversation bytes to LiteLLM's proxy (which calls the engine's
  ``/v1/chat/completions``);
- ``upstream``: the same conversation bytes straight to the engine's ``/v1/chat/completions``.

Added latency = proxy - direct, and litellm - upstream, matched per call; p50/p99 over the calls
of each context size (about 1k, 32k, 100k prompt tokens). Request bodies are encoded before the
clock starts, so the figure is all the proxy's own work (parse, validate, splice, encode ids for
the engine, record, answer) plus one loopback hop, and it does not depend on how fast this client
encodes JSON. A client that called the engine directly would have had to encode the prompt ids
itself; ``*_vs_encoding_client`` subtracts that (stdlib ``json.dumps`` of the ids, minus encoding
the chat body) for the figure a harness would see. ``litellm_ratio_*`` = LiteLLM's added p50 / ours.

The first call of each execution renders its whole history from scratch and is reported apart
(``first_call_ms_*``, end to end); the others must splice. The engine's outputs are scripted with
non-canonical ids (text split into one token per character), so only a splice reproduces them in
the next prompt; every measured call is checked to begin with the previous prompt + output
(``spliced_calls`` of ``measured_calls``), and every CallRecord's ids against what the engine saw.

Where the time goes: ``stage_ms_100k`` runs the proxy's own functions for a spliced ~100k-token
call in this process, stage by stage, in ``ProxyServer._run_call``'s order (medians, ms; no sockets).

Sessions held: before the latency runs, ``--hold-sessions`` executions each open a ~100k-token
conversation and make a second call (so each holds its newest calls, as a live harness would);
``rss_mb_per_session_100k`` is the proxy process's RSS growth over them, divided by their number,
and every held session is checked to still splice. Left out: streaming, the Anthropic API, the
trajectory processor (the engine process only drains and checks records), real generation.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import http.client
import json
import math
import os
import platform
import random
import secrets
import subprocess
import sys
import tempfile
import time
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson
import psutil
import zmq

from base import wire
from base.execution_token import mint_token, write_secret
from base.tokenizer import QwenTokenizer, get_tokenizer

ROOT = Path(__file__).resolve().parent.parent
LITELLM_VENV = ROOT / ".venv-litellm"
LITELLM_VERSION = "1.106.12"
"""The LiteLLM the Makefile pins: 1.107.0 was a compromised release (withdrawn), and later ones need
``litellm-proxy`` packages the registry here does not carry."""
LITELLM_SETUP = (f"make litellm   (or: python3.11 -m venv .venv-litellm && "
                 f".venv-litellm/bin/pip install 'litellm[proxy]=={LITELLM_VERSION}')")
MODEL = "gyre-policy"
LITELLM_KEY = "sk-gyre-bench"
SIZES = {"1k": 1_000, "32k": 32_000, "100k": 100_000}
START_TIMEOUT_S = 120.0
HTTP_TIMEOUT_S = 120.0

# ---------------------------------------------------------------- the conversation (deterministic)

_WORDS = (
    "def return self import class for in if else elif while with as try except raise None True False "
    "value index path result error config item data node tree call token prompt cell engine session "
    "assert len range dict list str int float print open read write parse check update apply build"
).split()
_COMMANDS = ("pytest -q tests/unit", "git diff --stat", "ls -la src", "grep -rn TODO src", "python -m build")
TOOLS = [
    {"type": "function", "function": {
        "name": name, "description": f"{name}: {desc}",
        "parameters": {"type": "object", "properties": {arg: {"type": "string", "description": f"the {arg}"}},
                       "required": [arg]},
    }}
    for name, arg, desc in (
        ("bash", "command", "run a shell command in the workspace and return its output"),
        ("read_file", "path", "read a file of the workspace, with line numbers"),
        ("edit_file", "patch", "apply a unified diff to the workspace"),
        ("grep", "pattern", "search the workspace for a regular expression"),
    )
]
REPLY_TEXT = "Running the check.\n"
"""The engine's scripted text before its tool call, emitted one token per character (non-canonical)."""


class Filler:
    """Code-like text of about a given number of tokens, from one seeded pool of lines."""

    def __init__(self, tok: QwenTokenizer, seed: int = 0):
        rng = random.Random(seed)
        self.lines = [
            " " * (4 * rng.randrange(4))
            + " ".join(rng.choice(_WORDS) + (f"_{rng.randrange(100)}" if rng.random() < 0.3 else "")
                       for _ in range(rng.randrange(3, 10)))
            + rng.choice([":", "()", " = 0", ",", "  # ok", ""])
            for _ in range(4096)
        ]
        sample = "\n".join(self.lines)
        self.chars_per_token = len(sample) / len(tok.encode(sample))

    def text(self, rng: random.Random, num_tokens: int) -> str:
        want = max(1, int(num_tokens * self.chars_per_token))
        out: list[str] = []
        size = 0
        i = rng.randrange(len(self.lines))
        while size < want:
            line = self.lines[i % len(self.lines)]
            out.append(line)
            size += len(line) + 1
            i += 1 + rng.randrange(7)
        return "\n".join(out)[:want]


def tool_call_message(i: int) -> dict[str, Any]:
    """A history turn as a harness echoes the engine's reply: text plus one bash call."""
    args = json.dumps({"command": _COMMANDS[i % len(_COMMANDS)]})
    return {"role": "assistant", "content": REPLY_TEXT.strip(),
            "tool_calls": [{"id": f"call_h{i}", "type": "function", "function": {"name": "bash", "arguments": args}}]}


def open_conversation(filler: Filler, rng: random.Random, context_tokens: int) -> list[dict[str, Any]]:
    """System prompt, task, then tool-call turns until the history is about ``context_tokens``."""
    system_tokens = min(context_tokens // 8, 2_000)
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": filler.text(rng, system_tokens)},
        {"role": "user", "content": "Fix the failing test.\n" + filler.text(rng, 60)},
    ]
    used = system_tokens + 300 + 70  # system, tools, task
    i = 0
    while used < context_tokens:
        result_tokens = min(max(50, int(rng.lognormvariate(math.log(600), 0.8))), 3_000, context_tokens - used)
        messages.append(tool_call_message(i))
        messages.append({"role": "tool", "tool_call_id": f"call_h{i}", "content": filler.text(rng, result_tokens)})
        used += result_tokens + 45
        i += 1
    return messages


def chat_body(messages: list[dict[str, Any]]) -> bytes:
    return json.dumps({"model": MODEL, "messages": messages, "tools": TOOLS, "max_tokens": 256}).encode()


# ---------------------------------------------------------------- the instant engine (its own process)


def scripted_output(tok: QwenTokenizer, n: int) -> list[int]:
    """Text one token per character (BPE would merge it: only a splice keeps these ids), then a call."""
    call = json.dumps({"name": "bash", "arguments": {"command": _COMMANDS[n % len(_COMMANDS)]}})
    return ([tok.encode(c)[0] for c in REPLY_TEXT] + [tok.specials["<tool_call>"], *tok.encode(f"\n{call}\n"),
            tok.specials["</tool_call>"], tok.im_end])


class InstantEngine:
    """SGLang's ``/generate`` and OpenAI's ``/v1/chat/completions``, answered at once.

    It also plays the processor's side of the record stream (``take_records``): each CallRecord is
    acknowledged at once and checked against the request the engine saw under the same rid (its
    latest 16); ``GET /bench/last`` (untimed) reports the counts.
    """

    def __init__(self, tok: QwenTokenizer):
        self.tok = tok
        self.num_generate = 0
        self.num_chat = 0
        self.last_body: bytes = b"{}"
        self.last_output: list[int] = []
        self.seen: dict[str, tuple[list[int], list[int]]] = {}
        self._seen_order: deque[str] = deque()
        self.records = {"received": 0, "exact": 0, "sealed": 0}

    async def generate(self, request: Any) -> Any:
        from aiohttp import web

        raw = await request.read()
        body = json.loads(raw)
        ids = body["input_ids"]
        if not isinstance(ids, list) or not ids:
            return web.json_response({"error": "input_ids: want a non-empty list"}, status=400)
        out = scripted_output(self.tok, self.num_generate)[: body["sampling_params"]["max_new_tokens"]]
        self.num_generate += 1
        self.last_body, self.last_output = raw, out
        self._remember(body.get("rid", ""), ids, out)
        return web.json_response({
            "output_ids": out,
            "meta_info": {
                "id": body.get("rid", ""), "weight_version": "1", "prompt_tokens": len(ids),
                "completion_tokens": len(out), "finish_reason": {"type": "stop", "matched": self.tok.im_end},
                "output_token_logprobs": [[-0.5, t, None] for t in out],
            },
        })

    def _remember(self, rid: str, ids: list[int], out: list[int]) -> None:
        if rid in self.seen:  # the bench's direct replay of a proxy call: keep what the proxy got
            return
        self._seen_order.append(rid)
        self.seen[rid] = (ids, out)
        while len(self._seen_order) > 16:
            self.seen.pop(self._seen_order.popleft(), None)

    async def chat(self, request: Any) -> Any:
        from aiohttp import web

        body = json.loads(await request.read())
        n = self.num_chat
        self.num_chat += 1
        args = json.dumps({"command": _COMMANDS[n % len(_COMMANDS)]})
        return web.json_response({
            "id": f"chatcmpl-instant-{n}", "object": "chat.completion", "created": int(time.time()),
            "model": body.get("model", MODEL),
            "choices": [{"index": 0, "finish_reason": "tool_calls", "logprobs": None, "message": {
                "role": "assistant", "content": REPLY_TEXT.strip(),
                "tool_calls": [{"id": f"call_i{n}", "type": "function",
                                "function": {"name": "bash", "arguments": args}}],
            }}],
            "usage": {"prompt_tokens": 0, "completion_tokens": len(scripted_output(self.tok, n)), "total_tokens": 0},
        })

    async def abort(self, request: Any) -> Any:
        from aiohttp import web

        return web.json_response({})  # every answer is already complete

    async def last(self, request: Any) -> Any:
        from aiohttp import web

        return web.json_response({
            "body": json.loads(self.last_body), "output_ids": self.last_output, "records": self.records,
            "num_generate": self.num_generate, "num_chat": self.num_chat,
        })

    def on_record(self, msg: wire.CallRecord | wire.ExecutionSealed) -> None:
        """Check a CallRecord against the request the engine saw under its rid."""
        if isinstance(msg, wire.ExecutionSealed):
            self.records["sealed"] += 1
            return
        self.records["received"] += 1
        seen = self.seen.get(msg.call_id)
        self.records["exact"] += seen is not None and seen == (msg.prompt_ids, msg.output_ids)


async def serve_engine(tok: QwenTokenizer, records_addr: str, ready_file: Path) -> None:
    from aiohttp import web

    engine = InstantEngine(tok)
    app = web.Application(client_max_size=256 * 1024 * 1024)
    app.router.add_post("/generate", engine.generate)
    app.router.add_post("/v1/chat/completions", engine.chat)
    app.router.add_post("/abort_request", engine.abort)
    app.router.add_get("/bench/last", engine.last)
    await start_on_loopback(app, ready_file)
    await take_records(records_addr, engine.on_record)  # until terminated


async def take_records(addr: str, handle: Callable[[wire.CallRecord | wire.ExecutionSealed], None]) -> None:
    """The processor's side of the proxy's record stream, for the engine doubles: a ROUTER bound on
    ``addr`` that acknowledges each CallRecord and seal at once (as the processor does once it is
    in its log; the proxy answers a call only then) and hands it to ``handle``. The proxy asks for
    each execution's logged records before its first call (``SessionReplayRequest``): at that
    moment the processor has none, and neither has this; a request for an execution that has
    records (only a restarted proxy asks that, and none restarts here) ends it. A frame that does
    not decode ends it too: the bench fails loudly."""
    import zmq.asyncio

    from trajectory.inbox import ack_frames

    sock = zmq.asyncio.Context.instance().socket(zmq.ROUTER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.bind(addr)
    recorded: set[str] = set()
    while True:
        ident, frame = (await sock.recv_multipart())[:2]
        msg = wire.decode(frame, expect=(wire.CallRecord, wire.ExecutionSealed, wire.SessionReplayRequest))
        if isinstance(msg, wire.SessionReplayRequest):
            if msg.execution_id in recorded:
                raise RuntimeError(f"session replay asked for {msg.execution_id}, which has records: the proxy restarted")
            await sock.send_multipart([ident, wire.encode(wire.SessionReplayEnd(execution_id=msg.execution_id,
                                                                                num_records=0))])
            continue
        recorded.add(msg.execution_id)
        for parts in ack_frames([(ident, msg)]):  # type: ignore[list-item]
            await sock.send_multipart(parts)
        handle(msg)  # type: ignore[arg-type]


async def start_on_loopback(app: Any, ready_file: Path) -> None:
    """Serve ``app`` on a free loopback port and say its URL in ``ready_file`` (written whole)."""
    from aiohttp import web

    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    tmp = ready_file.with_name(ready_file.name + ".tmp")
    tmp.write_text(json.dumps({"url": f"http://127.0.0.1:{runner.addresses[0][1]}"}))
    os.replace(tmp, ready_file)


# ---------------------------------------------------------------- processes


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_ready_file(path: Path, proc: subprocess.Popen[bytes], what: str) -> str:
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        if path.exists() and path.stat().st_size:
            return str(json.loads(path.read_text())["url"])
        if proc.poll() is not None:
            raise RuntimeError(f"{what} exited with {proc.returncode} before it was ready")
        time.sleep(0.05)
    raise RuntimeError(f"{what} not ready within {START_TIMEOUT_S} s")


@dataclass
class Processes:
    tmp: Path
    tokenizer: str
    profile: Path | None = None
    """Run the proxy under cProfile, writing its stats here on shutdown."""
    procs: list[subprocess.Popen[bytes]] = field(default_factory=list)
    logs: list[Any] = field(default_factory=list)
    router: zmq.Socket[bytes] | None = None
    proxy: tuple[subprocess.Popen[bytes], bytes] | None = None
    """The proxy process and its identity on ``router`` (this process plays its controller)."""

    def secret_file(self, secret: bytes) -> Path:
        path = self.tmp / "proxy.secret"
        write_secret(path, secret)
        return path

    def spawn(self, name: str, argv: list[str], env: dict[str, str] | None = None) -> subprocess.Popen[bytes]:
        log = open(self.tmp / f"{name}.log", "wb")  # noqa: SIM115 (closed in stop())
        self.logs.append(log)
        proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT, env=env)
        self.procs.append(proc)
        return proc

    def start_engine(self, records_addr: str) -> str:
        ready = self.tmp / "engine.json"
        proc = self.spawn("engine", [sys.executable, "-m", "bench.proxy", "--serve-engine", str(ready),
                                     "--records-addr", records_addr, "--tokenizer", self.tokenizer])
        return wait_ready_file(ready, proc, "the instant engine")

    def start_proxy(self, engine_url: str, records_addr: str, secret: bytes) -> tuple[str, int]:
        """The real proxy process, with this process as its controller; return (url, pid)."""
        ctx = zmq.Context.instance()
        router = ctx.socket(zmq.ROUTER)
        router.setsockopt(zmq.LINGER, 0)
        controller = f"tcp://127.0.0.1:{router.bind_to_random_port('tcp://127.0.0.1')}"
        config = self.tmp / "proxy.json"
        config.write_text(json.dumps({
            "proxy": {"host": "127.0.0.1", "port": 0, "model_name": MODEL, "max_request_bytes": 64 * 1024 * 1024, "read_timeout_s": 30.0,
                      "max_context_tokens": 262_144, "max_new_tokens_cap": 256, "truncation_ends_turn": False, "engine_timeout_s": 60.0,
                      "retry_attempts": 1, "route_wait_s": 1.0, "affinity_slack": 8, "affinity_min_prefix": 1024,
                      "record_ack_timeout_s": 120.0, "record_resend_s": 2.0, "max_unacked_record_bytes": 1 << 30,
                      "session_memory_bytes": 64 << 20, "max_session_bytes": 8 << 30,
                      "execution_budget": {"max_calls": 2000, "max_tokens": 50_000_000, "max_wall_s": 14400.0,
                                           "max_concurrent_calls": 8}},
            "model": {"tokenizer": self.tokenizer, "compact_ranks": 1024},
            "rollout": {"temperature": 1.0, "top_p": 1.0, "top_k": -1},
        }))
        ready = self.tmp / "proxy-ready.json"
        prefix = ["-m", "cProfile", "-o", str(self.profile)] if self.profile else []
        proc = self.spawn("proxy", [sys.executable, *prefix, "-m", "harness_proxy.main", "--config-json", str(config),
                                    "--controller", controller, "--processor", records_addr,
                                    "--secret-file", str(self.secret_file(secret)), "--ready-file", str(ready)])
        url = wait_ready_file(ready, proc, "the proxy")
        if not router.poll(int(START_TIMEOUT_S * 1000)):
            raise RuntimeError("the proxy sent no Hello")
        identity, frame = router.recv_multipart()
        wire.decode(frame, expect=(wire.Hello,))
        table = wire.RoutingTable(version=1, engines=[wire.EngineRoute(cell_id=0, url=engine_url)])
        router.send_multipart([identity, wire.encode(table)])
        self.router, self.proxy = router, (proc, identity)
        return url, proc.pid

    def start_litellm(self, engine_url: str, litellm: Path) -> str:
        port = free_port()
        config = self.tmp / "litellm.yaml"
        # JSON is YAML: one model, no database, no callbacks, the OpenAI-compatible upstream.
        config.write_text(json.dumps({
            "model_list": [{"model_name": MODEL, "litellm_params": {
                "model": f"openai/{MODEL}", "api_base": f"{engine_url}/v1", "api_key": "none"}}],
            "litellm_settings": {"telemetry": False, "drop_params": True},
            # It refuses to start without a key; ours checks a per-execution token, so both authenticate.
            "general_settings": {"master_key": LITELLM_KEY},
        }))
        env = {**os.environ, "LITELLM_LOCAL_MODEL_COST_MAP": "True", "LITELLM_LOG": "ERROR",
               "DISABLE_SCHEMA_UPDATE": "True"}
        proc = self.spawn("litellm", [str(litellm), "--config", str(config), "--host", "127.0.0.1",
                                      "--port", str(port), "--num_workers", "1"], env=env)
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise RuntimeError(f"litellm exited with {proc.returncode}; see {self.tmp / 'litellm.log'}")
            probe = Http(url)
            with contextlib.suppress(OSError, http.client.HTTPException):
                if probe.get("/health/liveliness")[0] == 200:
                    return url
            probe.conn.close()
            time.sleep(0.25)
        raise RuntimeError(f"litellm not ready within {START_TIMEOUT_S} s")

    def stop(self) -> None:
        """Shutdown to the proxy (it flushes its records), then end every process this bench started."""
        if self.router is not None and self.proxy is not None:
            proc, identity = self.proxy
            with contextlib.suppress(zmq.ZMQError):
                self.router.send_multipart([identity, wire.encode(wire.Shutdown(reason="bench done"))])
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=5)
        if self.router is not None:
            self.router.close()
        for proc in self.procs:
            if proc.poll() is None:
                proc.terminate()
        for proc in self.procs:
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        for log in self.logs:
            log.close()


# ---------------------------------------------------------------- the client


class Http:
    """One keep-alive connection; ``post`` times the exchange from first byte out to last byte in."""

    def __init__(self, url: str):
        host, port = url.removeprefix("http://").rsplit(":", 1)
        self.conn = http.client.HTTPConnection(host, int(port), timeout=HTTP_TIMEOUT_S)

    def post(self, path: str, body: bytes, headers: dict[str, str] | None = None) -> tuple[int, bytes, float]:
        hdrs = {"Content-Type": "application/json", **(headers or {})}
        t0 = time.perf_counter()
        self.conn.request("POST", path, body=body, headers=hdrs)
        resp = self.conn.getresponse()
        data = resp.read()
        return resp.status, data, time.perf_counter() - t0

    def get(self, path: str) -> tuple[int, bytes]:
        self.conn.request("GET", path)
        resp = self.conn.getresponse()
        return resp.status, resp.read()


def ok_json(status: int, data: bytes, what: str) -> dict[str, Any]:
    if status != 200:
        raise RuntimeError(f"{what}: HTTP {status}: {data[:300]!r}")
    out = json.loads(data)
    if not isinstance(out, dict):
        raise RuntimeError(f"{what}: want a JSON object")
    return out


@dataclass
class Sample:
    size: str
    context_tokens: int
    proxy_s: float
    direct_s: float
    encode_ids_s: float
    encode_chat_s: float
    litellm_s: float | None = None
    upstream_s: float | None = None


@dataclass
class Bench:
    proxy: Http
    engine: Http
    litellm: Http | None
    secret: bytes
    filler: Filler
    tok_im_end: int
    samples: list[Sample] = field(default_factory=list)
    first_calls_s: dict[str, list[float]] = field(default_factory=dict)
    checks: dict[str, list[int]] = field(default_factory=dict)
    """phase -> [calls that spliced, calls that should have]."""

    def engine_last(self) -> dict[str, Any]:
        status, data = self.engine.get("/bench/last")
        return ok_json(status, data, "engine /bench/last")

    def call_proxy(self, execution_id: str, body: bytes) -> tuple[dict[str, Any], float]:
        headers = {"Authorization": f"Bearer {mint_token(self.secret, execution_id)}"}
        status, data, seconds = self.proxy.post("/v1/chat/completions", body, headers)
        reply = ok_json(status, data, "proxy")["choices"][0]["message"]
        return reply, seconds

    def spliced(self, prev: tuple[list[int], list[int]] | None, prompt: list[int]) -> bool:
        """Does ``prompt`` begin with the previous call's exact prompt + output (+ <|im_end|>)?"""
        if prev is None:
            return False
        head = prev[0] + prev[1]
        if not prev[1] or prev[1][-1] != self.tok_im_end:
            head.append(self.tok_im_end)
        return prompt[: len(head)] == head

    def run_session(
        self, execution_id: str, size: str, messages: list[dict[str, Any]], num_calls: int, rng: random.Random,
        *, phase: str = "latency", prev: tuple[list[int], list[int]] | None = None,
    ) -> tuple[list[dict[str, Any]], tuple[list[int], list[int]] | None]:
        """Calls of one execution; without ``prev`` the first renders from scratch, every other must splice.

        ``phase`` "latency" (and "warm-up") also runs each call through the peers. Returns the
        conversation after the last reply and its tool result, and the last call's (prompt ids, output ids).
        """
        grow = max(8, SIZES[size] // 100)
        for _ in range(num_calls):
            t0 = time.perf_counter()
            body = chat_body(messages)
            encode_chat_s = time.perf_counter() - t0
            gc.collect()
            reply, proxy_s = self.call_proxy(execution_id, body)
            last = self.engine_last()
            prompt = last["body"]["input_ids"]
            if prev is None:
                if phase == "latency":
                    self.first_calls_s.setdefault(size, []).append(proxy_s)
            else:
                checks = self.checks.setdefault(phase, [0, 0])
                checks[0] += self.spliced(prev, prompt)
                checks[1] += 1
                if phase in ("latency", "warm-up"):
                    self.samples.append(self.measure_peers(size, body, last["body"], proxy_s, encode_chat_s))
            prev = (prompt, last["output_ids"])
            messages = messages + [reply, {"role": "tool", "tool_call_id": reply["tool_calls"][0]["id"],
                                           "content": self.filler.text(rng, grow)}]
        return messages, prev

    def measure_peers(self, size: str, chat: bytes, generate: dict[str, Any], proxy_s: float,
                      encode_chat_s: float) -> Sample:
        """The same call straight to the engine, and (when there) through LiteLLM and to its upstream."""
        t0 = time.perf_counter()
        direct_body = json.dumps(generate).encode()
        encode_ids_s = time.perf_counter() - t0
        gc.collect()
        status, data, direct_s = self.engine.post("/generate", direct_body)
        ok_json(status, data, "engine /generate")
        sample = Sample(size, len(generate["input_ids"]), proxy_s, direct_s, encode_ids_s, encode_chat_s)
        if self.litellm is not None:
            gc.collect()
            status, data, sample.upstream_s = self.engine.post("/v1/chat/completions", chat)
            ok_json(status, data, "engine /v1/chat/completions")
            gc.collect()
            status, data, sample.litellm_s = self.litellm.post(
                "/v1/chat/completions", chat, {"Authorization": f"Bearer {LITELLM_KEY}"})
            message = ok_json(status, data, "litellm")["choices"][0]["message"]
            if message.get("content") != REPLY_TEXT.strip():
                raise RuntimeError(f"litellm: unexpected reply {message!r:.200}")
        return sample


# ---------------------------------------------------------------- phases


@contextlib.contextmanager
def no_gc() -> Iterator[None]:
    """This client's own collector stays out of the timed windows (it collects between calls)."""
    gc.collect()
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


def hold_sessions(bench: Bench, num: int, proxy_pid: int, seed: int) -> dict[str, Any]:
    """Open ``num`` ~100k-token executions (two calls each), then one more call each, which must splice."""
    proc = psutil.Process(proxy_pid)
    rss_before = proc.memory_info().rss
    held = []
    t0 = time.perf_counter()
    for i in range(num):
        rng = random.Random(seed * 1_000_003 + i)
        messages = open_conversation(bench.filler, rng, SIZES["100k"])
        held.append((rng, *bench.run_session(f"hold-{i}", "100k", messages, 2, rng, phase="hold")))
    open_s = time.perf_counter() - t0
    rss_held = proc.memory_info().rss
    for i, (rng, messages, prev) in enumerate(held):
        bench.run_session(f"hold-{i}", "100k", messages, 1, rng, phase="hold", prev=prev)
    return {
        "sessions": num, "open_s": round(open_s, 2), "rss_before_mb": rss_before / 2**20,
        "rss_held_mb": rss_held / 2**20, "rss_after_check_mb": proc.memory_info().rss / 2**20,
    }


# ---------------------------------------------------------------- where the time goes, stage by stage


def stage_times(tok: QwenTokenizer, filler: Filler, *, seed: int, repeats: int) -> dict[str, float]:
    """The proxy's CPU work per spliced call at ~100k tokens, stage by stage, in this process.

    The real functions, in the order ``ProxyServer._run_call`` runs them (no sockets); medians in
    ms over ``repeats`` calls of one growing conversation.
    """
    from harness_proxy.openai_api import completion_body, parse_chat_request, reply_message, usage
    from harness_proxy.engine_client import parse_generate_response
    from harness_proxy.sessions import SessionStore
    from harness_proxy.template import parse_output

    rng = random.Random(seed)
    store = SessionStore(tok)
    messages = open_conversation(filler, rng, SIZES["100k"])
    route = wire.EngineRoute(cell_id=0, url="http://engine")
    times: dict[str, list[float]] = {}
    for k in range(repeats + 1):
        body = chat_body(messages)
        out = scripted_output(tok, k)
        answer = json.dumps({"output_ids": out, "meta_info": {
            "finish_reason": {"type": "stop"}, "weight_version": "1",
            "output_token_logprobs": [[-0.5, t, None] for t in out]}}).encode()
        marks = [("start", time.perf_counter())]
        chat = parse_chat_request(body)
        marks.append(("parse_request", time.perf_counter()))
        plan = store.build_prompt("stages", "", chat.messages, chat.tools)
        marks.append(("build_prompt", time.perf_counter()))
        orjson.dumps({"input_ids": plan.prompt_ids, "sampling_params": {"max_new_tokens": 256},
                      "return_logprob": True, "rid": "x"})  # as EngineClient._engine_generate encodes it
        marks.append(("encode_engine_request", time.perf_counter()))
        result = parse_generate_response(json.loads(answer), route)
        marks.append(("parse_engine_answer", time.perf_counter()))
        reply = reply_message(parse_output(tok, result.output_ids))
        marks.append(("parse_output", time.perf_counter()))
        record = wire.CallRecord(
            execution_id="stages", call_id="c", call_index=k, prompt_ids=plan.prompt_ids, output_ids=result.output_ids,
            output_logprobs=result.output_logprobs, weight_version=1, cell_id=0, finish_reason="stop",
            started_at=0.0, finished_at=0.0)
        record.check()
        wire.encode(record)
        marks.append(("encode_call_record", time.perf_counter()))
        store.remember("stages", "", messages=chat.messages, tools=chat.tools, reply=reply,
                       prompt_ids=plan.prompt_ids, output_ids=result.output_ids)
        marks.append(("remember", time.perf_counter()))
        json.dumps(completion_body(call_id="c", created=0, model=MODEL, message=reply, finish="tool_calls",
                                   usage=usage(len(plan.prompt_ids), len(out)))).encode()
        marks.append(("encode_response", time.perf_counter()))
        if k > 0:  # the first call rendered from scratch
            if not plan.spliced:
                raise RuntimeError("stage_times: the call did not splice")
            for (_, t0), (name, t1) in zip(marks, marks[1:]):
                times.setdefault(name, []).append(t1 - t0)
        messages = messages + [reply, {"role": "tool", "tool_call_id": reply["tool_calls"][0]["id"],
                                       "content": filler.text(rng, SIZES["100k"] // 100)}]
        gc.collect()
    return {name: ms(percentile(v, 50)) for name, v in times.items()}


# ---------------------------------------------------------------- figures


def percentile(values: list[float], q: float) -> float:
    """Linear interpolation between closest ranks (numpy's default)."""
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100
    lo = math.floor(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def ms(x: float | None) -> float | None:
    return None if x is None else round(x * 1000, 3)


def summarize(bench: Bench, hold: dict[str, Any], litellm_ok: bool) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for size in SIZES:
        rows = [s for s in bench.samples if s.size == size]
        if not rows:
            continue
        added = [s.proxy_s - s.direct_s for s in rows]
        vs_client = [(s.proxy_s + s.encode_chat_s) - (s.direct_s + s.encode_ids_s) for s in rows]
        out |= {
            f"p50_ms_{size}": ms(percentile(added, 50)), f"p99_ms_{size}": ms(percentile(added, 99)),
            f"p50_ms_{size}_vs_encoding_client": ms(percentile(vs_client, 50)),
            f"p99_ms_{size}_vs_encoding_client": ms(percentile(vs_client, 99)),
            f"proxy_call_p50_ms_{size}": ms(percentile([s.proxy_s for s in rows], 50)),
            f"direct_call_p50_ms_{size}": ms(percentile([s.direct_s for s in rows], 50)),
            f"first_call_p50_ms_{size}": ms(percentile(bench.first_calls_s[size], 50)),
            f"context_tokens_{size}": int(percentile([s.context_tokens for s in rows], 50)),
            f"num_calls_{size}": len(rows),
        }
        if litellm_ok:
            theirs = [s.litellm_s - s.upstream_s for s in rows if s.litellm_s is not None and s.upstream_s is not None]
            out |= {
                f"litellm_p50_ms_{size}": ms(percentile(theirs, 50)),
                f"litellm_p99_ms_{size}": ms(percentile(theirs, 99)),
                f"litellm_ratio_{size}": round(percentile(theirs, 50) / percentile(added, 50), 2),
            }
        else:
            out |= {f"litellm_p50_ms_{size}": None, f"litellm_p99_ms_{size}": None, f"litellm_ratio_{size}": None}
    spliced, checked = bench.checks.get("latency", [0, 0])
    held_spliced, held_checked = bench.checks.get("hold", [0, 0])
    num_held = hold["sessions"]
    out |= {
        "measured_calls": checked, "spliced_calls": spliced,
        "sessions_held_100k": num_held if held_spliced == held_checked else None,
        "held_calls_spliced": held_spliced, "held_calls_checked": held_checked,
        "rss_mb_per_session_100k": round((hold["rss_held_mb"] - hold["rss_before_mb"]) / max(num_held, 1), 3),
        "hold": {k: round(v, 1) if isinstance(v, float) else v for k, v in hold.items()},
    }
    if "p50_ms_100k" in out:
        out["goal_100k"] = {
            "p50_ms<=2": out["p50_ms_100k"] <= 2.0, "p99_ms<=10": out["p99_ms_100k"] <= 10.0,
            "litellm_ratio>=3": None if out["litellm_ratio_100k"] is None else out["litellm_ratio_100k"] >= 3.0,
        }
    return out


def run_info(tokenizer: str, litellm: Path | None) -> dict[str, Any]:
    import aiohttp
    import msgpack
    import tiktoken

    versions = {"python": sys.version.split()[0], "aiohttp": aiohttp.__version__, "tiktoken": tiktoken.__version__,
                "msgpack": ".".join(map(str, msgpack.version)), "pyzmq": zmq.__version__, "litellm": None}
    if litellm is not None:  # what its venv holds, which may not be the version pinned here
        probe = subprocess.run([str(litellm.parent / "python"), "-c", "import importlib.metadata as m; "
                                "print(m.version('litellm'))"], capture_output=True, text=True, timeout=60)
        versions["litellm"] = probe.stdout.strip() or None
    load = os.getloadavg()
    return {
        "host": {"machine": platform.machine(), "system": f"{platform.system()} {platform.release()}",
                 "cpu_count": os.cpu_count(), "loadavg_1m_at_end": round(load[0], 2)},
        "versions": versions,
    }


# ---------------------------------------------------------------- main


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m bench.proxy", description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="tiny sizes (smoke test)")
    ap.add_argument("--tokenizer", choices=["qwen", "qwen_compact"], default="qwen")
    ap.add_argument("--sessions-per-size", type=int, default=None, help="executions per context size (default 20)")
    ap.add_argument("--calls-per-session", type=int, default=None, help="calls per execution (default 10)")
    ap.add_argument("--hold-sessions", type=int, default=None, help="~100k-token executions held (default 48)")
    ap.add_argument("--no-litellm", action="store_true", help="leave LiteLLM out (its figures are null)")
    ap.add_argument("--litellm", type=Path, default=LITELLM_VENV / "bin" / "litellm")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--profile-proxy", type=Path, default=None, help="cProfile the proxy process into this file")
    ap.add_argument("--serve-engine", type=Path, default=None, help=argparse.SUPPRESS)
    ap.add_argument("--records-addr", default="", help=argparse.SUPPRESS)
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    tok = get_tokenizer(args.tokenizer, 1024)
    if args.serve_engine is not None:
        asyncio.run(serve_engine(tok, args.records_addr, args.serve_engine))
        return {}
    sessions = args.sessions_per_size or (1 if args.quick else 20)
    calls = args.calls_per_session or (3 if args.quick else 10)
    num_hold = args.hold_sessions or (2 if args.quick else 48)
    litellm = None if args.no_litellm else args.litellm
    if litellm is not None and not litellm.exists():
        print(f"LiteLLM not found at {litellm}; its figures will be null. To create it (from the repo root):\n"
              f"    {LITELLM_SETUP}", file=sys.stderr, flush=True)
        litellm = None
    load_at_start = round(os.getloadavg()[0], 2)
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="bench-proxy-") as tmp:
        procs = Processes(Path(tmp), args.tokenizer, args.profile_proxy)
        try:
            records_addr = f"tcp://127.0.0.1:{free_port()}"
            engine_url = procs.start_engine(records_addr)
            secret = secrets.token_bytes(32)
            proxy_url, proxy_pid = procs.start_proxy(engine_url, records_addr, secret)
            litellm_url = procs.start_litellm(engine_url, litellm) if litellm is not None else None
            bench = Bench(Http(proxy_url), Http(engine_url), Http(litellm_url) if litellm_url else None,
                          secret, Filler(tok, args.seed), tok.im_end)
            result = run(bench, sessions=sessions, calls=calls, num_hold=num_hold, proxy_pid=proxy_pid,
                         seed=args.seed)
            stages = stage_times(tok, bench.filler, seed=args.seed, repeats=3 if args.quick else 20)
            result["stage_ms_100k"] = stages
            result["stage_sum_ms_100k"] = round(sum(stages.values()), 3)
            time.sleep(0.5)  # the last CallRecord may still be on its way
            result["records"] = bench.engine_last()["records"]
        except Exception:
            for log in sorted(Path(tmp).glob("*.log")):
                print(f"--- {log.name} (tail)\n{log.read_text(errors='replace')[-3000:]}", file=sys.stderr)
            raise
        finally:
            procs.stop()
    result["config"] = {"tokenizer": args.tokenizer, "sessions_per_size": sessions, "calls_per_session": calls,
                        "hold_sessions": num_hold, "quick": args.quick, "litellm": litellm is not None,
                        "sizes": SIZES, "seed": args.seed}
    result |= run_info(args.tokenizer, litellm)
    result["host"]["loadavg_1m_at_start"] = load_at_start
    result["wall_s"] = round(time.perf_counter() - started, 1)
    print(json.dumps(result, sort_keys=True), flush=True)
    return result


def run(bench: Bench, *, sessions: int, calls: int, num_hold: int, proxy_pid: int, seed: int) -> dict[str, Any]:
    with no_gc():
        hold = hold_sessions(bench, num_hold, proxy_pid, seed)
        print(f"held {num_hold} sessions at ~100k tokens: {hold}", file=sys.stderr, flush=True)
        for size, tokens in SIZES.items():  # warm-up: every path a few times per size, not counted
            rng = random.Random(seed - 1)
            bench.run_session(f"warm-{size}", size, open_conversation(bench.filler, rng, tokens), 4, rng,
                              phase="warm-up")
        bench.samples.clear()
        for size, tokens in SIZES.items():
            t0 = time.perf_counter()
            for i in range(sessions):
                rng = random.Random(seed * 7919 + i * 31 + tokens)
                messages = open_conversation(bench.filler, rng, tokens)
                bench.run_session(f"s{size}-{i}", size, messages, calls, rng)
            print(f"{size}: {sessions} executions x {calls} calls in {time.perf_counter() - t0:.1f} s",
                  file=sys.stderr, flush=True)
    return summarize(bench, hold, bench.litellm is not None)


if __name__ == "__main__":
    main()
