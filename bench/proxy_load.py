"""Harness proxy under load: many long sessions at once, from several processes, nothing lost or changed.

    .venv/bin/python -m bench.proxy_load [--sessions 512] [--duration-s 300] [--max-tokens-per-session 200000]
                                         [--clients 4] [--growth-tokens 10000] [--think-s 1.0] [--seed 0]

Real processes on loopback, as in ``bench.proxy``: the real proxy (``python -m harness_proxy.main``,
its secret in a 0600 ``--secret-file``), with this process as its controller (routing table, one
``SealExecution`` per finished execution); an *engine double* (``--serve-engine``) that answers
SGLang's ``POST /generate`` at once with a scripted output (text one token per character, then a
tool call: ids only a splice reproduces) and distinct per-token logprobs, and binds the records
socket the proxy sends its CallRecords to, acknowledging each, standing in for the trajectory processor; and ``--clients``
client processes that play harnesses.

Each client runs ``--sessions / --clients`` sessions at once, each an OpenAI chat conversation
on its own keep-alive connection: a system prompt, tools and a task (about 3k tokens), then per
call the proxy's reply echoed back and a tool result of about ``--growth-tokens`` tokens, after
an exponential pause of mean ``--think-s`` (the harness running the tool). A session whose next
call would pass ``--max-tokens-per-session`` ends: its execution is sealed and the session opens
a new one. Calls stop being made after ``--duration-s``; the ones in flight finish, every live
execution is sealed, and the records left in flight are drained.

What is checked, call by call, on the records side (the engine double's process, which saw every
``/generate``): each CallRecord's prompt ids, output ids and logprobs against what the engine
double saw and produced under that request id (``records_inexact`` counts those that differ,
compared by a 128-bit BLAKE2b digest of the ids and the logprobs' float64 bytes); each record
after an execution's first begins with the previous record's prompt + output (+ ``<|im_end|>``),
i.e. the proxy spliced the engine's own ids (``records_spliced`` of ``records_splice_checked``);
each ``ExecutionSealed`` counts the records received for it (``seals_exact`` of ``seals``).
``records_lost`` = calls answered 200 whose CallRecord never reached the records side (which
acknowledges each at once, as the processor does once it is logged; the proxy answers only then).

Figures: ``added_latency_ms`` p50/p99 = the client's wall time per answered call (first byte
sent to last byte read, the body encoded beforehand) minus the engine double's own time for that
call (from its handler's entry, body read included, to its answer); at this concurrency most of
it is waiting in the proxy's one event loop. ``proxy_rss_mb``: the proxy process's RSS at start
(``baseline``), its peak (sampled twice a second), ``end`` (2 s after the last record and seal
are in: what it keeps once every session is sealed), and ``per_session`` = (peak - baseline) /
sessions. ``proxy_cpu_share``: the proxy's CPU seconds over the run's, near 1 when its one event
loop is saturated (then the added latency is mostly queueing). ``errors_by_status``: non-200 answers by status, and connection failures by exception
name. ``context_tokens``: the prompt tokens of the answered calls (p50, max) and how many
sessions reached their cap. The proxy's own counters (``GET /stats``) come along as ``proxy_stats``.

Left out: streaming, the Anthropic API, real generation (the engine double answers at once, so
the proxy is the bottleneck), the trajectory processor's own work (the records side only checks).
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import math
import os
import random
import secrets
import subprocess
import sys
import tempfile
import time
import zlib
from array import array
from collections import Counter
from pathlib import Path
from typing import Any

import orjson
import psutil
import zmq

from bench.proxy import (
    MODEL, TOOLS, Filler, Http, Processes, free_port, open_conversation, percentile, run_info, scripted_output,
    start_on_loopback, take_records, wait_ready_file,
)
from base import wire
from base.execution_token import mint_token, read_secret
from base.tokenizer import QwenTokenizer, get_tokenizer

TOKENIZER = "qwen"
FIRST_TOKENS = 3_000
"""System prompt, tools, task and a few turns: a session's first call."""
MAX_NEW_TOKENS = 256
CLIENT_TIMEOUT_S = 600.0
DRAIN_TIMEOUT_S = 120.0
RSS_EVERY_S = 0.5
RSS_SETTLE_S = 2.0
"""Seconds after the last record and seal are in before ``proxy_rss_mb.end`` is read."""


def ids_digest(ids: list[int]) -> bytes:
    return hashlib.blake2b(array("i", ids).tobytes(), digest_size=16).digest()


def output_digest(ids: list[int], logprobs: list[float]) -> bytes:
    return hashlib.blake2b(array("i", ids).tobytes() + array("d", logprobs).tobytes(), digest_size=16).digest()


def scripted_logprobs(rid: str, n: int) -> list[float]:
    """Distinct, exactly representable logprobs per request and position (a mix-up would show)."""
    seed = zlib.crc32(rid.encode())
    return [-(((seed + 7919 * i) % 4093) + 1) / 1024.0 for i in range(n)]


# ---------------------------------------------------------------- the engine double and the records side


class EngineDouble:
    """``/generate`` answered at once; the proxy's records taken and checked against what it saw."""

    def __init__(self, tok: QwenTokenizer):
        self.tok = tok
        self.num_generate = 0
        self.seen: dict[str, tuple[bytes, bytes]] = {}
        """request id -> (prompt digest, output+logprobs digest)."""
        self.engine_s: dict[str, float] = {}
        self.received: set[str] = set()
        self.counts: Counter[str] = Counter()
        self.lines: dict[str, tuple[int, int, bytes]] = {}
        """execution id -> (records so far, length of prompt+output(+im_end) of the last, its digest)."""

    async def generate(self, request: Any) -> Any:
        from aiohttp import web

        t0 = time.perf_counter()
        body = orjson.loads(await request.read())
        ids, rid = body["input_ids"], body["rid"]
        out = scripted_output(self.tok, self.num_generate)[: body["sampling_params"]["max_new_tokens"]]
        logprobs = scripted_logprobs(rid, len(out))
        self.num_generate += 1
        self.seen[rid] = (ids_digest(ids), output_digest(out, logprobs))
        answer = orjson.dumps({
            "output_ids": out,
            "meta_info": {
                "id": rid, "weight_version": "1", "prompt_tokens": len(ids), "completion_tokens": len(out),
                "finish_reason": {"type": "stop", "matched": self.tok.im_end},
                "output_token_logprobs": [[lp, t, None] for lp, t in zip(logprobs, out)],
            },
        })
        self.engine_s[rid] = time.perf_counter() - t0
        return web.Response(body=answer, content_type="application/json")

    async def abort(self, request: Any) -> Any:
        from aiohttp import web

        return web.json_response({})  # every answer is already complete

    async def report(self, request: Any) -> Any:
        from aiohttp import web

        return web.json_response({"received": sorted(self.received), "engine_s": self.engine_s,
                                  "counts": dict(self.counts), "num_generate": self.num_generate})

    def on_message(self, msg: wire.CallRecord | wire.ExecutionSealed) -> None:
        if isinstance(msg, wire.ExecutionSealed):
            self.on_sealed(msg)
        else:
            self.on_record(msg)

    def on_record(self, rec: wire.CallRecord) -> None:
        self.counts["records"] += 1
        if rec.call_id in self.received:
            self.counts["records_duplicate"] += 1
        self.received.add(rec.call_id)
        seen = self.seen.get(rec.call_id)
        exact = seen is not None and seen == (ids_digest(rec.prompt_ids), output_digest(rec.output_ids,
                                                                                         rec.output_logprobs))
        self.counts["records_exact" if exact else "records_inexact"] += 1
        num, head_len, head = self.lines.get(rec.execution_id, (0, 0, b""))
        if rec.call_index != num:
            self.counts["records_out_of_order"] += 1
        if num:
            self.counts["records_splice_checked"] += 1
            self.counts["records_spliced"] += ids_digest(rec.prompt_ids[:head_len]) == head
        whole = rec.prompt_ids + rec.output_ids
        if not rec.output_ids or rec.output_ids[-1] != self.tok.im_end:
            whole.append(self.tok.im_end)
        self.lines[rec.execution_id] = (num + 1, len(whole), ids_digest(whole))

    def on_sealed(self, sealed: wire.ExecutionSealed) -> None:
        num, _, _ = self.lines.pop(sealed.execution_id, (0, 0, b""))
        self.counts["seals"] += 1
        self.counts["seals_exact"] += num == sealed.num_calls


async def serve_engine(tok: QwenTokenizer, records_addr: str, ready_file: Path) -> None:
    from aiohttp import web

    engine = EngineDouble(tok)
    app = web.Application(client_max_size=256 * 1024 * 1024)
    app.router.add_post("/generate", engine.generate)
    app.router.add_post("/abort_request", engine.abort)
    app.router.add_get("/bench/report", engine.report)
    await start_on_loopback(app, ready_file)
    await take_records(records_addr, engine.on_message)  # until terminated (or a record that does not decode)


# ---------------------------------------------------------------- a client process


_TOOLS_JSON = orjson.dumps(TOOLS)


class Session:
    """One harness's line of calls: the conversation as encoded messages, grown in place."""

    def __init__(self, name: str, filler: Filler, rng: random.Random):
        self.name = name
        self.filler = filler
        self.rng = rng
        self.generation = 0
        self.execution_id = ""
        self.parts: list[bytes] = []
        self.num_calls = 0

    def open(self) -> None:
        self.generation += 1
        self.execution_id = f"{self.name}-x{self.generation}"
        self.parts = [orjson.dumps(m) for m in open_conversation(self.filler, self.rng, FIRST_TOKENS)]
        self.num_calls = 0

    def body(self) -> bytes:
        return (b'{"model":"' + MODEL.encode() + b'","max_tokens":' + str(MAX_NEW_TOKENS).encode()
                + b',"tools":' + _TOOLS_JSON + b',"messages":[' + b",".join(self.parts) + b"]}")

    def grow(self, reply: dict[str, Any], num_tokens: int) -> None:
        self.parts.append(orjson.dumps(reply))
        calls = reply.get("tool_calls") or []
        result = self.filler.text(self.rng, num_tokens)
        if calls:
            self.parts.append(orjson.dumps({"role": "tool", "tool_call_id": calls[0]["id"], "content": result}))
        else:
            self.parts.append(orjson.dumps({"role": "user", "content": result}))


class Client:
    def __init__(self, args: argparse.Namespace):
        self.args = args
        self.secret = read_secret(args.secret_file)
        self.tok = get_tokenizer(TOKENIZER, 1024)
        self.calls: list[tuple[str, float, int]] = []
        """(call id, wall seconds, prompt tokens) per call answered 200."""
        self.errors: Counter[str] = Counter()
        self.reached_max = 0
        self.executions = 0
        self.deadline = 0.0
        ctx = zmq.Context.instance()
        self.seals = ctx.socket(zmq.PUSH)
        self.seals.setsockopt(zmq.LINGER, 10_000)
        self.seals.connect(args.seal_addr)

    def seal(self, session: Session) -> None:
        if session.num_calls:
            self.seals.send(session.execution_id.encode())
            self.executions += 1

    async def run(self) -> dict[str, Any]:
        import aiohttp

        a = self.args
        connector = aiohttp.TCPConnector(limit=0, force_close=False)
        timeout = aiohttp.ClientTimeout(total=CLIENT_TIMEOUT_S)
        self.deadline = time.monotonic() + a.duration_s
        async with aiohttp.ClientSession(a.proxy_url, connector=connector, timeout=timeout) as http:
            sessions = [
                Session(f"c{a.client}-s{i}", Filler(self.tok, a.seed), random.Random(a.seed * 1_000_003 + a.client * 7919 + i))
                for i in range(a.sessions)
            ]
            await asyncio.gather(*(self.run_session(http, s) for s in sessions))
        return {"calls": self.calls, "errors": dict(self.errors), "reached_max": self.reached_max,
                "executions": self.executions}

    async def run_session(self, http: Any, s: Session) -> None:
        import aiohttp

        a = self.args
        await asyncio.sleep(s.rng.uniform(0, min(2.0, a.duration_s / 4)))  # not all at the same instant
        s.open()
        while time.monotonic() < self.deadline:
            body = s.body()
            headers = {"Authorization": f"Bearer {mint_token(self.secret, s.execution_id)}",
                       "Content-Type": "application/json"}
            t0 = time.perf_counter()
            try:
                async with http.post("/v1/chat/completions", data=body, headers=headers) as resp:
                    data = await resp.read()
                    status = resp.status
            except (aiohttp.ClientError, TimeoutError) as exc:
                self.errors[f"conn:{type(exc).__name__}"] += 1
                await asyncio.sleep(0.5)
                continue
            wall_s = time.perf_counter() - t0
            if status != 200:
                self.errors[str(status)] += 1
                await asyncio.sleep(0.5)
                continue
            answer = orjson.loads(data)
            prompt_tokens = answer["usage"]["prompt_tokens"]
            self.calls.append((answer["id"], wall_s, prompt_tokens))
            s.num_calls += 1
            grow = max(16, int(s.rng.lognormvariate(math.log(a.growth_tokens), 0.5)))
            if prompt_tokens + answer["usage"]["completion_tokens"] + grow + 100 > a.max_tokens_per_session:
                self.reached_max += 1
                self.seal(s)
                s.open()
            else:
                s.grow(answer["choices"][0]["message"], grow)
            if a.think_s > 0:
                await asyncio.sleep(s.rng.expovariate(1.0 / a.think_s))
        self.seal(s)


def run_client(args: argparse.Namespace) -> None:
    client = Client(args)
    result = asyncio.run(client.run())
    client.seals.close()
    tmp = args.out.with_name(args.out.name + ".tmp")
    tmp.write_bytes(orjson.dumps(result))
    os.replace(tmp, args.out)


# ---------------------------------------------------------------- the bench


class LoadProcesses(Processes):
    """``bench.proxy``'s processes, with this bench's engine double and clients."""

    def start_engine(self, records_addr: str) -> str:
        ready = self.tmp / "engine.json"
        proc = self.spawn("engine", [sys.executable, "-m", "bench.proxy_load", "--serve-engine", str(ready),
                                     "--records-addr", records_addr])
        return wait_ready_file(ready, proc, "the engine double")

    def start_client(self, k: int, args: argparse.Namespace, proxy_url: str, seal_addr: str,
                     sessions: int) -> tuple[subprocess.Popen[bytes], Path]:
        out = self.tmp / f"client-{k}.json"
        argv = [sys.executable, "-m", "bench.proxy_load", "--client", str(k), "--out", str(out),
                "--proxy-url", proxy_url, "--secret-file", str(self.tmp / "proxy.secret"), "--seal-addr", seal_addr,
                "--sessions", str(sessions), "--duration-s", str(args.duration_s),
                "--max-tokens-per-session", str(args.max_tokens_per_session),
                "--growth-tokens", str(args.growth_tokens), "--think-s", str(args.think_s), "--seed", str(args.seed)]
        return self.spawn(f"client-{k}", argv), out


def share(total: int, parts: int) -> list[int]:
    return [total // parts + (k < total % parts) for k in range(parts)]


def drive(procs: LoadProcesses, clients: list[subprocess.Popen[bytes]], seal_pull: zmq.Socket[bytes],
          proxy: psutil.Process, duration_s: float) -> dict[str, Any]:
    """Until every client has exited: forward seals to the proxy, sample its RSS."""
    assert procs.router is not None and procs.proxy is not None
    identity = procs.proxy[1]
    rss_peak = 0
    num_sealed = 0
    next_rss = 0.0
    limit = time.monotonic() + duration_s + 2 * CLIENT_TIMEOUT_S
    while any(c.poll() is None for c in clients):
        if time.monotonic() > limit:
            raise RuntimeError("clients did not finish")
        if time.monotonic() >= next_rss:
            rss_peak = max(rss_peak, proxy.memory_info().rss)
            next_rss = time.monotonic() + RSS_EVERY_S
        while seal_pull.poll(50):
            execution_id = seal_pull.recv().decode()
            procs.router.send_multipart([identity, wire.encode(wire.SealExecution(execution_id=execution_id))])
            num_sealed += 1
        while procs.router.poll(0):
            procs.router.recv_multipart()  # nothing is expected; an ErrorReply would be in the proxy's log
    while seal_pull.poll(200):  # the last seals of clients that just exited
        procs.router.send_multipart([identity, wire.encode(wire.SealExecution(execution_id=seal_pull.recv().decode()))])
        num_sealed += 1
    for c in clients:
        if c.returncode != 0:
            raise RuntimeError(f"a client exited with {c.returncode}")
    return {"rss_peak": max(rss_peak, proxy.memory_info().rss), "num_sealed": num_sealed}


def drain(engine: Http, answered: int, num_sealed: int) -> dict[str, Any]:
    """The engine double's report once every answered call's record and every seal are in (or DRAIN_TIMEOUT_S)."""
    deadline = time.monotonic() + DRAIN_TIMEOUT_S
    while True:
        status, data = engine.get("/bench/report")
        if status != 200:
            raise RuntimeError(f"engine /bench/report: HTTP {status}")
        report = json.loads(data)
        counts = report["counts"]
        if (counts.get("records", 0) >= answered and counts.get("seals", 0) >= num_sealed) \
                or time.monotonic() > deadline:
            return report
        time.sleep(0.5)


def figures(args: argparse.Namespace, results: list[dict[str, Any]], report: dict[str, Any], rss: dict[str, Any],
            baseline_rss: int, run_s: float, proxy_stats: dict[str, Any]) -> dict[str, Any]:
    calls = [c for r in results for c in r["calls"]]
    answered = {c[0] for c in calls}
    received = set(report["received"])
    engine_s = report["engine_s"]
    added = [wall - engine_s[cid] for cid, wall, _ in calls if cid in engine_s]
    errors: Counter[str] = Counter()
    for r in results:
        errors.update(r["errors"])
    counts = report["counts"]
    prompt_tokens = [c[2] for c in calls]
    mb = 2**20
    return {
        "records_lost": len(answered - received),
        "records_inexact": counts.get("records_inexact", 0),
        "records_received": counts.get("records", 0),
        "records_duplicate": counts.get("records_duplicate", 0),
        "records_out_of_order": counts.get("records_out_of_order", 0),
        "records_spliced": counts.get("records_spliced", 0),
        "records_splice_checked": counts.get("records_splice_checked", 0),
        "records_unanswered": len(received - answered),
        "seals": counts.get("seals", 0), "seals_exact": counts.get("seals_exact", 0),
        "calls": len(calls), "calls_per_s": round(len(calls) / run_s, 2) if run_s > 0 else None,
        "errors_by_status": dict(sorted(errors.items())), "errors": sum(errors.values()),
        "added_latency_ms": {
            "p50": round(percentile(added, 50) * 1000, 2) if added else None,
            "p99": round(percentile(added, 99) * 1000, 2) if added else None,
            "max": round(max(added) * 1000, 2) if added else None,
        },
        "proxy_call_ms": {
            "p50": round(percentile([c[1] for c in calls], 50) * 1000, 2) if calls else None,
            "p99": round(percentile([c[1] for c in calls], 99) * 1000, 2) if calls else None,
        },
        "proxy_cpu_share": rss["proxy_cpu_share"],
        "engine_ms_p50": round(percentile(list(engine_s.values()), 50) * 1000, 3) if engine_s else None,
        "proxy_rss_mb": {
            "baseline": round(baseline_rss / mb, 1), "peak": round(rss["rss_peak"] / mb, 1),
            "end": round(rss["rss_end"] / mb, 1),
            "per_session": round((rss["rss_peak"] - baseline_rss) / mb / args.sessions, 3),
        },
        "context_tokens": {
            "p50": int(percentile(prompt_tokens, 50)) if prompt_tokens else None,
            "max": max(prompt_tokens, default=None),
            "sessions_reached_max": sum(r["reached_max"] for r in results),
        },
        "executions": sum(r["executions"] for r in results),
        "proxy_stats": proxy_stats,
    }


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m bench.proxy_load", description=__doc__.split("\n")[0])
    ap.add_argument("--sessions", type=int, default=512, help="sessions at once, over all clients")
    ap.add_argument("--duration-s", type=float, default=300.0, help="how long calls are made")
    ap.add_argument("--max-tokens-per-session", type=int, default=200_000,
                    help="a session's cap: its next call would pass it, so it ends and a new one opens")
    ap.add_argument("--clients", type=int, default=4, help="client processes")
    ap.add_argument("--growth-tokens", type=int, default=10_000, help="mean tokens of tool result per call")
    ap.add_argument("--think-s", type=float, default=1.0, help="mean pause between a session's calls")
    ap.add_argument("--seed", type=int, default=0)
    # internal: the engine double and the client processes
    ap.add_argument("--serve-engine", type=Path, default=None, help=argparse.SUPPRESS)
    ap.add_argument("--records-addr", default="", help=argparse.SUPPRESS)
    ap.add_argument("--client", type=int, default=None, help=argparse.SUPPRESS)
    ap.add_argument("--out", type=Path, default=None, help=argparse.SUPPRESS)
    ap.add_argument("--proxy-url", default="", help=argparse.SUPPRESS)
    ap.add_argument("--secret-file", type=Path, default=None, help=argparse.SUPPRESS)
    ap.add_argument("--seal-addr", default="", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.client is None and args.serve_engine is None:
        if args.sessions < 1 or args.clients < 1 or args.duration_s <= 0 or args.max_tokens_per_session <= FIRST_TOKENS:
            ap.error(f"want --sessions >= 1, --clients >= 1, --duration-s > 0, --max-tokens-per-session > {FIRST_TOKENS}")
        args.clients = min(args.clients, args.sessions)
    return args


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    if args.serve_engine is not None:
        asyncio.run(serve_engine(get_tokenizer(TOKENIZER, 1024), args.records_addr, args.serve_engine))
        return {}
    if args.client is not None:
        run_client(args)
        return {}
    load_at_start = round(os.getloadavg()[0], 2)
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="bench-proxy-load-") as tmp:
        procs = LoadProcesses(Path(tmp), TOKENIZER)
        seal_pull = zmq.Context.instance().socket(zmq.PULL)
        seal_pull.setsockopt(zmq.LINGER, 0)
        seal_addr = f"tcp://127.0.0.1:{seal_pull.bind_to_random_port('tcp://127.0.0.1')}"
        try:
            records_addr = f"tcp://127.0.0.1:{free_port()}"
            engine_url = procs.start_engine(records_addr)
            proxy_url, proxy_pid = procs.start_proxy(engine_url, records_addr, secrets.token_bytes(32))
            proxy = psutil.Process(proxy_pid)
            baseline_rss = proxy.memory_info().rss
            cpu0 = sum(proxy.cpu_times()[:2])
            t0 = time.perf_counter()
            clients = [procs.start_client(k, args, proxy_url, seal_addr, n)
                       for k, n in enumerate(share(args.sessions, args.clients))]
            rss = drive(procs, [c for c, _ in clients], seal_pull, proxy, args.duration_s)
            run_s = time.perf_counter() - t0
            rss["proxy_cpu_share"] = round((sum(proxy.cpu_times()[:2]) - cpu0) / run_s, 3)
            results = [orjson.loads(out.read_bytes()) for _, out in clients]
            answered = sum(len(r["calls"]) for r in results)
            report = drain(Http(engine_url), answered, rss["num_sealed"])
            time.sleep(RSS_SETTLE_S)  # the proxy trims freed memory within a second of the last seals
            rss["rss_end"] = proxy.memory_info().rss
            status, data = Http(proxy_url).get("/stats")
            proxy_stats = json.loads(data) if status == 200 else {}
            result = figures(args, results, report, rss, baseline_rss, run_s, proxy_stats)
        except Exception:
            for log in sorted(Path(tmp).glob("*.log")):
                print(f"--- {log.name} (tail)\n{log.read_text(errors='replace')[-3000:]}", file=sys.stderr)
            raise
        finally:
            seal_pull.close()
            procs.stop()
    result["config"] = {"sessions": args.sessions, "duration_s": args.duration_s,
                        "max_tokens_per_session": args.max_tokens_per_session, "clients": args.clients,
                        "growth_tokens": args.growth_tokens, "think_s": args.think_s, "seed": args.seed,
                        "tokenizer": TOKENIZER, "first_tokens": FIRST_TOKENS}
    result |= run_info(TOKENIZER, None)
    result["host"]["loadavg_1m_at_start"] = load_at_start
    result["run_s"] = round(run_s, 1)
    result["wall_s"] = round(time.perf_counter() - started, 1)
    print(json.dumps(result, sort_keys=True), flush=True)
    return result


if __name__ == "__main__":
    main()
