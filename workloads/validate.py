"""Prove a task set gradable: every task's gold patch resolves it, and its untouched workspace does not.

    python -m workloads.validate workload=pyfix [sandbox=none] [key=value ...]

Composes the same Hydra config as ``gyre`` (conf/, with the overrides given), builds the task set
and the sandbox from it, and for every task of both splits: prepares a workspace, applies the
row's gold ``patch`` with ``git apply`` and grades it; prepares another and grades it untouched,
checking also that exactly the PASS_TO_PASS tests pass there (the split is right). Progress goes to
stderr; the last line on stdout is one JSON object::

    {"tasks": N, "gold_resolved": N, "untouched_resolved": 0, "grader_errors": 0,
     "split_mismatches": 0, "wall_s": ...}

Exit status 1 unless every gold patch resolves, no untouched workspace does, no grade failed and
no split mismatched; 2 for a bad config.
"""

from __future__ import annotations

import json
import shutil
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

from controller.config import build_config
from controller.typed_config import ConfigError
from workloads.api import GradeResult, RunArtifacts, TaskSet
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
    split_ok: bool
    wall_s: float

    def problems(self) -> list[str]:
        found = [f"{kind}: grader failure: {result.error}" for kind, result in
                 (("gold", self.gold), ("untouched", self.untouched)) if result.reward is None]
        if self.gold.reward is not None and self.gold.reward < 1.0:
            found.append(f"gold patch does not resolve it (failed: {self.gold.detail.get('failed')})")
        if self.untouched.reward == 1.0:
            found.append("resolved without any change")
        if self.untouched.reward is not None and not self.split_ok:
            found.append(f"untouched, these tests should fail exactly: {self.untouched.detail.get('failed')}")
        return found


def check_task(taskset: TaskSet, task: SweTask, scratch: Path) -> TaskCheck:
    started = time.monotonic()
    folder = Path(tempfile.mkdtemp(prefix=f"{task.task_id}.", dir=scratch))
    run = RunArtifacts(stdout_path=folder / "stdout", stderr_path=folder / "stderr", outcome="finished")
    try:
        gold_ws = folder / "gold"
        taskset.prepare(task, gold_ws)
        gold = _apply_gold(task, gold_ws) or taskset.grade(task, gold_ws, run)
        untouched_ws = folder / "untouched"
        taskset.prepare(task, untouched_ws)
        untouched = taskset.grade(task, untouched_ws, run)
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    split_ok = set(untouched.detail.get("passed", ())) == set(task.pass_to_pass)
    return TaskCheck(task.task_id, gold, untouched, split_ok, time.monotonic() - started)


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
                  f"{check.untouched.reward} ({check.wall_s:.1f}s)", file=sys.stderr, flush=True)
            for problem in check.problems():
                print(f"    {check.task_id}: {problem}", file=sys.stderr, flush=True)
        return check

    with ThreadPoolExecutor(NUM_THREADS) as pool:
        checks = list(pool.map(one, tasks))
    return {
        "tasks": len(tasks),
        "gold_resolved": sum(c.gold.reward == 1.0 for c in checks),
        "untouched_resolved": sum(c.untouched.reward == 1.0 for c in checks),
        "grader_errors": sum((c.gold.reward is None) + (c.untouched.reward is None) for c in checks),
        "split_mismatches": sum(c.untouched.reward is not None and not c.split_ok for c in checks),
        "wall_s": round(time.monotonic() - started, 2),
    }


def main(argv: list[str]) -> int:
    try:
        with initialize_config_dir(version_base="1.3", config_dir=str(CONF_DIR)):
            raw = compose(config_name="config", overrides=argv)
        cfg = build_config(OmegaConf.to_container(raw, resolve=True))
    except (ConfigError, ValueError, HydraException, OmegaConfBaseException) as exc:
        print(f"validate: bad config: {exc}", file=sys.stderr)
        return 2
    if cfg.workload.kind != "swe":
        print(f"validate: workload.kind={cfg.workload.kind}: only swe task sets have gold patches", file=sys.stderr)
        return 2
    try:
        sandbox = make_sandbox(cfg.sandbox)
        taskset = make_taskset(cfg.workload, sandbox)
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
    print(json.dumps(summary), flush=True)
    ok = (summary["gold_resolved"] == summary["tasks"] and summary["untouched_resolved"] == 0
          and summary["grader_errors"] == 0 and summary["split_mismatches"] == 0)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
