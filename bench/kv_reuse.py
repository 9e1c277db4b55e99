"""KV computed once: a group's executions share their harness prompt, and a redirected session's KV goes with it.

    .venv/bin/python -m bench.kv_reuse [--executions 16] [--cells 4] [--threads 1] [--skip-redirect]

Printed last, one JSON object, each figure from this one run, side by side:

- **Prompts that can share.** A group of ``--executions`` executions of one pyfix task is started
  the way ``gyre +experiment=pyfix_claude_code`` starts it (``controller.executions``, the pinned
  Claude Code in bwrap, the task's own workspace), twice: with each execution shown at its own
  host paths (``before``: how Gyre ran them until the sandbox showed fixed paths) and at
  ``/workspace`` and ``/home/agent`` (``after``). A loopback server on the proxy's socket takes
  each execution's first ``/v1/messages`` call and ends the turn. The calls are rendered by the
  proxy's own path; ``before`` keeps Claude Code's billing line at the head of the system prompt,
  as the proxy did. ``shared_prefix_ids`` is the ids the group's first prompts all share after
  (``shared_prefix_ids_before`` before), ``prompt_ids`` their length.
- **One prefix cache per engine.** Those first prompts go to ``--cells`` embedded engines (the
  tiny model of conf/, its prefix cache on) all at once, routed by the proxy's ``Router``:
  ``before`` least-loaded with engines that cache only finished requests; ``after`` with prefix
  affinity (``conf/proxy/default.yaml``'s slack) and engines that share an in-flight prefill.
  ``group_prefill_tokens_before`` / ``_after`` count the prompt ids the engines ran
  (``EmbeddedEngine.num_prefill_tokens``), ``group_prefill_ratio`` is after over before;
  ``group_prefill_ratio_1cell`` the same on one engine. Each reply is checked against the same
  prompt on a fresh engine.
- **KV that follows a redirect** (``cellrunner.kv_tier`` on a ``mooncake_master`` over TCP): a
  session of 20k (and 100k) ids runs on engine A; A drains (writing its cached KV to the store)
  and the session's next call, its context plus a tool result, goes to engine B. Without the tier
  B recomputes the whole context; with it B reads the KV and computes the rest.
  ``redirect_recomputed_fraction_<n>`` is B's prefilled ids over the call's prompt,
  ``redirect_ttft_speedup_<n>`` B's time to the first token without the tier over with it.

Left out: decoding past the first token, the proxy process itself (its ``Router`` and render path
are used in process), training. Times are one machine's and noisy; token counts are exact.
"""

from __future__ import annotations

import argparse
import json
import os
import socketserver
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch
import yaml

from base.execution_token import verify_token
from base.tokenizer import get_tokenizer
from base.wire import EngineRoute, RoutingTable
from bench.fixtures import run_info
from bench.prefix_cache import CLAUDE_BIN, _Capture, common_prefix, generate
from bench.switch import load_config
from cellrunner.config import ModelConfig
from cellrunner.engine import EmbeddedEngine
from cellrunner.model import build_model, flatten_params
from controller.executions import ExecutionManager, ProxyEndpoint
from harness_proxy import anthropic_api
from harness_proxy.routing import Router
from harness_proxy.template import render_messages
from workloads.parts import build_parts

ROOT = Path(__file__).resolve().parents[1]
SECRET = b"kv-reuse-bench-secret-0123456789"
MIN_TOKENS = 64  # the prefix cache's shortest reuse (conf/engine/embedded.yaml)


# ---------------------------------------------------------------- the group's first calls


class _SocketCapture(_Capture):
    """bench.prefix_cache's capture server on the proxy's Unix socket, keyed by execution."""

    by_execution: dict[str, bytes] = {}
    lock = threading.Lock()

    def address_string(self) -> str:
        return "unix"

    def record(self, raw: bytes) -> None:
        if json.loads(raw).get("tools"):  # the main agent's call, not a session-title call
            execution_id, _, _ = verify_token(SECRET, self.headers.get("x-api-key", ""))
            with self.lock:
                self.by_execution.setdefault(execution_id, raw)


class _HostPaths:
    """The run's sandbox, showing each execution at its own host paths (Gyre before fixed paths)."""

    shows_fixed_paths = False

    def __init__(self, inner: Any) -> None:
        self.inner, self.kind = inner, inner.kind

    def wrap(self, spec: Any) -> list[str]:
        return self.inner.wrap(spec)

    def describe(self) -> str:
        return self.inner.describe()


def first_calls(n: int, *, fixed_paths: bool, work: Path) -> list[bytes]:
    """The first main-agent /v1/messages body of each of `n` executions of one pyfix task."""
    cfg = load_config(["+experiment=pyfix_claude_code"])
    parts = build_parts(cfg.workload, cfg.harness, cfg.sandbox, run_name="kv-reuse-bench")
    sandbox = parts.sandbox if fixed_paths else _HostPaths(parts.sandbox)
    sock_dir = work / "proxy"
    sock_dir.mkdir(parents=True)
    server = socketserver.ThreadingUnixStreamServer(str(sock_dir / "proxy.sock"), _SocketCapture)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    _SocketCapture.by_execution = {}
    mgr = ExecutionManager(
        workload=cfg.workload, taskset=parts.taskset, harness=parts.harness, sandbox=sandbox,
        work_dir=work / "runs", model_name=cfg.proxy.model_name, secret=SECRET,
        proxy=ProxyEndpoint(url="http://127.0.0.1:8080", unix_socket=sock_dir / "proxy.sock"),
    )
    task = parts.taskset.split()[0][0]
    group = mgr.plan_group(step=0, group_id="s0-g0", task=task, train=True, temperature=1.0, size=n)
    try:
        for ex in group:
            mgr.launch(ex, time.monotonic())
        for ex in group:
            ex.spawning.result(timeout=120).wait(timeout=600)
    finally:
        mgr.kill_all()
        server.shutdown()
        server.server_close()
        parts.close()
    missing = [ex.execution_id for ex in group if ex.execution_id not in _SocketCapture.by_execution]
    if missing:
        raise SystemExit(f"no first call from {missing}: see {work / 'runs'}/<execution>/stderr.log")
    return [_SocketCapture.by_execution[ex.execution_id] for ex in group]


def render(raw: bytes, tok: Any, *, billing_line: bool) -> list[int]:
    """The ids the proxy renders for a first call; `billing_line`: as it did before it dropped
    Claude Code's billing block (that block's text first in the system prompt)."""
    chat = anthropic_api.parse_messages_request(raw, {}).chat
    messages = [dict(m) for m in chat.messages]
    if billing_line:
        system = json.loads(raw).get("system")
        dropped = [b["text"] for b in system if isinstance(b, dict) and b.get("type") == "text"
                   and str(b.get("text", "")).startswith(anthropic_api.ACCOUNTING_BLOCK_PREFIXES)]
        if dropped:
            messages[0]["content"] = "\n".join([*dropped, messages[0]["content"]])
    return render_messages(tok, messages, tools=chat.tools)


def shared_by_all(prompts: list[list[int]]) -> int:
    return min(common_prefix(prompts[0], p) for p in prompts[1:]) if len(prompts) > 1 else len(prompts[0])


# ---------------------------------------------------------------- the engines


class Engines:
    """`n` embedded engines of the tiny model in this process, on one set of weights."""

    def __init__(self, n: int, model_cfg: ModelConfig, vocab_size: int, weights: Any, *, share_prefill: bool,
                 **engine_kw: Any) -> None:
        self.engines = []
        for i in range(n):
            engine = EmbeddedEngine(model_cfg=model_cfg, vocab_size=vocab_size, host="127.0.0.1", port=0, cell_id=i,
                                    max_running=32, seed=0, prefix_cache_bytes=4 << 30,
                                    prefix_cache_min_tokens=MIN_TOKENS, share_prefill=share_prefill, **engine_kw)
            engine.start()
            engine.resume(weights)
            self.engines.append(engine)
        self.routes = [EngineRoute(cell_id=i, url=e.url, weight_version=weights.version)
                       for i, e in enumerate(self.engines)]

    def prefilled(self) -> int:
        return sum(e.num_prefill_tokens() for e in self.engines)

    def close(self) -> None:
        for e in self.engines:
            e.stop()


def serve_group(engines: Engines, prompts: list[list[int]], *, affinity: bool) -> tuple[int, list[list[int]]]:
    """Route every first call at once (each stays in flight), send them together; return the ids
    prefilled and each call's first output id."""
    proxy = yaml.safe_load((ROOT / "conf/proxy/default.yaml").read_text())
    router = Router(affinity_slack=proxy["affinity_slack"] if affinity else 0, min_prefix=proxy["affinity_min_prefix"])
    router.update(RoutingTable(version=1, engines=engines.routes))
    urls = []
    for i, prompt in enumerate(prompts):
        route = router.choose(f"s0-g0-e{i}", "main", prompt_ids=prompt if affinity else ())
        router._in_flight[route.url] += 1  # in flight until every first call is answered
        urls.append(route.url)
    by_url = {e.url: e for e in engines.engines}
    before = engines.prefilled()
    with ThreadPoolExecutor(len(prompts)) as pool:
        replies = list(pool.map(lambda a: generate(by_url[a[0]], a[1], 1)[0], zip(urls, prompts)))
    return engines.prefilled() - before, [r["output_ids"] for r in replies]


def group_prefill(prompts_before: list[list[int]], prompts_after: list[list[int]], cells: int, model_cfg: ModelConfig,
                  vocab_size: int, weights: Any) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for label, n in (("", cells), ("_1cell", 1)):
        old = Engines(n, model_cfg, vocab_size, weights, share_prefill=False)
        try:
            before, _ = serve_group(old, prompts_before, affinity=False)
        finally:
            old.close()
        new = Engines(n, model_cfg, vocab_size, weights, share_prefill=True)
        try:
            after, outputs = serve_group(new, prompts_after, affinity=True)
        finally:
            new.close()
        out[f"group_prefill_tokens_before{label}"] = before
        out[f"group_prefill_tokens_after{label}"] = after
        out[f"group_prefill_ratio{label}"] = round(after / before, 4)
        if label == "":
            out["outputs_checked"] = check_outputs(prompts_after, outputs, model_cfg, vocab_size, weights)
    return out


def check_outputs(prompts: list[list[int]], outputs: list[list[int]], model_cfg: ModelConfig, vocab_size: int,
                  weights: Any) -> int:
    """Each distinct prompt's first output id equals a fresh engine's (no cache): sharing changed no answer."""
    fresh = Engines(1, model_cfg, vocab_size, weights, share_prefill=True)
    try:
        seen: dict[tuple[int, ...], list[int]] = {}
        for prompt, got in zip(prompts, outputs):
            key = tuple(prompt)
            if key not in seen:
                seen[key] = generate(fresh.engines[0], prompt, 1)[0]["output_ids"]
            if seen[key] != got:
                raise SystemExit("a shared prefill changed an answer: the cache is wrong")
        return len(seen)
    finally:
        fresh.close()


# ---------------------------------------------------------------- main


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--executions", type=int, default=16)
    ap.add_argument("--cells", type=int, default=4)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--skip-redirect", action="store_true")
    args = ap.parse_args(argv)
    if not os.access(CLAUDE_BIN, os.X_OK):
        raise SystemExit(f"{CLAUDE_BIN} missing: run `make claude-code`")
    torch.set_num_threads(args.threads)
    model_cfg = ModelConfig(**yaml.safe_load((ROOT / "conf/model/tiny.yaml").read_text()))
    tok = get_tokenizer(model_cfg.tokenizer, model_cfg.compact_ranks)
    out: dict[str, Any] = {"bench": "kv_reuse", "executions": args.executions, "cells": args.cells,
                           "tokenizer": f"{model_cfg.tokenizer}/{model_cfg.compact_ranks}", "threads": args.threads}
    with tempfile.TemporaryDirectory(prefix="gyre-kv-reuse-") as tmp:
        t0 = time.monotonic()
        raw_before = first_calls(args.executions, fixed_paths=False, work=Path(tmp) / "before")
        raw_after = first_calls(args.executions, fixed_paths=True, work=Path(tmp) / "after")
        out["capture_s"] = round(time.monotonic() - t0, 1)
    before = [render(r, tok, billing_line=True) for r in raw_before]
    after = [render(r, tok, billing_line=False) for r in raw_after]
    out["prompt_ids"] = len(after[0])
    out["shared_prefix_ids_before"] = shared_by_all(before)
    out["shared_prefix_ids"] = shared_by_all(after)
    out["distinct_first_prompts_after"] = len({tuple(p) for p in after})
    weights = flatten_params(build_model(model_cfg, tok.vocab_size), 0)
    t0 = time.monotonic()
    out.update(group_prefill(before, after, args.cells, model_cfg, tok.vocab_size, weights))
    out["group_s"] = round(time.monotonic() - t0, 1)
    if not args.skip_redirect:
        from bench.kv_redirect import redirect_figures

        out.update(redirect_figures(model_cfg, tok, weights, first=after[0]))
    json.dump({**out, **run_info()}, sys.stdout, sort_keys=True)
    print(flush=True)


if __name__ == "__main__":
    main()
