"""The report's per-harness table: outcomes counted (a grader failure apart from a crash), rewards and
facts averaged, a torn last line of metrics.jsonl skipped."""

from __future__ import annotations

import json

from controller.execution_report import harness_table, outcome_of, read_executions


def test_table_joins_runs_and_their_facts(tmp_path):
    events = [
        {"kind": "execution", "id": "s0-g0-e0", "harness": "claude_code", "train": True, "outcome": "finished",
         "state": "graded", "reward": 1.0, "run_s": 10.0},
        {"kind": "execution", "id": "s0-g0-e1", "harness": "claude_code", "train": True, "outcome": "timed_out",
         "state": "grade_failed", "reward": None, "run_s": 30.0},
        {"kind": "execution", "id": "s0-g0-e2", "harness": "claude_code", "train": True, "outcome": "crashed",
         "state": "grade_failed", "reward": None, "run_s": 1.0},
        {"kind": "execution_facts", "execution_id": "s0-g0-e0", "num_calls": 7, "main_calls": 3, "tool_calls": 5,
         "num_sub_agents": 1, "summary_calls": 0, "prompt_tokens": 900, "output_tokens": 90},
    ]
    path = tmp_path / "metrics.jsonl"
    path.write_text("\n".join(json.dumps(e) for e in events) + '\n{"kind": "execu')
    runs = read_executions(path)
    assert [outcome_of(r) for r in runs] == ["finished", "grader_failure", "crashed"]
    table = harness_table(runs)
    row = [line for line in table.splitlines() if line.startswith("| claude_code (train)")][0]
    cells = [c.strip() for c in row.strip("|").split("|")]
    assert cells[1:6] == ["3", "1", "0", "1", "1"]  # runs, finished, timed_out, crashed, grader failure
    assert cells[6] == "1.000" and cells[8] == "7.0" and cells[10] == "5.0"  # reward of the graded; facts of e0


def test_missing_metrics_gives_an_empty_table(tmp_path):
    assert read_executions(tmp_path / "none.jsonl") == []
    assert harness_table([]).count("\n") == 1  # header and rule only
