"""The real Claude Code binary, unmodified, headless (``-p``), trained through the proxy.

Claude Code talks to the real proxy (Anthropic Messages API, streaming SSE); the proxy talks to
engine doubles on SGLang's native API that answer like a Qwen3 policy (``claude_code.CodingScript``).
The files the harness writes are real, the CallRecords are the real ones the processor would
get, and the execution's tree is built by the real ``trajectory.tree``.

Drift: every assistant turn in every prompt must be, id for id, one of the engine's earlier
outputs, whether the proxy spliced the history or had to render it afresh (the root after a
compaction). The engine emits ids that re-tokenising their text would not give back, so any
re-rendering shows.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest

from base import wire
from base.execution_token import mint_token
from harness_proxy.template import generation_prompt
from tests.harness_proxy import SECRET, TOK, LiveProxy, Step
from tests.harness_proxy.claude_code import (
    CLAUDE_BIN, CLAUDE_CODE_VERSION, CodingScript, claude_env, claude_version, run_claude,
)
from trajectory.tree import TokenTree

pytestmark = pytest.mark.e2e

TASK = "Create hello.txt, edit it, and have a sub-agent write sub.txt."
# Auto-compaction at 40% of a 100k window: above the ~17k-id prompts before the large Bash output
# (compact vocabulary), below the ~45k-id prompt after it, so exactly one compaction happens.
COMPACT_ENV = {"CLAUDE_CODE_AUTO_COMPACT_WINDOW": "100000", "CLAUDE_AUTOCOMPACT_PCT_OVERRIDE": "40"}


def test_the_pinned_claude_code_binary_is_installed():
    assert claude_version() == CLAUDE_CODE_VERSION, f"{CLAUDE_BIN} missing or not {CLAUDE_CODE_VERSION}: run `make claude-code`"


@pytest.fixture
def proxy():
    p = LiveProxy(num_engines=2, max_request_bytes=8 << 20, max_context_tokens=400_000, max_new_tokens_cap=4096)
    yield p
    p.close()


@pytest.fixture
def dirs(tmp_path: Path) -> tuple[Path, Path]:
    home, work = tmp_path / "home", tmp_path / "work"
    home.mkdir()
    work.mkdir()
    return home, work


def call_records(msgs: list[wire.Message]) -> list[wire.CallRecord]:
    return [m for m in msgs if isinstance(m, wire.CallRecord)]


def assistant_turns(prompt_ids: list[int]) -> list[list[int]]:
    """The ids of each complete assistant turn in a prompt, from after ``<|im_start|>assistant\\n``
    through its ``<|im_end|>`` (the trailing generation prompt has none and is left out)."""
    head = generation_prompt(TOK)
    turns = []
    for i in range(len(prompt_ids) - len(head)):
        if prompt_ids[i : i + len(head)] == head:
            start = i + len(head)
            try:
                end = prompt_ids.index(TOK.im_end, start)
            except ValueError:
                continue
            turns.append(prompt_ids[start : end + 1])
    return turns


def drift(records: list[wire.CallRecord]) -> tuple[int, int]:
    """(echoed policy tokens, of which differ from the engine's originals).

    Every assistant turn in every prompt is an echo of some earlier output (the engine is the
    only author of assistant turns here), whether the proxy spliced the history or rendered it
    afresh: a turn that is not id-for-id one of the engine's outputs has drifted, all of it.
    """
    echoed = differ = 0
    outputs: set[tuple[int, ...]] = set()
    for r in records:
        for turn in assistant_turns(r.prompt_ids):
            echoed += len(turn)
            differ += 0 if tuple(turn) in outputs else len(turn)
        outputs.add(tuple(r.output_ids))
    return echoed, differ


def continues(later: wire.CallRecord, earlier: wire.CallRecord) -> bool:
    n = len(earlier.prompt_ids) + len(earlier.output_ids)
    return later.prompt_ids[:n] == earlier.prompt_ids + earlier.output_ids


def test_tool_loop_sub_agent_and_compaction_train_with_zero_drift(proxy, dirs):
    home, work = dirs
    script = CodingScript(work)
    for e in proxy.engines:
        e.policy = script
    out = run_claude(TASK, cwd=work, env=claude_env(home, proxy.url, mint_token(SECRET, "ex-cc"), **COMPACT_ENV))

    # The harness really ran the tools.
    assert out["is_error"] is False and out["result"].startswith("Done:")
    assert (work / "hello.txt").read_text() == "hello from gyre, edited\n"
    assert (work / "sub.txt").read_text() == "sub-agent was here\n"
    assert script.calls == {"main": 8, "sub-agent": 2, "summary": 1}

    records = call_records(proxy.recv_all())
    assert [r.call_index for r in records] == list(range(len(records)))
    assert {r.execution_id for r in records} == {"ex-cc"}
    assert all(r.finish_reason == "stop" for r in records)
    lineages = [r.lineage for r in records]
    assert lineages.count("main") == 8 and lineages.count("sub-agent") == 2 and lineages.count("main-summary") == 1
    sub = [r for r in records if r.lineage == "sub-agent"]
    assert sub[0].agent_id.startswith("a") and sub[0].agent_id == sub[1].agent_id
    assert all(r.agent_id == "" for r in records if r.lineage != "sub-agent")

    # No fork where the harness only re-serialised: each main call continues the previous one
    # exactly, except the new root Claude Code starts after the compaction summary.
    mains = [r for r in records if r.lineage == "main"]
    summary_at = lineages.index("main-summary")
    roots = [r for prev, r in zip(mains, mains[1:]) if not continues(r, prev)]
    assert roots == [records[summary_at + 1]]
    # Claude Code summarises the history the last main call was given (before its tool_use turn):
    # the summary shares that call's whole context, then branches where the assistant turn began.
    context = records[summary_at - 1].prompt_ids[: -len(generation_prompt(TOK))]
    assert records[summary_at].prompt_ids[: len(context)] == context
    assert continues(sub[1], sub[0])

    echoed, differ = drift(records)
    assert echoed > 500 and differ == 0, f"drift {differ}/{echoed}"

    tree = TokenTree("ex-cc")
    for r in records:
        assert tree.insert(r)
    # The main line before the compaction (its last tool_use turn is a leaf: the summary branched
    # off before it), the summary branch, the main line from the new root, the sub-agent.
    kinds = sorted(t.kind for t in tree.trajectories())
    assert kinds == ["main", "main", "main-summary", "sub-agent"]


def test_execution_from_a_custom_header_and_redirect_when_a_cell_drains(proxy, dirs):
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


def test_overloaded_529_is_retried_by_claude_code_until_a_cell_serves(proxy, dirs):
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
