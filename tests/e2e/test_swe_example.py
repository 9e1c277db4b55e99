"""The example at the top of conf/workload/swe.yaml starts as written: a user's own SWE-style task
file with the default harness, sandbox and everything else (here the shipped pkgbugs rows, rows of
a real package graded by its own plain ``python -m pytest -q`` command)."""

from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path

import pytest

from tests.e2e import metrics, run_gyre_with
from workloads.tasksets import pkgbugs

pytestmark = pytest.mark.e2e


def test_workload_swe_with_a_task_file_starts_and_grades():
    base = Path(tempfile.mkdtemp(prefix="gyre-swe-", dir="/var/tmp"))
    try:
        task_file = pkgbugs.generate(base / "tasks")
        run_dir, _ = run_gyre_with(base / "runs", lambda *_: None, "workload=swe", f"workload.task_file={task_file}",
                                   f"workload.data_dir={base / 'data'}", "run.steps=1", "workload.num_eval_tasks=2",
                                   # smaller than the example's 4 x 16 runs of 100 turns, which take minutes here
                                   "workload.groups_per_step=2", "workload.group_size=4", "workload.min_usable_per_group=2",
                                   "workload.max_turns=4",
                                   timeout_s=300)
        assert json.loads((run_dir / "summary.json").read_text())["steps"] == 1
        events = metrics(run_dir, "execution")
        assert events and all(ev["state"] == "graded" for ev in events), events  # graded, none a grader failure
    finally:
        shutil.rmtree(base, ignore_errors=True)
