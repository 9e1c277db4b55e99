"""The bundled pyfix task set: enough varied tasks, byte-identical on every generation, and provable:
on a sample, the gold patch resolves each task and the untouched workspace does not."""

from __future__ import annotations

import dataclasses
import json
import subprocess
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import yaml

from base.typed_config import build
from workloads.config import WorkloadConfig
from workloads.sandbox.none import NoSandbox
from workloads.tasksets import make_taskset, pyfix
from workloads.tasksets.swe import SweTaskSet, load_tasks
from workloads.validate import check_task


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("pyfix-data")
    pyfix.generate(path)
    return path


def _cfg(data_dir: Path, **changes) -> WorkloadConfig:
    raw = yaml.safe_load((Path(__file__).resolve().parents[2] / "conf/workload/pyfix.yaml").read_text())
    return dataclasses.replace(build(WorkloadConfig, raw), data_dir=str(data_dir), **changes)


def test_at_least_120_varied_tasks_that_load(data_dir: Path):
    tasks = load_tasks(pyfix.task_file(data_dir))
    rows = [json.loads(line) for line in pyfix.task_file(data_dir).read_text().splitlines()]
    assert len(tasks) >= 120 and len({t.task_id for t in tasks}) == len(tasks)
    modules = Counter(t.task_id.split("__")[1].rsplit("-", 1)[0] for t in tasks)
    kinds = Counter(r["bug_kind"] for r in rows)
    assert len(modules) >= 15 and max(modules.values()) <= 10
    assert {"off-by-one", "wrong comparison", "missing case", "wrong default", "swapped arguments"} <= set(kinds)
    for task in tasks:
        assert task.fail_to_pass and task.pass_to_pass and task.patch and task.test_patch
        added = [line[1:].strip() for line in task.patch.splitlines() if line.startswith("+") and line[1:].strip()]
        assert not [line for line in added[1:] if line in task.prompt]  # the symptom, never the fix
        assert task.repo == data_dir.resolve() / "pyfix" / "repos" / task.task_id


def test_generation_is_deterministic_and_idempotent(data_dir: Path, tmp_path: Path):
    pyfix.generate(tmp_path)
    assert (tmp_path / "pyfix/tasks.jsonl").read_bytes() == pyfix.task_file(data_dir).read_bytes()
    stamp_mtime = (tmp_path / "pyfix/STAMP").stat().st_mtime_ns
    pyfix.generate(tmp_path)  # current stamp: nothing rewritten
    assert (tmp_path / "pyfix/STAMP").stat().st_mtime_ns == stamp_mtime
    (tmp_path / "pyfix/STAMP").write_text("0")  # an older generator's set is replaced
    (tmp_path / "pyfix/tasks.jsonl").write_text("stale\n")
    pyfix.generate(tmp_path)
    assert (tmp_path / "pyfix/tasks.jsonl").read_bytes() == pyfix.task_file(data_dir).read_bytes()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["pyfix"]  # no temporary folders left


def test_repositories_are_valid_git_with_the_fix_only_in_the_future(data_dir: Path):
    task = load_tasks(pyfix.task_file(data_dir))[0]
    git = ["git", f"--git-dir={task.repo}"]
    subprocess.run(git + ["fsck", "--strict", "--no-dangling"], check=True, capture_output=True)
    log = subprocess.run(git + ["log", "--format=%H %s", "main"], check=True, capture_output=True, text=True)
    (fix_hash, fix_subject), (base_hash, _) = [line.split(" ", 1) for line in log.stdout.splitlines()]
    assert base_hash == task.base_commit and fix_subject.startswith("Fix ")


def test_make_taskset_generates_and_splits(data_dir: Path):
    taskset = make_taskset(_cfg(data_dir), NoSandbox())
    assert isinstance(taskset, SweTaskSet)
    train, held_out = taskset.split()
    assert (len(train), len(held_out)) == (132, 8)
    assert not {t.task_id for t in train} & {t.task_id for t in held_out}


def test_a_sample_validates_gold_resolves_untouched_does_not(data_dir: Path, tmp_path: Path):
    cfg = _cfg(data_dir, num_train_tasks=1000, num_eval_tasks=1)
    taskset = make_taskset(cfg, NoSandbox())
    train, held_out = taskset.split()
    tasks = sorted(train + held_out, key=lambda t: t.task_id)
    sample = tasks[:: len(tasks) // 10][:10]
    with ThreadPoolExecutor(2) as pool:
        checks = list(pool.map(lambda t: check_task(taskset, t, tmp_path), sample))
    assert [c.problems() for c in checks] == [[]] * len(sample)
    assert all(c.gold.reward == 1.0 and c.untouched.reward == 0.0 and c.split_ok for c in checks)
