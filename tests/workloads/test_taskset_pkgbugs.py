"""The bundled pkgbugs task set: bugs planted in inflection 0.5.1, byte-identical on every generation,
and provable with the package's own tests run directly under ``/usr/bin/python3 -m pytest``, their
outcomes read from JUnit XML (not through the grader): the base fails FAIL_TO_PASS and passes
PASS_TO_PASS, the gold patch passes both."""

from __future__ import annotations

import dataclasses
import hashlib
import io
import json
import shlex
import subprocess
import tarfile
import xml.etree.ElementTree as ET
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import yaml

from base.typed_config import build
from workloads.config import WorkloadConfig
from workloads.sandbox.none import NoSandbox
from workloads.tasksets import make_taskset, pkgbugs
from workloads.tasksets.pkgbugs_inflection import INFLECTION, Bug
from workloads.tasksets.swe import SweTask, SweTaskSet, load_tasks

ROOT = Path(__file__).resolve().parents[2]
TEST_CMD = "python -m pytest -q test_inflection.py"


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("pkgbugs-data")
    pkgbugs.generate(path)
    return path


@pytest.fixture(scope="module")
def tasks(data_dir: Path) -> list[SweTask]:
    return load_tasks(pkgbugs.task_file(data_dir))


def _cfg(data_dir: Path, **changes) -> WorkloadConfig:
    raw = yaml.safe_load((ROOT / "conf/workload/pkgbugs.yaml").read_text())
    return dataclasses.replace(build(WorkloadConfig, raw), data_dir=str(data_dir), **changes)


def _tree(task: SweTask, commit: str, dest: Path) -> Path:
    archive = subprocess.run(["git", f"--git-dir={task.repo}", "archive", commit], check=True, capture_output=True)
    with tarfile.open(fileobj=io.BytesIO(archive.stdout)) as tar:
        tar.extractall(dest, filter="data")
    return dest


def _apply(tree: Path, patch: str) -> None:
    subprocess.run(["git", "apply", "-"], cwd=tree, input=patch.encode(), check=True, capture_output=True)


def _pytest(tree: Path, test_cmd: str) -> dict[str, str]:
    """Node id -> passed / failure / error / skipped, from the JUnit XML of the row's own pytest command."""
    args = shlex.split(test_cmd)
    assert args[:3] == ["python", "-m", "pytest"]
    junit = tree.parent / f"{tree.name}.xml"
    env = {"PATH": "/usr/bin:/bin", "LC_ALL": "C.UTF-8", "PYTHONDONTWRITEBYTECODE": "1",
           "PYTEST_DISABLE_PLUGIN_AUTOLOAD": "1"}
    subprocess.run(["/usr/bin/python3", *args[1:], "-p", "no:cacheprovider", f"--junitxml={junit}"], cwd=tree,
                   env=env, capture_output=True, timeout=120)
    outcomes = {}
    for case in ET.parse(junit).iter("testcase"):
        # Module-level tests: classname is the file's dotted path, name the id's part after "::".
        nodeid = f"{case.get('classname').replace('.', '/')}.py::{case.get('name')}"
        outcomes[nodeid] = next((t for t in ("error", "failure", "skipped") if case.find(t) is not None), "passed")
    return outcomes


def test_every_row_loads_with_the_packages_plain_test_command(data_dir: Path, tasks: list[SweTask]):
    rows = [json.loads(line) for line in pkgbugs.task_file(data_dir).read_text().splitlines()]
    assert 10 <= len(tasks) <= 20 and len({t.task_id for t in tasks}) == len(tasks)
    assert len({r["bug_kind"] for r in rows}) >= 5
    suite = set(tasks[0].fail_to_pass + tasks[0].pass_to_pass)
    for task in tasks:
        assert task.test_cmd == TEST_CMD
        assert task.fail_to_pass and not set(task.fail_to_pass) & set(task.pass_to_pass)
        assert set(task.fail_to_pass + task.pass_to_pass) == suite  # the whole file's tests, no other
        assert [line[6:] for line in task.patch.splitlines() if line.startswith("+++ ")] == ["inflection/__init__.py"]
        assert [line[6:] for line in task.test_patch.splitlines() if line.startswith("+++ ")] == ["test_inflection.py"]
        assert task.repo == data_dir.resolve() / "pkgbugs" / "repos" / task.task_id


def test_generation_is_deterministic_and_idempotent(data_dir: Path, tmp_path: Path, monkeypatch):
    pkgbugs.generate(tmp_path)
    assert (tmp_path / "pkgbugs/tasks.jsonl").read_bytes() == pkgbugs.task_file(data_dir).read_bytes()
    stamp_mtime = (tmp_path / "pkgbugs/STAMP").stat().st_mtime_ns
    pkgbugs.generate(tmp_path)  # current stamp: nothing rewritten
    assert (tmp_path / "pkgbugs/STAMP").stat().st_mtime_ns == stamp_mtime
    # An older generator's set is replaced whole (a stand-in writer spares a third measured run).
    (tmp_path / "pkgbugs/STAMP").write_text("0")
    monkeypatch.setattr(pkgbugs, "_write_task_set", lambda root, package: (root / "tasks.jsonl").write_text("new\n"))
    pkgbugs.generate(tmp_path)
    assert (tmp_path / "pkgbugs/tasks.jsonl").read_text() == "new\n"
    assert not (tmp_path / "pkgbugs/repos").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["pkgbugs"]  # no temporary folders left


def test_each_task_fails_on_its_base_and_the_gold_patch_fixes_it(tasks: list[SweTask], tmp_path: Path):
    def prove(task: SweTask) -> list[str]:
        problems = []
        work = tmp_path / task.task_id
        base = _tree(task, task.base_commit, work / "base")
        visible = _pytest(base, task.test_cmd)
        if not visible or set(visible.values()) != {"passed"} or set(visible) & set(task.fail_to_pass):
            problems.append("the base shows failing or hidden FAIL_TO_PASS tests")
        fixed_source = _tree(task, "main", work / "head") / "inflection/__init__.py"
        if (base / "inflection/__init__.py").read_text() == fixed_source.read_text():
            problems.append("the base already holds the fix")
        _apply(base, task.test_patch)
        hidden = _pytest(base, task.test_cmd)
        if any(hidden.get(t) == "passed" for t in task.fail_to_pass):
            problems.append("a FAIL_TO_PASS test passes on the base")
        if any(hidden.get(t) != "passed" for t in task.pass_to_pass):
            problems.append("a PASS_TO_PASS test fails on the base")
        _apply(base, task.patch)
        gold = _pytest(base, task.test_cmd)
        if any(gold.get(t) != "passed" for t in task.fail_to_pass + task.pass_to_pass):
            problems.append("the gold patch leaves a test failing")
        for path in ("inflection/__init__.py", "test_inflection.py"):  # HEAD is exactly the base, fixed
            if (base / path).read_text() != (work / "head" / path).read_text():
                problems.append(f"{path} of HEAD is not base + test_patch + patch")
        return [f"{task.task_id}: {p}" for p in problems]

    with ThreadPoolExecutor(2) as pool:
        assert [p for problems in pool.map(prove, tasks) for p in problems] == []


def test_ids_with_brackets_spaces_and_escapes_survive_the_jsonl_round_trip(tasks: list[SweTask], tmp_path: Path):
    ids = set(tasks[0].fail_to_pass + tasks[0].pass_to_pass)
    for needle in ("[", " ", "'", "!@#", "\\x", "\\u"):  # pytest escapes non-ASCII: Malm\xf6, \u65e5
        assert any(needle in i for i in ids), needle
    assert "test_inflection.py::test_titleize[ana \\xedndia-Ana \\xcdndia]" in ids
    # What pytest reports now, on the package as released, is exactly what the rows hold.
    assert set(_pytest(_tree(tasks[0], "main", tmp_path / "head"), TEST_CMD)) == ids
    caught = {i for t in tasks for i in t.fail_to_pass}
    assert any("\\x" in i for i in caught) and any(" " in i and "[" in i for i in caught)


def test_problem_statements_report_the_symptom_never_the_fix(tasks: list[SweTask]):
    for task in tasks:
        added = [line[1:].strip() for line in task.patch.splitlines()
                 if line.startswith("+") and not line.startswith("+++") and line[1:].strip()]
        assert added and not [line for line in added if line in task.prompt], task.task_id
        assert "`inflection." in task.prompt, task.task_id


def test_make_taskset_generates_and_splits(data_dir: Path):
    taskset = make_taskset(_cfg(data_dir), NoSandbox())
    assert isinstance(taskset, SweTaskSet)
    train, held_out = taskset.split()
    assert (len(train), len(held_out)) == (len(INFLECTION.bugs) - 2, 2)
    assert not {t.task_id for t in train} & {t.task_id for t in held_out}


def test_a_bug_no_test_catches_stops_the_generator(tmp_path: Path):
    harmless = Bug("docstring", "    Convert strings to CamelCase.", "    Convert strings to camelCase.",
                   ("inflection.camelize('a_b')",))
    with pytest.raises(AssertionError, match="pkgbugs__inflection-1: no test catches the bug"):
        pkgbugs._write_task_set(tmp_path, dataclasses.replace(INFLECTION, bugs=(harmless,)))


def test_a_test_failing_on_the_correct_package_stops_the_generator(tmp_path: Path, monkeypatch):
    unpack = pkgbugs._unpack

    def with_a_broken_test(package):
        files = unpack(package)
        return {**files, "test_inflection.py": files["test_inflection.py"] + "\n\ndef test_broken():\n    assert 0\n"}

    monkeypatch.setattr(pkgbugs, "_unpack", with_a_broken_test)
    with pytest.raises(AssertionError, match=r"test_inflection\.py::test_broken fails on the correct package"):
        pkgbugs._write_task_set(tmp_path, INFLECTION)


def test_the_sdist_is_the_pinned_one_with_its_licence():
    sdist = pkgbugs.SOURCES_DIR / INFLECTION.sdist
    assert hashlib.sha256(sdist.read_bytes()).hexdigest() == INFLECTION.sdist_sha256
    with tarfile.open(sdist) as tar:
        assert "inflection-0.5.1/LICENSE" in tar.getnames()
