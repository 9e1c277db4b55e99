"""Per-execution facts for the report: what each harness run did and how it ended.

Joins metrics.jsonl's ``execution`` events (the controller's: harness, outcome, wall time, reward)
with its ``execution_facts`` (the processor's count of the run's CallRecords: calls by lineage,
tokens, tool calls, sub-agents, compactions) by execution id, and renders a table per harness and
per outcome. Reads only the run folder.
"""

from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path
from typing import Any

OUTCOMES = ("finished", "timed_out", "crashed", "grader_failure")
FACT_COLUMNS = ("num_calls", "main_calls", "tool_calls", "num_sub_agents", "summary_calls", "prompt_tokens",
                "output_tokens")


def read_executions(metrics_path: Path) -> list[dict[str, Any]]:
    """One dict per ended execution: its ``execution`` event merged with its facts (when they came)."""
    runs: dict[str, dict[str, Any]] = {}
    facts: dict[str, dict[str, Any]] = {}
    try:
        lines = metrics_path.read_text().splitlines()
    except OSError:
        return []
    for line in lines:
        try:
            event = json.loads(line)
        except ValueError:  # a line being written when the run was cut
            continue
        if event.get("kind") == "execution":
            runs[event["id"]] = event
        elif event.get("kind") == "execution_facts":
            facts[event["execution_id"]] = event
    return [{**run, **{k: v for k, v in facts.get(eid, {}).items() if k in FACT_COLUMNS}} for eid, run in runs.items()]


def outcome_of(run: dict[str, Any]) -> str:
    """finished / timed_out / crashed, or grader_failure when a run that ended was not graded."""
    if run.get("outcome") != "crashed" and run.get("state") == "grade_failed":
        return "grader_failure"
    return str(run.get("outcome"))


def harness_table(runs: list[dict[str, Any]]) -> str:
    """Markdown: one row per (harness, train/eval), outcomes counted, rewards and facts averaged."""
    groups: dict[tuple[str, str], list[dict[str, Any]]] = defaultdict(list)
    for run in runs:
        groups[(str(run.get("harness")), "train" if run.get("train") else "eval")].append(run)
    head = ("| harness | runs | " + " | ".join(OUTCOMES) + " | mean reward | mean wall s | "
            + " | ".join(f"mean {c}" for c in FACT_COLUMNS) + " |")
    rule = "|" + " --- |" * (head.count("|") - 1)
    rows = [head, rule]
    for (harness, split), members in sorted(groups.items()):
        counts = {o: sum(1 for r in members if outcome_of(r) == o) for o in OUTCOMES}
        rewards = [r["reward"] for r in members if r.get("reward") is not None]
        cells = [f"{harness} ({split})", str(len(members)), *(str(counts[o]) for o in OUTCOMES),
                 _mean(rewards, 3), _mean([r.get("run_s") for r in members], 1)]
        cells += [_mean([r.get(c) for r in members], 1) for c in FACT_COLUMNS]
        rows.append("| " + " | ".join(cells) + " |")
    return "\n".join(rows)


def _mean(values: list[Any], digits: int) -> str:
    nums = [v for v in values if isinstance(v, (int, float))]
    return f"{sum(nums) / len(nums):.{digits}f}" if nums else "-"
