"""The hidden-test grader: rewards, grader failures (None, never 0), and symlinks it must not follow.

The test commands run the system's ``python3 -m pytest`` (what the sandbox shows) with no sandbox.
"""

from __future__ import annotations

import difflib
import os
import shutil
import time
from pathlib import Path

import pytest

from workloads.graders.tests import (
    HiddenTests, PatchError, apply_hunks, grade_hidden_tests, parse_patch, parse_summary, score,
)
from workloads.sandbox.none import NoSandbox

pytestmark = pytest.mark.skipif(not Path("/usr/bin/python3").exists(), reason="needs the system python3")

CALC = "def add(a, b):\n    return a + b\n\n\ndef sub(a, b):\n    return a + b\n"
FIXED_CALC = "def add(a, b):\n    return a + b\n\n\ndef sub(a, b):\n    return a - b\n"
VISIBLE_TESTS = "from calc import add, sub\n\n\ndef test_add():\n    assert add(2, 3) == 5\n"
HIDDEN_TESTS = VISIBLE_TESTS + "\n\ndef test_sub():\n    assert sub(5, 3) == 2\n\n\ndef test_sub_zero():\n    assert sub(1, 0) == 1\n"
TEST_FILE = "tests/test_calc.py"


def _diff(path: str, before: str, after: str) -> str:
    body = difflib.unified_diff(before.splitlines(keepends=True), after.splitlines(keepends=True),
                                f"a/{path}" if before else "/dev/null", f"b/{path}")
    return f"diff --git a/{path} b/{path}\n" + "".join(body)


def _tests(**changes) -> HiddenTests:
    fields = dict(task_id="calc-1", test_patch=_diff(TEST_FILE, VISIBLE_TESTS, HIDDEN_TESTS),
                  test_cmd=f"python3 -m pytest -rA -p no:cacheprovider {TEST_FILE}",
                  fail_to_pass=(f"{TEST_FILE}::test_sub",), pass_to_pass=(f"{TEST_FILE}::test_add",
                                                                         f"{TEST_FILE}::test_sub_zero"))
    return HiddenTests(**{**fields, **changes})


@pytest.fixture
def base_tree(tmp_path: Path) -> Path:
    base = tmp_path / "base"
    (base / "tests").mkdir(parents=True)
    (base / "calc.py").write_text(CALC)
    (base / TEST_FILE).write_text(VISIBLE_TESTS)
    return base


@pytest.fixture
def workspace(tmp_path: Path, base_tree: Path) -> Path:
    ws = tmp_path / "ws"
    shutil.copytree(base_tree, ws)
    return ws


def _grade(tests: HiddenTests, workspace: Path, base_tree: Path, reward="binary", timeout_s=60.0):
    return grade_hidden_tests(tests, workspace=workspace, base_tree=base_tree, sandbox=NoSandbox(), reward=reward,
                              timeout_s=timeout_s)


def test_fixed_workspace_scores_one_and_lists_the_tests(workspace: Path, base_tree: Path):
    (workspace / "calc.py").write_text(FIXED_CALC)
    result = _grade(_tests(), workspace, base_tree)
    assert result.reward == 1.0, result
    assert sorted(result.detail["passed"]) == sorted(_tests().test_ids) and result.detail["failed"] == []
    assert "3 passed" in result.detail["log_tail"]


def test_unfixed_workspace_scores_zero_binary_and_a_share_as_fraction(workspace: Path, base_tree: Path):
    binary = _grade(_tests(), workspace, base_tree)
    assert binary.reward == 0.0 and binary.detail["failed"] == [f"{TEST_FILE}::test_sub"]
    fraction = _grade(_tests(), workspace, base_tree, reward="fraction")
    assert fraction.reward == pytest.approx(2 / 3)


def test_breaking_a_pass_to_pass_test_scores_zero(workspace: Path, base_tree: Path):
    (workspace / "calc.py").write_text("def add(a, b):\n    return 0\n\n\ndef sub(a, b):\n    return a - b\n")
    result = _grade(_tests(), workspace, base_tree)
    assert result.reward == 0.0 and f"{TEST_FILE}::test_add" in result.detail["failed"]


def test_agent_edits_to_hidden_test_files_are_discarded(workspace: Path, base_tree: Path):
    (workspace / TEST_FILE).write_text("def test_sub():\n    pass\n\n\ndef test_add():\n    pass\n")
    assert _grade(_tests(), workspace, base_tree).reward == 0.0


def test_code_that_no_longer_imports_is_an_outcome_not_a_failure(workspace: Path, base_tree: Path):
    (workspace / "calc.py").write_text("this is not python\n")
    result = _grade(_tests(), workspace, base_tree)
    assert result.reward == 0.0 and result.error == ""


def test_timeout_is_a_grader_failure_and_kills_the_group(workspace: Path, base_tree: Path):
    marker = workspace / "late"
    started = time.monotonic()
    result = _grade(_tests(test_cmd=f"(sleep 1; touch {marker}) & sleep 30"), workspace, base_tree, timeout_s=0.5)
    assert result.reward is None and "timed out" in result.error
    assert time.monotonic() - started < 10
    time.sleep(1.5)
    assert not marker.exists()  # the background child died with its group


@pytest.mark.parametrize("command", ["exit 3", "python3 -m no_such_test_runner", "echo all good"])
def test_a_command_that_reports_none_of_the_tests_is_a_grader_failure(workspace: Path, base_tree: Path, command):
    result = _grade(_tests(test_cmd=command), workspace, base_tree)
    assert result.reward is None and "reported none of the task's tests" in result.error


def test_grader_crash_is_a_failure_not_zero(workspace: Path, base_tree: Path):
    result = _grade(_tests(), workspace, base_tree / "gone")
    assert result.reward is None and "base tree missing" in result.error
    result = _grade(_tests(test_patch=_diff("calc.py", "nothing like it\n", "x\n")), workspace, base_tree)
    assert result.reward is None and "grader raised PatchError" in result.error


def test_symlinked_test_file_is_replaced_never_followed(tmp_path: Path, workspace: Path, base_tree: Path):
    outside = tmp_path / "outside.py"
    outside.write_text("precious\n")
    (workspace / TEST_FILE).unlink()
    (workspace / TEST_FILE).symlink_to(outside)
    (workspace / "calc.py").write_text(FIXED_CALC)
    assert _grade(_tests(), workspace, base_tree).reward == 1.0
    assert outside.read_text() == "precious\n"
    assert not (workspace / TEST_FILE).is_symlink() and (workspace / TEST_FILE).read_text() == HIDDEN_TESTS


def test_symlinked_tests_folder_is_replaced_never_followed(tmp_path: Path, workspace: Path, base_tree: Path):
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "test_calc.py").write_text("precious\n")
    shutil.rmtree(workspace / "tests")
    (workspace / "tests").symlink_to(outside, target_is_directory=True)
    _grade(_tests(), workspace, base_tree)
    assert sorted(os.listdir(outside)) == ["test_calc.py"] and (outside / "test_calc.py").read_text() == "precious\n"
    assert (workspace / "tests").is_dir() and not (workspace / "tests").is_symlink()


def test_new_hidden_file_under_a_symlinked_folder_stays_inside(tmp_path: Path, workspace: Path, base_tree: Path):
    outside = tmp_path / "elsewhere"
    outside.mkdir()
    (workspace / "hidden").symlink_to(outside, target_is_directory=True)
    patch = _diff("hidden/test_more.py", "", "def test_more():\n    pass\n")
    _grade(_tests(test_patch=patch), workspace, base_tree)
    assert list(outside.iterdir()) == []
    assert (workspace / "hidden" / "test_more.py").read_text() == "def test_more():\n    pass\n"


def test_parse_summary_reads_pytest_short_summary_lines():
    log = "\n".join([
        "tests/test_a.py::test_x PASSED  [ 50%]",  # a verbose progress line is not a summary line
        "=========================== short test summary info ============================",
        "PASSED tests/test_a.py::test_ok",
        "PASSED tests/test_a.py::test_param[a b - c]",
        "FAILED tests/test_a.py::test_bad - AssertionError: assert 1 == 2",
        "ERROR tests/test_a.py::test_fixture - RuntimeError: boom",
        "ERROR tests/test_b.py",
        "XFAIL tests/test_a.py::test_known - reason",
        "SKIPPED [1] tests/test_a.py:9: no network",
    ])
    assert parse_summary(log) == {
        "tests/test_a.py::test_ok": "PASSED", "tests/test_a.py::test_param[a b - c]": "PASSED",
        "tests/test_a.py::test_bad": "FAILED", "tests/test_a.py::test_fixture": "ERROR", "tests/test_b.py": "ERROR",
        "tests/test_a.py::test_known": "XFAIL",
    }


def test_score_counts_unreported_tests_as_failed_and_xfail_as_passed():
    tests = _tests(fail_to_pass=("t.py::a",), pass_to_pass=("t.py::b", "t.py::c"))
    assert score(tests, {"t.py::a": "PASSED", "t.py::b": "XFAIL"}, "fraction") == (2 / 3, ["t.py::a", "t.py::b"],
                                                                                    ["t.py::c"])
    assert score(tests, {"t.py": "ERROR"}, "binary")[0] == 0.0  # a collection error of their file is reported
    assert score(tests, {"other.py::x": "PASSED"}, "binary")[0] is None


@pytest.mark.parametrize("patch, message", [
    ("--- a/../evil.py\n+++ b/../evil.py\n@@ -1 +1 @@\n-a\n+b\n", "leaves the tree"),
    ("--- a/x.py\n+++ b//etc/passwd\n@@ -1 +1 @@\n-a\n+b\n", "leaves the tree"),
    ("--- /dev/null\n+++ b/.git/hooks/post-checkout\n@@ -0,0 +1 @@\n+x\n", "names .git"),
    ("diff --git a/x b/x\nGIT binary patch\nliteral 1\n", "binary"),
    ("diff --git a/x b/y\nrename from x\nrename to y\n", "renames"),
    ("--- a/x.py\n+++ b/x.py\n@@ -1,2 +1,2 @@\n-a\n", "ends early"),
    ("just some text\n", "file headers"),
])
def test_parse_patch_refuses_what_it_cannot_apply_safely(patch: str, message: str):
    with pytest.raises(PatchError, match=message):
        parse_patch(patch)


def test_apply_hunks_finds_a_shifted_context_and_keeps_missing_final_newline():
    patch = "--- a/f\n+++ b/f\n@@ -1,2 +1,2 @@\n a\n-b\n+B\n@@ -3 +3 @@\n-c\n\\ No newline at end of file\n+C\n"
    (file_patch,) = parse_patch(patch)
    assert apply_hunks("new first line\na\nb\nc", file_patch.hunks, "f") == "new first line\na\nB\nC\n"
