"""The real pinned harness binaries, unmodified, headless, trained through the proxy: each shared
behaviour once, run against every harness of ``harness_suite.HARNESSES``.

Claude Code talks to the proxy's Anthropic Messages API (streaming SSE), Qwen Code to its OpenAI
API; the proxy talks to engine doubles on SGLang's native API that answer like a Qwen3 policy
(``claude_code.CodingScript``, ``qwen_code.QwenCodingScript``). The files the harness writes are
real, the CallRecords are the real ones the processor would get, and the execution's tree is built
by the real ``trajectory.tree``.

Drift: every assistant turn in every prompt must be, id for id, one of the engine's earlier
outputs (except the turns the harness writes itself), whether the proxy spliced the history or had
to render it afresh (the root after a compaction). The engine emits ids that re-tokenising their
text would not give back, so any re-rendering shows.
"""

from __future__ import annotations

import pytest

from base.execution_token import mint_token
from harness_proxy.template import generation_prompt
from tests.harness_proxy import SECRET, TOK
from tests.harness_proxy.harness_suite import (  # noqa: F401 (fixtures)
    HARNESSES, call_records, continues, dirs, drift, proxy,
)
from trajectory.tree import TokenTree

pytestmark = pytest.mark.e2e


@pytest.mark.parametrize("harness", sorted(HARNESSES))
def test_the_pinned_binary_is_installed(harness: str):
    h = HARNESSES[harness]
    assert h.installed_version() == h.version, f"{h.binary} missing or not {h.version}: run `make {h.make_target}`"


@pytest.mark.parametrize("harness", sorted(HARNESSES))
def test_tool_loop_and_sub_agent_session_trains_with_zero_drift(harness: str, proxy, dirs):  # noqa: F811
    h = HARNESSES[harness]
    home, work = dirs
    script = h.make_script(work)
    for e in proxy.engines:
        e.policy = script
    out = h.run(work, home, proxy.url, mint_token(SECRET, h.execution_id))

    # The harness really ran the tools.
    assert out["is_error"] is False and out["result"].startswith("Done:")
    assert (work / "hello.txt").read_text() == h.hello
    assert (work / "sub.txt").read_text() == "sub-agent was here\n"
    side = script.calls[h.background] if h.background else 0
    assert {k: n for k, n in script.calls.items() if k != h.background} == h.calls

    records = call_records(proxy.recv_all(settle_ms=h.settle_ms))
    assert [r.call_index for r in records] == list(range(len(records)))
    assert {r.execution_id for r in records} == {h.execution_id}
    lineages = [r.lineage for r in records]
    expected = {**h.lineages, "side": side}
    assert {k: lineages.count(k) for k in expected} == expected and len(records) == sum(expected.values())
    # Side calls left out: the harness runs them in the background, timing-dependent.
    assert all(r.finish_reason == "stop" for r in records if r.lineage != "side")
    sub = [r for r in records if r.lineage == "sub-agent"]
    sub_ids = {r.agent_id for r in sub}
    assert len(sub_ids) == 1 and sub_ids != {""} and all(i.startswith(h.agent_id_prefix) for i in sub_ids)
    assert all(r.agent_id == "" for r in records if r.lineage != "sub-agent")

    # No fork where the harness only re-serialised: each main call continues the previous one
    # exactly (the sub-agent's calls in between notwithstanding), except the new root Claude Code
    # starts after a compaction summary.
    mains = [r for r in records if r.lineage == "main"]
    roots = [r for prev, r in zip(mains, mains[1:]) if not continues(r, prev)]
    if h.compacts:
        summary_at = lineages.index("main-summary")
        assert roots == [records[summary_at + 1]]
        # Claude Code summarises the history the last main call was given (before its tool_use turn):
        # the summary shares that call's whole context, then branches where the assistant turn began.
        context = records[summary_at - 1].prompt_ids[: -len(generation_prompt(TOK))]
        assert records[summary_at].prompt_ids[: len(context)] == context
    else:
        assert roots == []
    assert continues(sub[1], sub[0])

    echoed, differ = drift(records, h.harness_turns)
    assert echoed > 500 and differ == 0, f"drift {differ}/{echoed}"

    tree = TokenTree(h.execution_id)
    for r in records:
        assert tree.insert(r) == (r.lineage != "side")
    assert sorted(t.kind for t in tree.trajectories()) == h.trajectories
    assert tree.num_side_calls == side
