"""mini-swe-agent, unmodified, through the proxy's OpenAI Chat Completions API (via its litellm).

The real ``mini`` CLI (pinned, installed by ``make mini-swe-agent`` into its own venv because it
pins its own openai/pydantic) runs a three-step bash task against the proxy; the engine doubles
answer with Qwen3 tool calls in ids that re-tokenising would not give back. The files are real,
and every call after the first continues the previous one id for id (zero drift, no fork).
"""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path

import pytest

from base import wire
from base.execution_token import mint_token
from tests.harness_proxy import SECRET, TOK, LiveProxy, Step
from tests.harness_proxy.claude_code import engine_ids, tool_call, tool_calls_in
from tests.harness_proxy.harness_suite import drift
from trajectory.tree import TokenTree

pytestmark = pytest.mark.e2e

PROJECT_ROOT = Path(__file__).resolve().parents[2]
MINI_VERSION = re.search(
    r"^MINI_SWE_AGENT_VERSION\s*:=\s*(\S+)", (PROJECT_ROOT / "Makefile").read_text(), flags=re.M
).group(1)  # type: ignore[union-attr]
MINI_BIN = PROJECT_ROOT / ".tools" / "mini-swe-agent" / "bin" / "mini"
STEPS = [
    tool_call("bash", {"command": "echo 'hello from mini' > hello.txt"}),
    "Check it." + tool_call("bash", {"command": "cat hello.txt"}),
    tool_call("bash", {"command": "echo COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT"}),
]


def script(input_ids: list[int]) -> Step:
    seen = tool_calls_in(TOK.decode(input_ids))
    done = sum(1 for step in STEPS if tool_calls_in(step)[0] in seen)
    return Step(output_ids=engine_ids(STEPS[min(done, len(STEPS) - 1)]))


def test_the_pinned_mini_swe_agent_is_installed():
    out = subprocess.run(
        [str(MINI_BIN.parent / "python"), "-c", "import importlib.metadata as m; print(m.version('mini-swe-agent'))"],
        capture_output=True, text=True, timeout=60,
    )
    assert out.stdout.strip() == MINI_VERSION, f"{MINI_BIN} missing or not {MINI_VERSION}: run `make mini-swe-agent`"


def run_mini(tmp_path: Path, policy, task: str, execution_id: str) -> tuple[Path, list[wire.CallRecord]]:
    """The ``mini`` CLI on ``task`` against a live proxy whose engine answers with ``policy``:
    (its workspace, the CallRecords)."""
    proxy = LiveProxy(num_engines=1, max_request_bytes=1 << 20, max_context_tokens=100_000, max_new_tokens_cap=1024)
    try:
        proxy.engines[0].policy = policy
        work, cfg = tmp_path / "work", tmp_path / "cfg"
        work.mkdir()
        cfg.mkdir()
        env = {
            "PATH": f"{MINI_BIN.parent}:/usr/bin:/bin", "HOME": str(tmp_path), "LANG": "C.UTF-8",
            "MSWEA_CONFIGURED": "true", "MSWEA_COST_TRACKING": "ignore_errors", "MSWEA_GLOBAL_CONFIG_DIR": str(cfg),
            "OPENAI_API_KEY": mint_token(SECRET, execution_id),
        }
        proc = subprocess.run(
            [str(MINI_BIN), "-y", "--exit-immediately", "-m", "openai/gyre-policy", "-t", task,
             "-c", "mini.yaml", "-c", f"model.model_kwargs.api_base={proxy.url}/v1", "-c", "agent.cost_limit=0",
             "-o", str(tmp_path / "traj.json")],
            cwd=work, env=env, capture_output=True, text=True, timeout=240, stdin=subprocess.DEVNULL,
        )
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
        return work, [m for m in proxy.recv_all() if isinstance(m, wire.CallRecord)]
    finally:
        proxy.close()


def test_mini_swe_agent_bash_loop_with_zero_drift(tmp_path: Path):
    work, records = run_mini(tmp_path, script, "write hello.txt", "ex-mini")
    assert (work / "hello.txt").read_text() == "hello from mini\n"
    assert len(records) == 3 and {r.execution_id for r in records} == {"ex-mini"}
    for earlier, later in zip(records, records[1:]):
        head = earlier.prompt_ids + earlier.output_ids
        assert later.prompt_ids[: len(head)] == head  # the engine's ids, spliced: no drift, no fork
    traj = json.loads((tmp_path / "traj.json").read_text())
    assert traj["info"]["exit_status"] in ("Submitted", "submitted")


LONG_STEPS = [
    "<think>\nStart with a file.\n</think>\n\n" + tool_call("bash", {"command": "printf 'a\\nb\\n' > notes.txt"}),
    tool_call("bash", {"command": "cat notes.txt"}),
    "Append one line." + tool_call("bash", {"command": "echo c >> notes.txt"}),
    tool_call("bash", {"command": "wc -l notes.txt"}),
    tool_call("bash", {"command": "sed -i 's/b/B/' notes.txt && cat notes.txt"}),
    tool_call("bash", {"command": "ls -la"}),
    tool_call("bash", {"command": "echo COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT"}),
]


def long_script(input_ids: list[int]) -> Step:
    seen = tool_calls_in(TOK.decode(input_ids))
    done = sum(1 for step in LONG_STEPS if tool_calls_in(step)[0] in seen)
    return Step(output_ids=engine_ids(LONG_STEPS[min(done, len(LONG_STEPS) - 1)]))


def test_mini_swe_agent_long_session_is_one_main_line_with_zero_drift(tmp_path: Path):
    """No agent header and no sub-agents: seven calls, all derived ``main``, each spliced onto the
    previous one; every echoed assistant turn is id for id the engine's output; one main trajectory."""
    work, records = run_mini(tmp_path, long_script, "keep notes.txt", "ex-mini-long")
    assert (work / "notes.txt").read_text() == "a\nB\nc\n"
    assert len(records) == len(LONG_STEPS)
    assert [(r.lineage, r.agent_id) for r in records] == [("main", "")] * len(LONG_STEPS)
    for earlier, later in zip(records, records[1:]):
        head = earlier.prompt_ids + earlier.output_ids
        assert later.prompt_ids[: len(head)] == head
    echoed, differ = drift(records)
    assert echoed > 100 and differ == 0, f"drift {differ}/{echoed}"
    tree = TokenTree("ex-mini-long")
    for r in records:
        assert tree.insert(r)
    assert [t.kind for t in tree.trajectories()] == ["main"]
