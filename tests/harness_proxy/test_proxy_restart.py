"""A proxy restarted in the middle of a run: its sessions come back from the processor's log.

The proxy keeps each execution's sessions (what it splices the next prompt onto, whose line each
call is on, the call count) in memory. A restarted one asks the processor for the execution's
logged CallRecords before it answers the execution's next call (``trajectory.session_replay``;
here the processor's side is the real ``SessionIndex`` over a real ``AppendLog``, behind the real
``RecordInbox``). The real harnesses run against it, the restart falls while a sub-agent works,
and the records and trees must equal those of the same script run without a restart.
"""

from __future__ import annotations

import asyncio
import shutil
import threading
from pathlib import Path

import numpy as np
import openai
import pytest

from base.execution_token import mint_token
from tests.harness_proxy import SECRET, LiveProxy, Step
from tests.harness_proxy.test_server import get_raw
from tests.harness_proxy.claude_code import CLAUDE_BIN, CodingScript, claude_env, run_claude
from tests.harness_proxy.qwen_code import QWEN_BIN, QwenCodingScript, qwen_env, run_qwen
from tests.harness_proxy.harness_suite import TASK as CLAUDE_TASK
from tests.harness_proxy.harness_suite import call_records, continues
from trajectory.tree import TokenTree

pytestmark = pytest.mark.e2e


def tree_signature(records) -> list[tuple[str, int, tuple[int, ...]]]:
    """Each trajectory's kind and the policy tokens it trains (prompts carry run-specific paths and
    dates; what the policy wrote does not)."""
    tree = TokenTree(records[0].execution_id)
    for r in records:
        tree.insert(r)
    return sorted((t.kind, t.num_policy_tokens,
                   tuple(np.concatenate([e.tokens[e.policy_mask().astype(bool)] for e in t.edges]).tolist()))
                  for t in tree.trajectories())


def line_signature(records) -> list[tuple]:
    """Per call (side calls left out: the harness runs them in the background, timing-dependent):
    its lineage, whether it has an agent id, and which earlier call of the list it continues."""
    kept = [r for r in records if r.lineage != "side"]
    out = []
    for i, r in enumerate(kept):
        base = max((j for j in range(i) if continues(r, kept[j])), default=-1)
        out.append((r.lineage, bool(r.agent_id), base, r.output_ids))
    return out


def fresh_dirs(root: Path) -> tuple[Path, Path]:
    home, work = root / "home", root / "work"
    for d in (home, work):
        shutil.rmtree(d, ignore_errors=True)
        d.mkdir()
    return home, work


class HoldOnce:
    """Wraps a script whose ``calls`` counts its answers by agent: the call that makes
    ``calls[who]`` reach 1 is held at the engine until ``release`` (on the test loop); ``held`` is
    set when it arrives."""

    def __init__(self, script, who: str) -> None:
        self.script, self.who = script, who
        self.held = threading.Event()
        self._until: asyncio.Event | None = None

    def __call__(self, input_ids: list[int]) -> Step:
        before = self.script.calls[self.who]
        step = self.script(input_ids)
        if self._until is None and before == 0 and self.script.calls[self.who] == 1:
            self._until = asyncio.Event()
            self.held.set()
            return Step(output_ids=step.output_ids, finish=step.finish, until=self._until)
        return step

    def release(self) -> None:
        assert self._until is not None
        self._until.set()


def run_restarted(proxy: LiveProxy, hold: HoldOnce, run) -> None:
    """``run()`` the harness on a thread; restart the proxy while the held call is at the engine."""
    out: dict = {}

    def go() -> None:
        try:
            out["result"] = run()
        except BaseException as exc:  # the test reads it
            out["error"] = exc

    t = threading.Thread(target=go)
    t.start()
    assert hold.held.wait(180), "the script never reached the call to restart at"
    proxy.restart(while_stopping=hold.release)
    t.join(300)
    assert not t.is_alive(), "the harness did not finish after the restart"
    if "error" in out:
        raise out["error"]
    stats = get_raw(proxy.url, "/stats")[1]
    assert stats["restored"]["executions"] == 1 and stats["restored"]["calls"] >= 2


# ---------------------------------------------------------------- the real harnesses


def run_qwen_code(work: Path, env_of) -> None:
    run_qwen("Create hello.txt, edit it, and have a sub-agent write sub.txt.", cwd=work, env=qwen_env(*env_of("ex-qwen")))


def run_claude_code(work: Path, env_of) -> None:
    run_claude(CLAUDE_TASK, cwd=work, env=claude_env(*env_of("ex-cc")))


HARNESSES = {
    # Qwen Code sends no agent header: the proxy derives every line, so a restart must bring them back.
    "qwen_code": (QWEN_BIN, "run `make qwen-code`", QwenCodingScript, run_qwen_code, ["main", "sub-agent"]),
    # Claude Code names its agents, and echoes the tool_use ids the proxy minted.
    "claude_code": (CLAUDE_BIN, "run `make claude-code`", CodingScript, run_claude_code, None),
}


@pytest.mark.parametrize("harness", sorted(HARNESSES))
def test_a_restart_mid_sub_agent_keeps_lineage_splices_and_the_tree(harness: str, tmp_path: Path):
    binary, install, make_script, run, kinds = HARNESSES[harness]
    assert binary.exists(), install
    trees, lines = [], []
    for restart in (False, True):
        home, work = fresh_dirs(tmp_path)  # the same paths for both runs: the script writes them in its calls
        script = make_script(work)
        proxy = LiveProxy(num_engines=1, max_request_bytes=8 << 20, max_context_tokens=400_000,
                          max_new_tokens_cap=4096)
        try:
            # The sub-agent's first call is held at the engine: the restart falls between its two calls.
            hold = HoldOnce(script, "sub-agent")
            proxy.engines[0].policy = hold if restart else script

            def go() -> None:
                run(work, lambda execution_id: (home, proxy.url, mint_token(SECRET, execution_id)))

            if restart:
                run_restarted(proxy, hold, go)
            else:
                go()
            assert (work / "sub.txt").read_text() == "sub-agent was here\n"
            records = call_records(proxy.recv_all(settle_ms=1000))
        finally:
            proxy.close()
        assert [r.call_index for r in records] == list(range(len(records)))  # no index restarts at 0
        trees.append(tree_signature(records))
        lines.append(line_signature(records))
    assert "sub-agent" in [k for k, _, _ in trees[0]]
    if kinds is not None:  # Qwen Code's script: one main line and one sub-agent, nothing else
        assert [k for k, _, _ in trees[0]] == kinds
    assert trees[1] == trees[0]
    assert lines[1] == lines[0]


# ---------------------------------------------------------------- the proxy's own bounds


def test_a_new_executions_first_call_waits_for_a_processor_that_is_away_and_goes_on_when_it_is_back():
    proxy = LiveProxy(record_resend_s=0.3)
    try:
        proxy.inbox.acking.clear()  # down: the replay request is lost, and asked again
        out: dict = {}
        t = threading.Thread(target=lambda: out.update(r=proxy.client("ex-new").chat.completions.create(
            model="m", messages=[{"role": "user", "content": "hi"}])))
        t.start()
        t.join(1.5)
        assert t.is_alive() and not out
        assert sum(len(e.requests) for e in proxy.engines) == 0  # no engine time before the log is read
        proxy.inbox.acking.set()
        t.join(10)
        assert out["r"].choices[0].message.content == "ok"
    finally:
        proxy.close()


def test_sessions_over_the_proxy_wide_cap_get_a_retriable_error_until_executions_end():
    proxy = LiveProxy(max_session_bytes=1)
    try:
        hi = [{"role": "user", "content": "hi"}]
        proxy.client("ex-1").chat.completions.create(model="m", messages=hi)  # nothing held before it
        with pytest.raises(openai.InternalServerError) as refused:
            proxy.client("ex-2").chat.completions.create(model="m", messages=hi)
        assert refused.value.status_code == 503 and "max_session_bytes" in str(refused.value)
        stats = get_raw(proxy.url, "/stats")[1]["session_memory"]
        assert stats["refused"] == 1 and stats["bytes"] > 1
        proxy.seal("ex-1")  # its sessions are dropped
        assert proxy.client("ex-2").chat.completions.create(model="m", messages=hi).choices[0].message.content == "ok"
    finally:
        proxy.close()
