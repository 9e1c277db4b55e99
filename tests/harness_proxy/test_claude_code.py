"""The real Claude Code binary, unmodified, headless (``-p``), trained through the proxy.

Claude Code talks to the real proxy (Anthropic Messages API, streaming SSE); the proxy talks to
engine doubles on SGLang's native API that answer like a Qwen3 policy (``claude_code.CodingScript``).
The files the harness writes are real, the CallRecords are the real ones the processor would
get, and the execution's tree is built by the real ``trajectory.tree``.

Drift: every assistant turn in every prompt must be, id for id, one of the engine's earlier
outputs, whether the proxy spliced the history or had to render it afresh (the root after a
compaction). The engine emits ids that re-tokenising their text would not give back, so any
re-rendering shows.

What Claude Code shares with the other harnesses (the pinned binary is installed; the tool loop,
sub-agent and compaction session trains with zero drift) is in ``test_harnesses.py``; here is
what only Claude Code does.
"""

from __future__ import annotations

import threading
import time

import pytest

from base.execution_token import mint_token
from tests.harness_proxy import SECRET, Step
from tests.harness_proxy.claude_code import CodingScript, claude_env, run_claude
from tests.harness_proxy.harness_suite import (  # noqa: F401 (fixtures)
    TASK, call_records, continues, dirs, drift, proxy,
)

pytestmark = pytest.mark.e2e


def test_execution_from_a_custom_header_and_redirect_when_a_cell_drains(proxy, dirs):  # noqa: F811
    """A fixed API key with the execution token in ``ANTHROPIC_CUSTOM_HEADERS``; mid-run the engine
    the session sticks to starts answering ``abort`` (its cell drains) and leaves the routing table:
    the proxy regenerates those calls elsewhere from the same ids and the harness notices nothing."""
    home, work = dirs
    script = CodingScript(work)
    first, second = proxy.engines
    second.policy = script
    served_by_first = 0

    def draining_after_three(input_ids: list[int]) -> Step:
        nonlocal served_by_first
        if served_by_first >= 3:
            return Step(output_ids=[], finish="abort")
        served_by_first += 1
        return script(input_ids)

    first.policy = draining_after_three
    proxy.set_routes([first])  # everyone starts on the first cell
    token = mint_token(SECRET, "ex-hdr")
    env = claude_env(home, proxy.url, "fixed-key-shared-by-all", ANTHROPIC_CUSTOM_HEADERS=f"x-gyre-execution-token: {token}")

    def reroute_when_drained() -> None:
        deadline = time.monotonic() + 60
        while served_by_first < 3 and time.monotonic() < deadline:
            time.sleep(0.01)
        proxy.set_routes([first, second])  # the controller's table lists both until the switch lands

    t = threading.Thread(target=reroute_when_drained)
    t.start()
    run_claude(TASK, cwd=work, env=env)
    t.join()

    assert (work / "sub.txt").read_text() == "sub-agent was here\n"
    records = call_records(proxy.recv_all())
    assert {r.execution_id for r in records} == {"ex-hdr"}
    assert [r.cell_id for r in records[:3]] == [0, 0, 0]
    assert {r.cell_id for r in records[3:]} == {1}
    assert len(first.requests) > 3  # some calls did reach the draining cell and were re-routed
    echoed, differ = drift(records)
    assert echoed > 0 and differ == 0
    mains = [r for r in records if r.lineage == "main"]
    assert all(continues(b, a) for a, b in zip(mains, mains[1:]))  # no compaction here: one line


def test_overloaded_529_is_retried_by_claude_code_until_a_cell_serves(proxy, dirs):  # noqa: F811
    """No serving engine: the proxy answers 529 ``overloaded_error`` after ``route_wait_s``; Claude
    Code retries by itself, and the run completes once the routing table lists an engine."""
    home, work = dirs
    script = CodingScript(work)
    for e in proxy.engines:
        e.policy = script
    proxy.set_routes([])
    timer = threading.Timer(2.0, proxy.set_routes, args=(proxy.engines,))
    timer.start()
    started = time.monotonic()
    out = run_claude(TASK, cwd=work, env=claude_env(home, proxy.url, mint_token(SECRET, "ex-529")))
    timer.join()
    assert out["is_error"] is False
    assert time.monotonic() - started >= 2.0
    assert (work / "hello.txt").read_text() == "hello from gyre, edited\n"
    records = call_records(proxy.recv_all())
    assert len(records) == script.calls["main"] + script.calls["sub-agent"]  # refused attempts are not records
