"""A run whose harness is not installed stops at start with one line naming the make target (exit 2),
instead of launching executions that all crash."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_missing_harness_binary_stops_the_run_at_start(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "controller.main", f"run.runs_dir={tmp_path}", "harness=claude_code",
         "harness.binary=/nonexistent/claude"],
        cwd=ROOT, capture_output=True, text=True, timeout=120,
    )
    assert proc.returncode == 2, proc.stderr[-2000:]
    lines = [line for line in proc.stderr.splitlines() if line.startswith("gyre:")]
    assert lines == ["gyre: harness=claude_code: /nonexistent/claude is not installed; run `make claude-code`"]
    assert not list(tmp_path.glob("*/logs/cell*.log"))  # no cell was started
