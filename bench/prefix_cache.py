"""Long harness prompts on the embedded engine: their length per vocabulary, and the prefix cache.

    .venv/bin/python -m bench.prefix_cache [--calls 8] [--max-new-tokens 32] [--threads 1]
                                           [--request FILE] [--synthetic N]

What is measured, in one run, printed as one JSON object:

- ``prompt_tokens``: the first ``/v1/messages`` request of the real Claude Code binary (the pinned
  ``.tools/claude-code``, headless and offline against a loopback server of this module that logs
  the request and ends the turn), rendered by the proxy's own path (``parse_messages_request`` +
  ``render_messages``) with the compact vocabulary at 1,024 ranks (the tiny model's), at 4,096,
  and with the full Qwen vocabulary. ``body_chars`` is the request's JSON size. Two first
  requests with different tasks are captured: ``shared_prefix_tokens`` is how many ids they share
  (the system prompt and tools, up to whatever differs first).
- ``session``: a Claude-Code-shaped session on the embedded engine (tiny model, conf/): call 1
  is that first prompt; call k+1 is call k's prompt + its output + a tool result (a slice of this
  repository's README as a user turn). The same session runs on two engines in this process,
  cache off then cache on, greedy, one thread: per-call wall time of ``/generate`` over HTTP,
  prefilled tokens (``EmbeddedEngine.num_prefill_tokens``) and ``cached_tokens``, the outputs'
  agreement (same ids; the largest log-prob difference), and the totals side by side.
  ``first_prefill_s`` is call 1 with ``max_new_tokens=1`` on an engine that has not seen it
  (after a 64-token warm-up): the full prompt's prefill. ``second_execution`` is another execution's first call (the other task) on the warm
  cache: what a shared system prompt saves across executions.

Left out: the proxy (its render time, the session splice), concurrency with other sessions,
training. A shared machine shows as noise in the times; the token counts are exact.
``--request FILE`` reads a saved request body instead of running the binary (no second task
then); ``--synthetic N`` uses N random ids as the first prompt (no binary, no vocabulary figures).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import numpy as np
import torch
import yaml

from bench.fixtures import run_info
from cellrunner.config import ModelConfig
from cellrunner.engine import EmbeddedEngine
from cellrunner.model import build_model, flatten_params
from harness_proxy import anthropic_api
from harness_proxy.template import generation_prompt, render_messages, render_turn
from base.tokenizer import get_tokenizer

ROOT = Path(__file__).resolve().parents[1]
CLAUDE_BIN = ROOT / ".tools" / "claude-code" / "node_modules" / ".bin" / "claude"
TASKS = ("create hello.txt containing hi", "list the python files in this folder and count their lines")
VOCABULARIES = {"qwen_compact_1024": ("qwen_compact", 1024), "qwen_compact_4096": ("qwen_compact", 4096),
                "qwen_full": ("qwen", 151643)}


# ---------------------------------------------------------------- capturing Claude Code's first request


class _Capture(BaseHTTPRequestHandler):
    """Logs every /v1/messages body and ends the turn with one text block (stream or not)."""

    bodies: list[bytes] = []

    def log_message(self, *args: Any) -> None:
        pass

    def do_HEAD(self) -> None:
        self.send_response(200)
        self.end_headers()

    def do_POST(self) -> None:
        raw = self.rfile.read(int(self.headers.get("Content-Length", 0)))
        if "/count_tokens" in self.path:
            return self._json({"input_tokens": 1})
        self.record(raw)
        self.end_turn(raw)

    def record(self, raw: bytes) -> None:
        self.bodies.append(raw)

    def end_turn(self, raw: bytes) -> None:
        message = {"id": "msg_bench", "type": "message", "role": "assistant", "model": "gyre-policy",
                   "content": [{"type": "text", "text": "done"}], "stop_reason": "end_turn", "stop_sequence": None,
                   "usage": {"input_tokens": 1, "output_tokens": 1}}
        if not json.loads(raw).get("stream"):
            return self._json(message)
        events = [
            ("message_start", {"type": "message_start", "message": {**message, "content": [], "stop_reason": None}}),
            ("content_block_start", {"type": "content_block_start", "index": 0,
                                     "content_block": {"type": "text", "text": ""}}),
            ("content_block_delta", {"type": "content_block_delta", "index": 0,
                                     "delta": {"type": "text_delta", "text": "done"}}),
            ("content_block_stop", {"type": "content_block_stop", "index": 0}),
            ("message_delta", {"type": "message_delta", "delta": {"stop_reason": "end_turn", "stop_sequence": None},
                               "usage": {"output_tokens": 1}}),
            ("message_stop", {"type": "message_stop"}),
        ]
        data = b"".join(f"event: {name}\ndata: {json.dumps(d)}\n\n".encode() for name, d in events)
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _json(self, body: dict[str, Any]) -> None:
        data = json.dumps(body).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)


def capture_first_requests(tasks: tuple[str, ...]) -> list[bytes]:
    """The first /v1/messages body Claude Code sends for each task (notes/harness-claude-code.md §2)."""
    if not os.access(CLAUDE_BIN, os.X_OK):
        raise SystemExit(f"{CLAUDE_BIN} missing: run `make claude-code`, or pass --request / --synthetic")
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Capture)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    firsts = []
    try:
        for task in tasks:
            _Capture.bodies = []
            with tempfile.TemporaryDirectory() as home, tempfile.TemporaryDirectory() as work:
                env = {"PATH": "/usr/bin:/bin", "HOME": home, "LANG": "C.UTF-8",
                       "ANTHROPIC_BASE_URL": f"http://127.0.0.1:{server.server_address[1]}",
                       "ANTHROPIC_API_KEY": "bench", "ANTHROPIC_MODEL": "gyre-policy",
                       "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1", "IS_SANDBOX": "1"}
                subprocess.run([str(CLAUDE_BIN), "-p", task, "--output-format", "json",
                                "--dangerously-skip-permissions"], cwd=work, env=env, capture_output=True,
                               timeout=240, stdin=subprocess.DEVNULL, check=True)
            firsts.append(_Capture.bodies[0])
    finally:
        server.shutdown()
    return firsts


def render(raw: bytes, kind: str, ranks: int) -> list[int]:
    """The prompt ids the proxy renders for a first call (no session to splice from)."""
    chat = anthropic_api.parse_messages_request(raw, {}).chat
    return render_messages(get_tokenizer(kind, ranks), chat.messages, tools=chat.tools)


def common_prefix(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    differ = np.flatnonzero(np.asarray(a[:n]) != np.asarray(b[:n]))
    return int(differ[0]) if len(differ) else n


# ---------------------------------------------------------------- the session on the engine


def generate(engine: EmbeddedEngine, prompt: list[int], max_new_tokens: int) -> tuple[dict[str, Any], float]:
    body = {"input_ids": prompt, "return_logprob": True,
            "sampling_params": {"max_new_tokens": max_new_tokens, "temperature": 0.0, "ignore_eos": True}}
    req = urllib.request.Request(engine.url + "/generate", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    t0 = time.perf_counter()
    with urllib.request.urlopen(req, timeout=600) as resp:
        reply = json.loads(resp.read())
    return reply, time.perf_counter() - t0


def tool_results(tok: Any, num: int) -> list[list[int]]:
    """Tool-result turns of 200 to 1,600 README characters, as the next call appends them."""
    text = (ROOT / "README.md").read_text()
    rng = np.random.default_rng(0)
    out = []
    for _ in range(num):
        size = int(rng.integers(200, 1600))
        start = int(rng.integers(0, max(1, len(text) - size)))
        turn = render_turn(tok, "user", f"<tool_response>\n{text[start:start + size]}\n</tool_response>")
        out.append(tok.encode("\n") + turn + generation_prompt(tok))
    return out


def run_session(engine: EmbeddedEngine, first: list[int], results: list[list[int]], max_new_tokens: int
                ) -> list[dict[str, Any]]:
    calls, prompt = [], first
    for k in range(len(results) + 1):
        before = engine.num_prefill_tokens()
        reply, wall_s = generate(engine, prompt, max_new_tokens)
        meta = reply["meta_info"]
        calls.append({"prompt_tokens": len(prompt), "cached_tokens": meta["cached_tokens"],
                      "prefill_tokens": engine.num_prefill_tokens() - before, "wall_s": round(wall_s, 4),
                      "output_ids": reply["output_ids"],
                      "logprobs": [lp for lp, _, _ in meta["output_token_logprobs"]]})
        if k < len(results):
            prompt = prompt + reply["output_ids"] + results[k]
    return calls


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--calls", type=int, default=8)
    ap.add_argument("--max-new-tokens", type=int, default=32)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--request", type=Path, help="a saved first /v1/messages body instead of running Claude Code")
    ap.add_argument("--synthetic", type=int, default=0, help="N random ids as the first prompt")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    model_cfg = ModelConfig(**yaml.safe_load((ROOT / "conf/model/tiny.yaml").read_text()))
    tok = get_tokenizer(model_cfg.tokenizer, model_cfg.compact_ranks)
    out: dict[str, Any] = {"bench": "prefix_cache", "model": model_cfg.name,
                           "tokenizer": f"{model_cfg.tokenizer}/{model_cfg.compact_ranks}",
                           "max_position_embeddings": model_cfg.max_position_embeddings, "threads": args.threads}

    second: list[int] | None = None
    if args.synthetic:
        first = np.random.default_rng(0).integers(0, 1000, args.synthetic).tolist()
    else:
        raws = [args.request.read_bytes()] if args.request else capture_first_requests(TASKS)
        out["prompt_tokens"] = {name: len(render(raws[0], kind, ranks)) for name, (kind, ranks) in VOCABULARIES.items()}
        out["body_chars"] = len(raws[0])
        first = render(raws[0], model_cfg.tokenizer, model_cfg.compact_ranks)
        if len(raws) > 1:
            second = render(raws[1], model_cfg.tokenizer, model_cfg.compact_ranks)
            out["shared_prefix_tokens"] = common_prefix(first, second)
            out["second_prompt_tokens"] = len(second)
    results = tool_results(tok, args.calls - 1)

    weights = flatten_params(build_model(model_cfg, tok.vocab_size), 0)
    engines = {}
    for name, cache_bytes in (("no_cache", 0), ("cache", 256 << 20)):
        engine = EmbeddedEngine(model_cfg=model_cfg, vocab_size=tok.vocab_size, host="127.0.0.1", port=0,
                                cell_id=len(engines), max_running=4, seed=0, prefix_cache_bytes=cache_bytes,
                                prefix_cache_min_tokens=64)
        engine.start()
        engine.resume(weights)
        engines[name] = engine
    try:
        for engine in engines.values():  # warm-up: the first forward of a process pays one-off costs
            generate(engine, list(range(1, 65)), 2)
        _, out["first_prefill_s"] = generate(engines["no_cache"], first, 1)
        out["first_prefill_s"] = round(out["first_prefill_s"], 3)
        runs = {name: run_session(engine, first, results, args.max_new_tokens) for name, engine in engines.items()}
        if second is not None:
            reply, wall_s = generate(engines["cache"], second, args.max_new_tokens)
            out["second_execution"] = {"prompt_tokens": len(second), "cached_tokens": reply["meta_info"]["cached_tokens"],
                                       "wall_s": round(wall_s, 4)}
    finally:
        for engine in engines.values():
            engine.stop()

    same = all(a["output_ids"] == b["output_ids"] for a, b in zip(runs["cache"], runs["no_cache"]))
    diff = max(float(np.max(np.abs(np.subtract(a["logprobs"], b["logprobs"]))))
               for a, b in zip(runs["cache"], runs["no_cache"]))
    out["session"] = {
        "calls": args.calls, "max_new_tokens": args.max_new_tokens,
        "per_call": [{"prompt_tokens": a["prompt_tokens"],
                      **{f"{name}_{key}": runs[name][i][key] for name in ("no_cache", "cache")
                         for key in ("prefill_tokens", "wall_s")},
                      "cached_tokens": a["cached_tokens"]} for i, a in enumerate(runs["cache"])],
        "same_outputs": same, "max_abs_logprob_diff": diff,
    }
    for name in ("no_cache", "cache"):
        out["session"][f"{name}_prefill_tokens"] = sum(c["prefill_tokens"] for c in runs[name])
        out["session"][f"{name}_wall_s"] = round(sum(c["wall_s"] for c in runs[name]), 3)
    s = out["session"]
    s["prefill_tokens_saved"] = s["no_cache_prefill_tokens"] - s["cache_prefill_tokens"]
    s["speedup"] = round(s["no_cache_wall_s"] / s["cache_wall_s"], 2)
    json.dump({**out, **run_info()}, sys.stdout, sort_keys=True)
    print(flush=True)


if __name__ == "__main__":
    main()
