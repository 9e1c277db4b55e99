"""Real harnesses in real runs: the experiments of conf/experiment/, short, with the pinned binaries
in bwrap sandboxes and the tiny model serving. The tiny random model fixes no bug, so these check the
path (calls recorded with lineage, trees built into shards, hidden tests run, grades and updates
applied), not the rewards; tests/e2e/test_pyfix_reward_path.py proves the reward itself."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from base import wire
from base.tokenizer import get_tokenizer
from tests.e2e import call_records, metrics, run_gyre_with
from workloads.sandbox.bwrap import bwrap_problem

IM_START = get_tokenizer("qwen_compact", 1024).specials["<|im_start|>"]
pytestmark = [pytest.mark.e2e, pytest.mark.skipif(bool(bwrap_problem("")) and os.environ.get("CI") != "true",
                                                  reason=f"bwrap: {bwrap_problem('')}")]  # in CI: fail


def idle(run_dir: Path, done, report) -> None:
    done.wait()


def check_run(run_dir: Path, harness: str, steps: int) -> list[dict]:
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["steps"] == steps and summary["grader_failures"] == 0
    runs = metrics(run_dir, "execution")
    assert runs and {r["harness"] for r in runs} == {harness}
    assert all(r["state"] == "graded" for r in runs), [(r["id"], r["error"]) for r in runs if r["state"] != "graded"]
    facts = {f["execution_id"]: f for f in metrics(run_dir, "execution_facts")}
    assert set(facts) == {r["id"] for r in runs}  # every execution's calls were counted
    assert all(f["num_calls"] >= 1 and f["main_calls"] >= 1 for f in facts.values())
    assert len(metrics(run_dir, "step")) == steps  # updates applied
    return runs


def test_pyfix_through_claude_code(tmp_path):
    run_dir, _ = run_gyre_with(tmp_path / "runs", idle, "+experiment=pyfix_claude_code", "run.steps=1",
                               "workload.num_eval_tasks=1", timeout_s=600)
    runs = check_run(run_dir, "claude_code", 1)
    for r in runs:  # the hidden tests ran: the grader saw per-test results, and the code is unfixed
        detail = json.loads((run_dir / "work" / r["id"] / "grade.json").read_text())["detail"]
        assert detail["failed"] and detail["passed"] and r["reward"] == 0.0
    records = call_records(run_dir)
    assert records and min(len(r.prompt_ids) for r in records) > 15_000  # Claude Code's real prompt, whole
    assert {r.lineage for r in records} <= {"main", "sub-agent", "main-summary", "sub-agent-summary", "side"}


def test_pyfix_through_mini_swe_agent(tmp_path):
    run_dir, _ = run_gyre_with(tmp_path / "runs", idle, "+experiment=pyfix_mini_swe_agent", "run.steps=1",
                               "workload.num_eval_tasks=1", timeout_s=600)
    check_run(run_dir, "mini_swe_agent", 1)
    by_execution: dict[str, list[wire.CallRecord]] = {}
    for r in call_records(run_dir):
        by_execution.setdefault(r.execution_id, []).append(r)
    for calls in by_execution.values():
        # Each call keeps the previous call's prompt id for id. The tiny model's turns are not valid
        # tool calls, and mini-swe-agent answers a format error without echoing the bad turn: a
        # branch after the prompt, not drift (zero drift on well-formed turns: tests/harness_proxy).
        calls.sort(key=lambda r: r.call_index)
        for earlier, later in zip(calls, calls[1:]):
            history = earlier.prompt_ids[: len(earlier.prompt_ids) - earlier.prompt_ids[::-1].index(IM_START) - 1]
            assert later.prompt_ids[: len(history)] == history  # all but the generation prompt


def test_wordmap_through_claude_code_trains(tmp_path):
    """+experiment=claude_code, two steps: every run is a real Claude Code process, graded from what it
    printed, and the steps' updates land (the learning itself is the experiment's, README figures)."""
    run_dir, _ = run_gyre_with(tmp_path / "runs", idle, "+experiment=claude_code", "run.steps=2",
                               "workload.num_eval_tasks=2", timeout_s=600)
    runs = check_run(run_dir, "claude_code", 2)
    assert all(r["outcome"] == "finished" for r in runs)
    out = (run_dir / "work" / runs[0]["id"] / "stdout.log").read_text()
    assert out.strip(), "claude -p printed no answer"


def test_a_harness_that_always_crashes_stops_the_run_with_the_reason(tmp_path):
    """Every group dropped, replacements too: the run stops (exit 1) naming why, instead of waiting forever."""
    from tests.e2e import start_gyre

    proc = start_gyre(tmp_path / "runs", "harness=command", "harness.argv=[/bin/false]", "sandbox=none", "run.steps=2",
                      "run.eval_at_start=false")
    out, _ = proc.communicate(timeout=300)
    assert proc.returncode == 1, out[-3000:]
    assert "every group was dropped" in out and "harness exit code 1" in out


def test_the_default_relative_runs_dir_runs_sandboxed(tmp_path):
    """`make run` keeps runs under the relative `runs/`: workspaces and the proxy's socket must reach
    the sandbox as absolute paths (a fresh clone found every harness failing to start here)."""
    import os
    import subprocess
    import sys

    from tests.e2e import ROOT, SMALL

    proc = subprocess.run(
        [sys.executable, "-m", "controller.main", "run.runs_dir=runs", "run.steps=1", "sandbox=bwrap", *SMALL],
        cwd=tmp_path, env={**os.environ, "PYTHONPATH": str(ROOT)}, capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    (run_dir,) = [p for p in (tmp_path / "runs").iterdir() if not p.is_symlink()]
    assert all(r["state"] == "graded" for r in metrics(run_dir, "execution"))
