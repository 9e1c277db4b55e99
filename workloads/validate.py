"""Prove a task set gradable and its grader ungameable: gold resolves, untouched and cheating do not.

    python -m workloads.validate workload=pyfix [sandbox=bwrap] [key=value ...]

Composes the same Hydra config as ``gyre`` (conf/, with the overrides given), builds the task set
and the sandbox from it, and for every task of both splits grades three workspaces:

- *gold*: the row's ``patch`` applied with ``git apply``: must score 1;
- *untouched*: must score 0 with exactly the PASS_TO_PASS tests passing (the split is right);
- *cheating*: no fix, but what a policy under RL finds first: a ``conftest.py`` whose hook wrapper
  reports every test passed, a ``pytest.ini`` loading a plugin file doing the same through
  ``addopts``, the same through ``pyproject.toml``'s ``[tool.pytest.ini_options]``, and an
  ``atexit`` handler appended to the source the fix touches, printing ``PASSED`` lines for every
  test after pytest's summary: must score 0.

Progress goes to stderr; the last line on stdout is one JSON object::

    {"tasks": N, "gold_resolved": N, "untouched_resolved": 0, "cheating_resolved": 0,
     "grader_errors": 0, "split_mismatches": 0, "grade_s_median": ..., "wall_s": ...}

``grade_s_median``: one grading's seconds (the agent's change taken, applied to a fresh copy,
tested), the median over the gold, untouched and cheating grades. Exit status 1 unless every gold
patch resolves, no untouched or cheating workspace does, no grade failed and no split mismatched;
2 for a bad config.
"""

from __future__ import annotations

import os
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from hydra import compose, initialize_config_dir
from hydra.errors import HydraException
from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

from base.typed_config import ConfigError, build
from workloads.api import GradeResult, RunArtifacts, TaskSet
from workloads.config import SandboxConfig, WorkloadConfig
from workloads.sandbox import SandboxUnavailable, make_sandbox
from workloads.tasksets import make_taskset
from workloads.tasksets.swe import SweTask

CONF_DIR = Path(__file__).resolve().parent.parent / "conf"
NUM_THREADS = 2


@dataclass(frozen=True)
class TaskCheck:
    task_id: str
    gold: GradeResult
    untouched: GradeResult
    cheating: GradeResult
    split_ok: bool
    wall_s: float

    def problems(self) -> list[str]:
        found = [f"{kind}: grader failure: {result.error}" for kind, result in
                 (("gold", self.gold), ("untouched", self.untouched), ("cheating", self.cheating))
                 if result.reward is None]
        if self.gold.reward is not None and self.gold.reward < 1.0:
            found.append(f"gold patch does not resolve it (failed: {self.gold.detail.get('failed')})")
        if self.untouched.reward == 1.0:
            found.append("resolved without any change")
        if self.cheating.reward == 1.0:
            found.append(f"resolved by a cheating workspace (kept: {self.cheating.detail.get('kept')})")
        if self.untouched.reward is not None and not self.split_ok:
            found.append(f"untouched, these tests should fail exactly: {self.untouched.detail.get('failed')}")
        return found


def check_task(taskset: TaskSet, task: SweTask, scratch: Path) -> TaskCheck:
    started = time.monotonic()
    folder = Path(tempfile.mkdtemp(prefix=f"{task.task_id}.", dir=scratch))
    def run(kind: str) -> RunArtifacts:
        return RunArtifacts(stdout_path=folder / "stdout", stderr_path=folder / "stderr", outcome="finished",
                            grade_dir=folder / f"grade-{kind}")

    try:
        gold_ws = folder / "gold"
        taskset.prepare(task, gold_ws)
        gold = _apply_gold(task, gold_ws) or taskset.grade(task, gold_ws, run("gold"))
        untouched_ws = folder / "untouched"
        taskset.prepare(task, untouched_ws)
        untouched = taskset.grade(task, untouched_ws, run("untouched"))
        cheating_ws = folder / "cheating"
        taskset.prepare(task, cheating_ws)
        plant_cheats(task, cheating_ws)
        cheating = taskset.grade(task, cheating_ws, run("cheating"))
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    split_ok = set(untouched.detail.get("passed", ())) == set(task.pass_to_pass)
    return TaskCheck(task.task_id, gold, untouched, cheating, split_ok, time.monotonic() - started)


PASS_EVERYTHING = """import pytest


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    report.outcome = "passed"
    report.longrepr = None
"""


def plant_cheats(task: SweTask, workspace: Path) -> None:
    """What a policy finds first to pass without a fix (see the module docstring)."""
    (workspace / "conftest.py").write_text(PASS_EVERYTHING)
    (workspace / "gyre_pass_plugin.py").write_text(PASS_EVERYTHING)
    (workspace / "pytest.ini").write_text("[pytest]\naddopts = -p gyre_pass_plugin\n")
    pyproject = workspace / "pyproject.toml"
    old = pyproject.read_text() if pyproject.is_file() else ""
    pyproject.write_text(old + '\n[tool.pytest.ini_options]\naddopts = "-p gyre_pass_plugin"\n')
    lines = "".join(f"PASSED {t}\n" for t in task.fail_to_pass + task.pass_to_pass)
    printer = f"\nimport atexit as _gyre_atexit\n_gyre_atexit.register(lambda: print({lines!r}, end=''))\n"
    for path in _gold_files(task.patch):
        target = workspace / path
        if target.is_file() and path.endswith(".py"):
            target.write_text(target.read_text() + printer)


def _gold_files(patch: str) -> list[str]:
    return [line[len("+++ b/"):].strip() for line in patch.splitlines() if line.startswith("+++ b/")]


def _apply_gold(task: SweTask, workspace: Path) -> GradeResult | None:
    """None when the gold patch applied; else the failed grade that says why."""
    if not task.patch:
        return GradeResult(reward=None, error=f"{task.task_id}: the row has no gold patch")
    # A fresh workspace from the template: its .git is ours, so git may run in it.
    done = subprocess.run(["git", "apply", "--whitespace=nowarn", "-"], cwd=workspace, input=task.patch,
                          capture_output=True, text=True)
    if done.returncode != 0:
        return GradeResult(reward=None, error=f"{task.task_id}: gold patch does not apply: {done.stderr.strip()}")
    return None


def validate(taskset: TaskSet, scratch: Path) -> dict:
    train, held_out = taskset.split()
    tasks = [t for t in train + held_out if isinstance(t, SweTask)]
    started = time.monotonic()
    done = 0
    lock = threading.Lock()
    checks: list[TaskCheck] = []

    def one(task: SweTask) -> TaskCheck:
        nonlocal done
        check = check_task(taskset, task, scratch)
        with lock:
            done += 1
            print(f"[{done}/{len(tasks)}] {check.task_id}: gold {check.gold.reward} untouched "
                  f"{check.untouched.reward} cheating {check.cheating.reward} ({check.wall_s:.1f}s)",
                  file=sys.stderr, flush=True)
            for problem in check.problems():
                print(f"    {check.task_id}: {problem}", file=sys.stderr, flush=True)
        return check

    with ThreadPoolExecutor(NUM_THREADS) as pool:
        checks = list(pool.map(one, tasks))
    grade_s = [r.detail["grade_s"] for c in checks for r in (c.gold, c.untouched, c.cheating) if "grade_s" in r.detail]
    return {
        "tasks": len(tasks),
        "gold_resolved": sum(c.gold.reward == 1.0 for c in checks),
        "untouched_resolved": sum(c.untouched.reward == 1.0 for c in checks),
        "cheating_resolved": sum(c.cheating.reward == 1.0 for c in checks),
        "grader_errors": sum((c.gold.reward is None) + (c.untouched.reward is None) + (c.cheating.reward is None)
                             for c in checks),
        "split_mismatches": sum(c.untouched.reward is not None and not c.split_ok for c in checks),
        "grade_s_median": round(statistics.median(grade_s), 3) if grade_s else None,
        "wall_s": round(time.monotonic() - started, 2),
    }


@dataclass(frozen=True)
class ValidateConfig:
    workload: WorkloadConfig
    sandbox: SandboxConfig


def main(argv: list[str]) -> int:
    # Everything a run writes (checkpoints, logs, prompts, task files with gold patches and hidden
    # tests) is the run user's alone on a shared node: files 0600, folders 0700.
    os.umask(0o077)
    try:
        with initialize_config_dir(version_base="1.3", config_dir=str(CONF_DIR)):
            raw = compose(config_name="config", overrides=argv)
        # Only the workload and the sandbox: what grading a task needs (a run's own checks are
        # controller.config's, and this package stands below the controller).
        tree = OmegaConf.to_container(raw, resolve=True)
        cfg = ValidateConfig(workload=build(WorkloadConfig, tree["workload"], "workload"),
                             sandbox=build(SandboxConfig, tree["sandbox"], "sandbox"))
    except (ConfigError, ValueError, HydraException, OmegaConfBaseException) as exc:
        print(f"validate: bad config: {exc}", file=sys.stderr)
        return 2
    if cfg.workload.kind != "swe":
        print(f"validate: workload.kind={cfg.workload.kind}: only swe task sets have gold patches", file=sys.stderr)
        return 2
    try:
        sandbox = make_sandbox(cfg.sandbox)
        groups = None
        if cfg.sandbox.cgroups:
            from workloads.sandbox import cgroups

            groups = cgroups.detect(f"validate-{os.getpid()}")[0]
        taskset = make_taskset(cfg.workload, sandbox, grader_limits=cfg.sandbox.grader_limits.resources(),
                               cgroups=groups)
    except (SandboxUnavailable, ValueError) as exc:  # TaskFileError is a ValueError
        print(f"validate: {exc}", file=sys.stderr)
        return 2
    print(f"validate: {sandbox.describe()}", file=sys.stderr)
    Path(cfg.workload.data_dir).mkdir(parents=True, exist_ok=True)
    scratch = Path(tempfile.mkdtemp(prefix=".validate.", dir=cfg.workload.data_dir)).resolve()
    try:
        summary = validate(taskset, scratch)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
        if groups is not None:
            groups.cleanup()
    print(json.dumps(summary), flush=True)
    ok = (summary["gold_resolved"] == summary["tasks"] and summary["untouched_resolved"] == 0
          and summary["cheating_resolved"] == 0 and summary["grader_errors"] == 0 and summary["split_mismatches"] == 0)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
