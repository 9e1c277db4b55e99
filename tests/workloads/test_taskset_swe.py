"""SWE-style task sets: the row loader, the seeded split, and workspaces that are copies at base_commit."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import tarfile
import threading
from pathlib import Path

import pytest
import yaml

from base.typed_config import build
from workloads.api import RunArtifacts
from workloads.config import WorkloadConfig
from workloads.sandbox.none import NoSandbox
from workloads.tasksets.swe import SweTask, SweTaskSet, TaskFileError, default_test_cmd, load_tasks

GIT_ENV = {**os.environ, "GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@t", "GIT_COMMITTER_NAME": "t",
           "GIT_COMMITTER_EMAIL": "t@t", "GIT_CONFIG_GLOBAL": os.devnull, "GIT_CONFIG_NOSYSTEM": "1"}
TEST_PATCH = ("diff --git a/tests/test_calc.py b/tests/test_calc.py\n--- /dev/null\n+++ b/tests/test_calc.py\n"
              "@@ -0,0 +1,5 @@\n+from calc import sub\n+\n+\n+def test_sub():\n+    assert sub(5, 3) == 2\n")


def _git(cwd: Path, *args: str) -> str:
    return subprocess.run(["git", *args], cwd=cwd, env=GIT_ENV, check=True, capture_output=True, text=True).stdout.strip()


@pytest.fixture
def repo(tmp_path: Path) -> tuple[Path, str, str]:
    """A repository whose second commit (the future) fixes the first: (path, base, future)."""
    path = tmp_path / "tasks" / "calc"
    path.mkdir(parents=True)
    _git(path, "init", "-q")
    (path / "calc.py").write_text("def sub(a, b):\n    return a + b\n")
    (path / ".gitattributes").write_text("calc.py export-ignore\n")  # archive would drop it; a checkout must not
    _git(path, "add", "-A")
    _git(path, "commit", "-q", "-m", "first")
    base = _git(path, "rev-parse", "HEAD")
    (path / "calc.py").write_text("def sub(a, b):\n    return a - b\n")
    (path / "SECRET_FIX.md").write_text("the answer\n")
    _git(path, "add", "-A")
    _git(path, "commit", "-q", "-m", "fix sub")
    return path, base, _git(path, "rev-parse", "HEAD")


def _row(**changes) -> dict:
    row = {"instance_id": "calc-1", "problem_statement": "sub(5, 3) gives 8", "repo": "calc", "base_commit": "abc",
           "FAIL_TO_PASS": ["tests/test_calc.py::test_sub"], "PASS_TO_PASS": [], "test_patch": TEST_PATCH}
    return {**row, **changes}


def _write_rows(path: Path, rows: list[dict | str]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


def _cfg(task_file: Path, data_dir: Path, **changes) -> WorkloadConfig:
    raw = yaml.safe_load((Path(__file__).resolve().parents[2] / "conf/workload/swe.yaml").read_text())
    raw.update(task_file=str(task_file), data_dir=str(data_dir), grader_timeout_s=60.0)
    return dataclasses.replace(build(WorkloadConfig, raw), **changes)


def test_good_rows_load_with_swe_bench_string_lists_and_extra_keys(repo, tmp_path: Path):
    path, base, _ = repo
    swe_bench = _row(instance_id="calc-2", base_commit=base, FAIL_TO_PASS=json.dumps(["tests/test_calc.py::test_sub"]),
                     PASS_TO_PASS="[]", version="1.0", created_at="2023-01-01", hints_text="", patch="gold",
                     environment_setup_commit=base, timeout_s=30, test_cmd="make test PYTEST=pytest", setup_cmd="true")
    task_file = _write_rows(tmp_path / "tasks" / "tasks.jsonl", [_row(base_commit=base), "", swe_bench])
    first, second = load_tasks(task_file)
    assert first.task_id == "calc-1" and first.prompt == "sub(5, 3) gives 8" and first.repo == path
    assert first.test_cmd == "python -m pytest -q tests/test_calc.py"
    assert first.timeout_s is None and first.patch == "" and first.pass_to_pass == ()
    assert second.fail_to_pass == ("tests/test_calc.py::test_sub",) and second.pass_to_pass == ()
    assert (second.timeout_s, second.test_cmd, second.setup_cmd, second.patch) == (
        30.0, "make test PYTEST=pytest", "true", "gold")


@pytest.mark.parametrize("change, field, what", [
    ({"instance_id": None}, "instance_id", "missing"),
    ({"problem_statement": 7}, "problem_statement", "want a string"),
    ({"base_commit": " "}, "base_commit", "empty"),
    ({"repo": "nowhere"}, "repo", "not a local git repository or tarball"),
    ({"FAIL_TO_PASS": "not json"}, "FAIL_TO_PASS", "JSON list"),
    ({"FAIL_TO_PASS": []}, "FAIL_TO_PASS", "at least one test id"),
    ({"FAIL_TO_PASS": "[1, 2]"}, "FAIL_TO_PASS", "want a list of non-empty test id strings"),
    ({"PASS_TO_PASS": {"a": 1}}, "PASS_TO_PASS", "want a list"),
    ({"timeout_s": -1}, "timeout_s", "want a number of seconds > 0"),
    ({"timeout_s": "10"}, "timeout_s", "want a number of seconds > 0"),
    ({"test_patch": "--- a/../x\n+++ b/../x\n@@ -1 +1 @@\n-a\n+b\n"}, "test_patch", "leaves the tree"),
    # Rows the grader could never grade are refused at load, not at every execution's grading:
    ({"FAIL_TO_PASS": ["test_sub (calc.tests.CalcTests)"]}, "FAIL_TO_PASS", "is not a pytest node id"),
    ({"PASS_TO_PASS": ["tests/test_calc.py"]}, "PASS_TO_PASS", "is not a pytest node id"),
    ({"test_cmd": "./tests/runtests.py --verbosity 2"}, "test_cmd", "does not run pytest"),
    ({"environment": "no/such/venv"}, "environment", "want a folder with bin/python"),
    ({"setup_network": "yes"}, "setup_network", "want true or false"),
])
def test_a_bad_field_names_its_line_and_field(repo, tmp_path: Path, change: dict, field: str, what: str):
    row = {k: v for k, v in _row(**change).items() if v is not None}
    task_file = _write_rows(tmp_path / "tasks" / "t.jsonl", [_row(instance_id="ok"), "", row])
    with pytest.raises(TaskFileError) as info:
        load_tasks(task_file)
    assert str(info.value).startswith(f"{task_file}:3: {field}: ") and what in str(info.value)


@pytest.mark.parametrize("line, what", [("{not json", "row: not valid JSON"), ("[1, 2]", "row: want a JSON object")])
def test_a_row_that_is_not_an_object_names_its_line(repo, tmp_path: Path, line: str, what: str):
    task_file = _write_rows(tmp_path / "tasks" / "t.jsonl", [_row(), line])
    with pytest.raises(TaskFileError, match=f"^{task_file}:2: {what}"):
        load_tasks(task_file)


def test_a_repeated_instance_id_is_refused(repo, tmp_path: Path):
    task_file = _write_rows(tmp_path / "tasks" / "t.jsonl", [_row(), _row()])
    with pytest.raises(TaskFileError, match=r":2: instance_id: 'calc-1' repeats line 1"):
        load_tasks(task_file)


def test_default_test_cmd_runs_the_files_of_the_test_ids():
    assert default_test_cmd(("b.py::t", "a b.py::t[x]", "b.py::u")) == "python -m pytest -q 'a b.py' b.py"
    assert default_test_cmd(("test_foo (mod.Class)",)) == "python -m pytest -q"


def test_workspace_is_a_copy_at_base_commit_without_future_history(repo, tmp_path: Path):
    path, base, future = repo
    task_file = _write_rows(tmp_path / "tasks" / "tasks.jsonl", [_row(base_commit=base)])
    taskset = SweTaskSet(_cfg(task_file, tmp_path / "data", num_eval_tasks=0), NoSandbox())
    (task,) = taskset.split()[0]
    ws = tmp_path / "ws"
    taskset.prepare(task, ws)
    assert (ws / "calc.py").read_text() == "def sub(a, b):\n    return a + b\n"
    assert not (ws / "SECRET_FIX.md").exists() and not (ws / "tests").exists()  # no future, no hidden tests
    assert _git(ws, "log", "--all", "--format=%s").splitlines() == ["base"]
    assert subprocess.run(["git", "cat-file", "-e", future], cwd=ws, capture_output=True).returncode != 0
    assert _git(ws, "status", "--porcelain") == ""
    (ws / "calc.py").write_text("def sub(a, b):\n    return a - b\n")
    assert "return a - b" in _git(ws, "diff")  # the agent can see its own change
    assert _git(path, "rev-parse", "HEAD") == future and _git(path, "status", "--porcelain") == ""
    again = tmp_path / "ws2"
    taskset.prepare(task, again)  # the template is untouched by a workspace's edits
    assert (again / "calc.py").read_text() == "def sub(a, b):\n    return a + b\n"
    run = RunArtifacts(stdout_path=tmp_path / "o", stderr_path=tmp_path / "e", outcome="finished",
                       grade_dir=tmp_path / "grade")
    assert taskset.grade(task, ws, run).reward == 1.0 and taskset.grade(task, again, run).reward == 0.0


@pytest.mark.parametrize("with_history", [False, True])
def test_a_tarball_repo_is_extracted_as_the_base(repo, tmp_path: Path, with_history: bool):
    path, base, _ = repo
    if not with_history:
        _git(path, "checkout", "-q", base)
        (path / ".git").rename(tmp_path / "git-aside")
    tarball = tmp_path / "tasks" / "calc.tar.gz"
    with tarfile.open(tarball, "w:gz") as archive:
        archive.add(path, arcname="calc-src")
    task_file = _write_rows(tmp_path / "tasks" / "tasks.jsonl", [_row(repo="calc.tar.gz", base_commit=base)])
    taskset = SweTaskSet(_cfg(task_file, tmp_path / "data", num_eval_tasks=0), NoSandbox())
    (task,) = taskset.split()[0]
    ws = tmp_path / "ws"
    taskset.prepare(task, ws)
    assert (ws / "calc.py").read_text() == "def sub(a, b):\n    return a + b\n" and not (ws / "SECRET_FIX.md").exists()
    assert _git(ws, "log", "--all", "--format=%s").splitlines() == ["base"]


def test_threads_preparing_one_task_build_one_template(repo, tmp_path: Path):
    _, base, _ = repo
    task_file = _write_rows(tmp_path / "tasks" / "tasks.jsonl", [_row(base_commit=base, setup_cmd="echo x >> built")])
    taskset = SweTaskSet(_cfg(task_file, tmp_path / "data", num_eval_tasks=0), NoSandbox())
    (task,) = taskset.split()[0]
    errors: list[BaseException] = []

    def prepare(k: int) -> None:
        try:
            taskset.prepare(task, tmp_path / f"ws{k}")
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=prepare, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    assert [p.name.startswith("calc-1-") for p in (tmp_path / "data" / "workspaces").iterdir()] == [True]
    assert all((tmp_path / f"ws{k}" / "built").read_text() == "x\n" for k in range(4))  # setup_cmd ran once


def test_a_bad_base_commit_fails_prepare_clearly(repo, tmp_path: Path):
    task_file = _write_rows(tmp_path / "tasks" / "tasks.jsonl", [_row(base_commit="0" * 40)])
    taskset = SweTaskSet(_cfg(task_file, tmp_path / "data", num_eval_tasks=0), NoSandbox())
    with pytest.raises(RuntimeError, match="git read-tree 0000"):
        taskset.prepare(taskset.split()[0][0], tmp_path / "ws")
    assert list((tmp_path / "data" / "workspaces").iterdir()) == []  # no half-built template left


def test_split_holds_out_a_seeded_eval_set_or_the_eval_file(repo, tmp_path: Path):
    rows = [_row(instance_id=f"t{k}") for k in range(10)]
    task_file = _write_rows(tmp_path / "tasks" / "tasks.jsonl", rows)

    def ids(cfg: WorkloadConfig) -> tuple[list[str], list[str]]:
        train, held_out = SweTaskSet(cfg, NoSandbox()).split()
        return [t.task_id for t in train], [t.task_id for t in held_out]

    train, held_out = ids(_cfg(task_file, tmp_path, num_eval_tasks=3))
    assert len(held_out) == 3 and sorted(train + held_out, key=lambda s: int(s[1:])) == [f"t{k}" for k in range(10)]
    assert ids(_cfg(task_file, tmp_path, num_eval_tasks=3)) == (train, held_out)
    assert ids(_cfg(task_file, tmp_path, num_eval_tasks=3, task_seed=7)) != (train, held_out)
    assert ids(_cfg(task_file, tmp_path, num_eval_tasks=3, num_train_tasks=2))[0] == train[:2]
    eval_file = _write_rows(tmp_path / "tasks" / "eval.jsonl", [_row(instance_id="e1")])
    assert ids(_cfg(task_file, tmp_path, eval_task_file=str(eval_file))) == ([f"t{k}" for k in range(10)], ["e1"])
    overlap = _write_rows(tmp_path / "tasks" / "overlap.jsonl", [_row(instance_id="t3")])
    with pytest.raises(TaskFileError, match="also in task_file: t3"):
        SweTaskSet(_cfg(task_file, tmp_path, eval_task_file=str(overlap)), NoSandbox())


def test_swe_task_is_a_frozen_task():
    task = SweTask(instance_id="i", problem_statement="p", repo=Path("/r"), base_commit="c", fail_to_pass=("a.py::t",),
                   pass_to_pass=(), test_cmd="t", test_patch="", setup_cmd="", timeout_s=None, patch="")
    with pytest.raises(dataclasses.FrozenInstanceError):
        task.instance_id = "j"  # type: ignore[misc]
    assert (task.task_id, task.prompt, task.hidden_tests().test_ids) == ("i", "p", ("a.py::t",))
