"""The real Qwen Code CLI, unmodified, one-shot, trained through the proxy's OpenAI API.

Qwen Code sends no header that says which agent is calling, so the proxy derives each call's
line (``harness_proxy.sessions``): the main agent, a foreground sub-agent it hands a task to, and
the background memory extraction (a side call). The engine doubles answer in ids that
re-tokenising would not give back, so any echoed turn rebuilt from text shows up as drift. The
files the harness writes are real; the execution's tree is built by the real ``trajectory.tree``.

What Qwen Code shares with the other harnesses (the pinned binary is installed; the foreground
sub-agent session trains with zero drift and one main trajectory) is in ``test_harnesses.py``;
here is what only Qwen Code does.
"""

from __future__ import annotations

import pytest

from base.execution_token import mint_token
from tests.harness_proxy import SECRET
from tests.harness_proxy.harness_suite import call_records, dirs, proxy  # noqa: F401 (fixtures)
from tests.harness_proxy.qwen_code import QwenCodingScript, qwen_env, run_qwen
from trajectory.tree import TokenTree

pytestmark = pytest.mark.e2e


def test_background_memory_extraction_is_a_side_call(proxy, dirs):  # noqa: F811
    """Answered without tools, Qwen Code runs its managed memory extraction after the turn: the
    main conversation under another system prompt plus an instruction. It is ``side``, not a
    second main trajectory."""
    home, work = dirs
    script = QwenCodingScript(work)
    script.main_steps = ["Hello! Nothing to change here."]
    for e in proxy.engines:
        e.policy = script
    out = run_qwen("Say hello.", cwd=work, env=qwen_env(home, proxy.url, mint_token(SECRET, "ex-qwen-mem")))
    assert out["is_error"] is False and out["result"].startswith("Hello!")
    records = call_records(proxy.recv_all(settle_ms=1000))
    assert script.calls["memory"] >= 1, "no memory extraction call was made"
    assert [r.lineage for r in records] == ["main"] + ["side"] * script.calls["memory"]
    tree = TokenTree("ex-qwen-mem")
    for r in records:
        tree.insert(r)
    assert [t.kind for t in tree.trajectories()] == ["main"] and tree.num_side_calls == script.calls["memory"]
