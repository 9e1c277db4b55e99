"""The real Qwen Code CLI, unmodified, one-shot, trained through the proxy's OpenAI API.

Qwen Code sends no header that says which agent is calling, so the proxy derives each call's
line (``harness_proxy.sessions``): the main agent, a foreground sub-agent it hands a task to, and
the background memory extraction (a side call). The engine doubles answer in ids that
re-tokenising would not give back, so any echoed turn rebuilt from text shows up as drift. The
files the harness writes are real; the execution's tree is built by the real ``trajectory.tree``.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from base.execution_token import mint_token
from tests.harness_proxy import SECRET, TOK, LiveProxy
from tests.harness_proxy.qwen_code import (
    QWEN_BIN, QWEN_CODE_VERSION, QwenCodingScript, qwen_env, qwen_version, run_qwen,
)
from tests.harness_proxy.test_claude_code import assistant_turns, call_records, continues
from trajectory.tree import TokenTree

pytestmark = pytest.mark.e2e

HARNESS_TURNS = ("Got it. Thanks for the context!<|im_end|>", "Got it. Thanks for the additional context!<|im_end|>")
"""Assistant turns Qwen Code writes itself (after its environment preamble and after a compression)."""


def test_the_pinned_qwen_code_is_installed():
    assert qwen_version() == QWEN_CODE_VERSION, f"{QWEN_BIN} missing or not {QWEN_CODE_VERSION}: run `make qwen-code`"


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


def policy_drift(records) -> tuple[int, int]:
    """(echoed policy ids, of which differ from the engine's originals): every assistant turn in
    every prompt, except the ones Qwen Code writes itself, must be id for id an earlier output."""
    echoed = differ = 0
    outputs: set[tuple[int, ...]] = set()
    for r in records:
        for turn in assistant_turns(r.prompt_ids):
            if TOK.decode(turn) in HARNESS_TURNS:
                continue
            echoed += len(turn)
            differ += 0 if tuple(turn) in outputs else len(turn)
        outputs.add(tuple(r.output_ids))
    return echoed, differ


def test_foreground_sub_agent_session_with_zero_drift_and_one_main_trajectory(proxy, dirs):
    home, work = dirs
    script = QwenCodingScript(work)
    for e in proxy.engines:
        e.policy = script
    out = run_qwen("Create hello.txt, edit it, and have a sub-agent write sub.txt.", cwd=work,
                   env=qwen_env(home, proxy.url, mint_token(SECRET, "ex-qwen")))

    assert out["is_error"] is False and out["result"].startswith("Done:")
    assert (work / "hello.txt").read_text() == "hello from qwen, edited\n"
    assert (work / "sub.txt").read_text() == "sub-agent was here\n"
    assert script.calls["main"] == 5 and script.calls["sub-agent"] == 2 and script.calls["other"] == 0

    records = call_records(proxy.recv_all(settle_ms=1000))
    assert [r.call_index for r in records] == list(range(len(records)))
    by_kind = {k: [r for r in records if r.lineage == k] for k in ("main", "sub-agent", "side")}
    assert len(by_kind["main"]) == 5 and len(by_kind["sub-agent"]) == 2
    assert len(by_kind["side"]) == script.calls["memory"]  # the background extraction, if it ran before exit
    assert len(records) == 7 + script.calls["memory"]
    assert all(r.agent_id == "" for r in by_kind["main"] + by_kind["side"])
    sub_ids = {r.agent_id for r in by_kind["sub-agent"]}
    assert len(sub_ids) == 1 and sub_ids != {""}

    # One main line, spliced call after call, the sub-agent's calls in between notwithstanding.
    mains = by_kind["main"]
    assert all(continues(b, a) for a, b in zip(mains, mains[1:]))
    assert continues(by_kind["sub-agent"][1], by_kind["sub-agent"][0])
    echoed, differ = policy_drift(records)
    assert echoed > 500 and differ == 0, f"drift {differ}/{echoed}"

    tree = TokenTree("ex-qwen")
    for r in records:
        tree.insert(r)
    kinds = sorted(t.kind for t in tree.trajectories())
    assert kinds == ["main", "sub-agent"]
    assert tree.num_side_calls == script.calls["memory"]


def test_background_memory_extraction_is_a_side_call(proxy, dirs):
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
