"""The run report's run-length plot reads the controller's own execution events."""

from __future__ import annotations

import json
from pathlib import Path

from controller.report import plot_run_lengths, read_run_lengths


def test_run_lengths_per_step_from_execution_events(tmp_path: Path):
    events = [
        {"kind": "execution", "id": "s0-g0-e0", "train": True, "step": 0, "run_s": 2.0, "outcome": "finished"},
        {"kind": "execution", "id": "s0-g0-e1", "train": True, "step": 0, "run_s": 4.0, "outcome": "finished"},
        {"kind": "execution", "id": "s1-g0-e0", "train": True, "step": 1, "run_s": 10.0, "outcome": "timed_out"},
        {"kind": "execution", "id": "eval-0", "train": False, "step": 1, "run_s": 99.0,
         "outcome": "finished"},  # eval: not the workload
        {"kind": "progress", "t": 1.0},
    ]
    path = tmp_path / "metrics.jsonl"
    path.write_text("\n".join(json.dumps(e) for e in events) + "\n{torn")
    assert read_run_lengths(path) == {0: ([2.0, 4.0], 0), 1: ([10.0], 1)}
    plot_run_lengths(tmp_path)
    assert (tmp_path / "runs.png").stat().st_size > 0
    assert read_run_lengths(tmp_path / "missing.jsonl") == {}
