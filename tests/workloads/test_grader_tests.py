"""The hidden-test grader: the agent's patch on a fresh tree, results from JUnit XML, who caused what.

The test commands run the system's pytest (Debian's python3-pytest, what every sandbox shows). Most
tests grade with no sandbox (the sandboxes have tests of their own); the attack tests run with the
real bwrap, each attack shown to score 1.0 with the defence that stops it turned off, so none of
them is a no-op.
"""

from __future__ import annotations

import dataclasses
import difflib
import os
import shutil
import time
from pathlib import Path

import pytest
import yaml

from base.typed_config import build
from workloads.config import GradingConfig, SandboxConfig, WorkloadConfig
from workloads.graders.junit import junit_key, read_reports
from workloads.graders.patches import PatchError, apply_hunks, parse_patch
from workloads.graders.tests import Canary, GradeSetup, HiddenTests, grade_hidden_tests
from workloads.sandbox.bwrap import BwrapSandbox, bwrap_problem
from workloads.sandbox.none import NoSandbox

ROOT = Path(__file__).resolve().parents[2]
IN_CI = os.environ.get("CI") == "true"
pytestmark = pytest.mark.skipif(not IN_CI and not Path("/usr/bin/python3").exists(), reason="needs the system python3")

CALC = "def add(a, b):\n    return a + b\n\n\ndef sub(a, b):\n    return a + b\n"
FIXED_CALC = "def add(a, b):\n    return a + b\n\n\ndef sub(a, b):\n    return a - b\n"
VISIBLE_TESTS = "from calc import add, sub\n\n\ndef test_add():\n    assert add(2, 3) == 5\n"
HIDDEN_TESTS = VISIBLE_TESTS + "\n\ndef test_sub():\n    assert sub(5, 3) == 2\n\n\ndef test_sub_zero():\n    assert sub(1, 0) == 1\n"
TEST_FILE = "tests/test_calc.py"
PLAIN_CMD = "python -m pytest -q tests/"


def grading(**over) -> GradingConfig:
    raw = yaml.safe_load((ROOT / "conf/workload/pyfix.yaml").read_text())
    return dataclasses.replace(build(WorkloadConfig, raw).grading, **over)


def grader_limits():
    raw = yaml.safe_load((ROOT / "conf/sandbox/bwrap.yaml").read_text())
    return build(SandboxConfig, raw).grader_limits.resources()


def _diff(path: str, before: str, after: str) -> str:
    body = difflib.unified_diff(before.splitlines(keepends=True), after.splitlines(keepends=True),
                                f"a/{path}" if before else "/dev/null", f"b/{path}")
    return f"diff --git a/{path} b/{path}\n" + "".join(body)


def _tests(**changes) -> HiddenTests:
    fields = dict(task_id="calc-1", test_patch=_diff(TEST_FILE, VISIBLE_TESTS, HIDDEN_TESTS), test_cmd=PLAIN_CMD,
                  fail_to_pass=(f"{TEST_FILE}::test_sub",),
                  pass_to_pass=(f"{TEST_FILE}::test_add", f"{TEST_FILE}::test_sub_zero"))
    return HiddenTests(**{**fields, **changes})


@pytest.fixture
def template(tmp_path: Path) -> Path:
    base = tmp_path / "template"
    (base / "tests").mkdir(parents=True)
    (base / "calc.py").write_text(CALC)
    (base / TEST_FILE).write_text(VISIBLE_TESTS)
    return base


@pytest.fixture
def workspace(tmp_path: Path, template: Path) -> Path:
    ws = tmp_path / "ws"
    shutil.copytree(template, ws)
    return ws


def _grade(tests: HiddenTests, workspace: Path, template: Path, *, reward="binary", timeout_s=60.0, sandbox=None,
           canary: Canary | None = None, **grading_over):
    setup = GradeSetup(sandbox=sandbox or NoSandbox(), grading=grading(**grading_over), reward=reward,
                       limits=grader_limits())
    return grade_hidden_tests(tests, workspace=workspace, template=template, grade_dir=workspace.parent / "grade",
                              setup=setup, timeout_s=timeout_s, canary=canary or Canary())


# ---------------------------------------------------------------- rewards


def test_a_fix_scores_one_through_a_plain_test_command(workspace: Path, template: Path):
    (workspace / "calc.py").write_text(FIXED_CALC)
    result = _grade(_tests(), workspace, template)
    assert result.reward == 1.0, result
    assert sorted(result.detail["passed"]) == sorted(_tests().test_ids) and result.detail["failed"] == []
    assert result.detail["kept"] == ["modified calc.py"] and result.detail["outcome"] == "reported"
    assert "+    return a - b" in (workspace.parent / "grade" / "patch.diff").read_text()


def test_no_fix_scores_zero_binary_and_a_share_as_fraction(workspace: Path, template: Path):
    binary = _grade(_tests(), workspace, template)
    assert binary.reward == 0.0 and binary.detail["failed"] == [f"{TEST_FILE}::test_sub"]
    assert binary.detail["canary"]["ok"] is True  # a grade below 1 stands only on a passing canary
    fraction = _grade(_tests(), workspace, template, reward="fraction")
    assert fraction.reward == pytest.approx(2 / 3)


def test_breaking_a_pass_to_pass_test_scores_zero(workspace: Path, template: Path):
    (workspace / "calc.py").write_text("def add(a, b):\n    return 0\n\n\ndef sub(a, b):\n    return a - b\n")
    result = _grade(_tests(), workspace, template)
    assert result.reward == 0.0 and f"{TEST_FILE}::test_add" in result.detail["failed"]


def test_edits_to_test_files_and_their_deletion_are_dropped(workspace: Path, template: Path):
    (workspace / TEST_FILE).write_text("def test_sub():\n    pass\n\n\ndef test_add():\n    pass\n")
    (workspace / "tests" / "test_extra.py").write_text("def test_more():\n    pass\n")
    result = _grade(_tests(), workspace, template)
    assert result.reward == 0.0
    assert {d["path"] for d in result.detail["dropped"]} == {TEST_FILE, "tests/test_extra.py"}
    (workspace / TEST_FILE).unlink()  # deleting the tests is dropped like editing them
    (workspace / "calc.py").write_text(FIXED_CALC)
    result = _grade(_tests(), workspace, template)
    assert result.reward == 1.0 and TEST_FILE in {d["path"] for d in result.detail["dropped"]}


def test_ids_with_brackets_spaces_and_non_ascii_round_trip(workspace: Path, template: Path):
    hidden = VISIBLE_TESTS + (
        "\n\nimport pytest\n\n\n@pytest.mark.parametrize('x', ['a b', '[x]', 'a::b - c'])\n"
        "def test_sub_p(x):\n    assert sub(5, 3) == 2\n\n\nclass TestCafé:\n    def test_ünï(self):\n"
        "        assert sub(1, 1) == 0\n")
    ids = (f"{TEST_FILE}::test_sub_p[a b]", f"{TEST_FILE}::test_sub_p[[x]]", f"{TEST_FILE}::test_sub_p[a::b - c]",
           f"{TEST_FILE}::TestCafé::test_ünï")
    tests = _tests(test_patch=_diff(TEST_FILE, VISIBLE_TESTS, hidden), fail_to_pass=ids,
                   pass_to_pass=(f"{TEST_FILE}::test_add",))
    (workspace / "calc.py").write_text(FIXED_CALC)
    fixed = _grade(tests, workspace, template)
    assert fixed.reward == 1.0 and sorted(fixed.detail["passed"]) == sorted((*ids, f"{TEST_FILE}::test_add")), fixed
    (workspace / "calc.py").write_text(CALC)
    assert sorted(_grade(tests, workspace, template).detail["failed"]) == sorted(ids)


# ---------------------------------------------------------------- who caused it: 0 or None


def test_code_that_no_longer_imports_is_a_collection_error_scoring_zero(workspace: Path, template: Path):
    (workspace / "calc.py").write_text("this is not python\n")
    result = _grade(_tests(), workspace, template)
    assert result.reward == 0.0 and result.error == ""
    assert result.detail["collection_errors"] == ["tests.test_calc"]


def test_tests_past_the_timeout_score_zero_and_the_group_is_killed(workspace: Path, template: Path):
    marker = workspace.parent / "late"
    (workspace / "calc.py").write_text(
        f"import os, time\nif os.fork() == 0:\n    time.sleep(4)\n    open({str(marker)!r}, 'w').close()\n"
        "while True:\n    time.sleep(1)\n")
    started = time.monotonic()
    result = _grade(_tests(), workspace, template, timeout_s=2.0, forbidden_refs=())
    assert result.reward == 0.0 and result.detail["outcome"] == "timeout", result
    assert result.detail["canary"]["ok"] is True
    assert time.monotonic() - started < 20
    time.sleep(max(0.0, started + 5.0 - time.monotonic()))
    assert not marker.exists()  # the forked child died with its group


@pytest.mark.parametrize("source", [
    "import os\nos._exit(0)\n",                    # exits before any report
    "import os, signal\nos.kill(os.getpid(), signal.SIGKILL)\n",  # crashes
])
def test_a_test_process_that_ends_before_reporting_scores_zero(workspace: Path, template: Path, source: str):
    (workspace / "calc.py").write_text(source)
    result = _grade(_tests(), workspace, template, forbidden_refs=())
    assert result.reward == 0.0 and result.detail["outcome"] == "no_report", result


def test_a_missing_test_scores_as_failed(workspace: Path, template: Path):
    (workspace / "calc.py").write_text(FIXED_CALC)
    result = _grade(_tests(fail_to_pass=(f"{TEST_FILE}::test_sub", f"{TEST_FILE}::test_not_there")), workspace,
                    template)
    assert result.reward == 0.0 and result.detail["failed"] == [f"{TEST_FILE}::test_not_there"]


def test_a_broken_test_environment_is_excluded_never_zero(workspace: Path, template: Path):
    """The canary (the untouched template) fails as well: the grade is not the agent's."""
    result = _grade(_tests(test_cmd="python -m no_such_runner"), workspace, template)
    assert result.reward is None and "canary failed" in result.error, result


def test_a_task_environment_runs_the_tests_with_its_interpreter(workspace: Path, template: Path, tmp_path: Path):
    env = tmp_path / "env"
    (env / "bin").mkdir(parents=True)
    (env / "bin" / "python").write_text("#!/bin/sh\necho ran-in-env >&2\nexec /usr/bin/python3 \"$@\"\n")
    (env / "bin" / "python").chmod(0o755)
    (workspace / "calc.py").write_text(FIXED_CALC)
    result = _grade(_tests(environment=env), workspace, template)
    assert result.reward == 1.0 and "ran-in-env" in result.detail["log_tail"], result


def test_the_graders_own_failures_are_none(workspace: Path, template: Path):
    result = _grade(_tests(), workspace, template.parent / "gone")
    assert result.reward is None and "template missing" in result.error
    result = _grade(_tests(test_patch=_diff("calc.py", "nothing like it\n", "x\n")), workspace, template)
    assert result.reward is None and "grader raised PatchError" in result.error


def test_a_sandbox_that_does_not_start_is_excluded(workspace: Path, template: Path):
    class Broken(NoSandbox):
        def wrap(self, spec):
            return ["/bin/sh", "-c", "echo 'bwrap: Creating new namespace failed' >&2; exit 1"]

    result = _grade(_tests(), workspace, template, sandbox=Broken())
    assert result.reward is None and "did not start" in result.error


def test_a_change_past_the_limits_scores_zero(workspace: Path, template: Path):
    for i in range(30):
        (workspace / f"m{i}.py").write_text("x = 1\n")
    result = _grade(_tests(), workspace, template, max_change_files=20)
    assert result.reward == 0.0 and result.detail["outcome"] == "oversize_change"


# ---------------------------------------------------------------- links: never followed


def test_symlinks_in_the_workspace_are_never_part_of_the_change(tmp_path: Path, workspace: Path, template: Path):
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "test_calc.py").write_text("def test_sub():\n    pass\n")
    shutil.rmtree(workspace / "tests")
    (workspace / "tests").symlink_to(outside, target_is_directory=True)
    (workspace / "calc.py").unlink()
    (workspace / "calc.py").symlink_to(tmp_path / "elsewhere.py")
    result = _grade(_tests(), workspace, template)
    assert result.reward == 0.0
    assert {d["path"] for d in result.detail["dropped"]} >= {"tests", "calc.py"}
    assert (outside / "test_calc.py").read_text() == "def test_sub():\n    pass\n"  # untouched, never followed


# ---------------------------------------------------------------- attacks, each with its defence off

PASS_ALL = ("import pytest\n\n\n@pytest.hookimpl(hookwrapper=True)\ndef pytest_runtest_makereport(item, call):\n"
            "    outcome = yield\n    rep = outcome.get_result()\n    rep.outcome = 'passed'\n    rep.longrepr = None\n")
OFF = dict(filter_change=False, isolate_runner=False, tripwire=False)
"""Every layer off: what the attacks are measured against."""


def _rewriting_source() -> str:
    # After pytest wrote its report: every testcase in it made a pass (an atexit handler in the
    # module under test, which the test process imports).
    return (FIXED_CALC.replace("return a - b", "return a + b") + "\n\nimport atexit, glob, os, re\n\n\n"
            "def _rewrite():\n    for p in glob.glob(os.environ.get('HOME', '') + '/report/*.xml'):\n"
            "        text = open(p).read()\n"
            "        text = re.sub(r'<failure[^>]*>.*?</failure>', '', text, flags=re.S)\n"
            "        open(p, 'w').write(text)\n\n\natexit.register(_rewrite)\n")


ATTACKS = {
    # name: (files written into the workspace, the test command, layers that stop it alone)
    "conftest_hookwrapper": ({"conftest.py": PASS_ALL}, "python3 -m pytest -q tests/", ("filter", "tripwire")),
    "ini_plugin": ({"pytest.ini": "[pytest]\naddopts = -p evilplug\n", "evilplug.py": PASS_ALL},
                   "python3 -m pytest -q tests/", ("filter", "isolate", "tripwire")),
    "pyproject_plugin": ({"pyproject.toml": '[tool.pytest.ini_options]\naddopts = "-p evilplug"\n',
                          "evilplug.py": PASS_ALL}, "python3 -m pytest -q tests/", ("filter", "isolate", "tripwire")),
    "shadowing_pytest_py": ({"pytest.py": (
        "import os, shlex, sys\nwhere = [a.split('=', 1)[1] for a in shlex.split(os.environ.get('PYTEST_ADDOPTS', ''))"
        " if a.startswith('--junitxml=')][0]\nnames = ['test_add', 'test_sub', 'test_sub_zero']\n"
        "open(where, 'w').write('<testsuites><testsuite>' + ''.join("
        "f'<testcase classname=\"tests.test_calc\" name=\"{n}\"/>' for n in names) + '</testsuite></testsuites>')\n"
        "sys.exit(0)\n")}, "python3 -m pytest -q tests/", ("filter", "isolate")),
    "report_rewritten_at_exit": ({"calc.py": _rewriting_source()}, "python3 -m pytest -q tests/", ("filter", "tripwire")),
    "sys_modules_tampering": ({"calc.py": FIXED_CALC.replace("return a - b", "return a + b") + (
        "\n\nimport sys\n_r = sys.modules.get('_pytest.reports')\nif _r is not None:\n"
        "    _orig = _r.TestReport.from_item_and_call\n\n"
        "    def _passing(item, call):\n        rep = _orig(item, call)\n        rep.outcome = 'passed'\n"
        "        rep.longrepr = None\n        return rep\n\n"
        "    _r.TestReport.from_item_and_call = staticmethod(_passing)\n")}, "python3 -m pytest -q tests/",
        ("filter", "tripwire")),
}
LAYERS = {"filter": "filter_change", "isolate": "isolate_runner", "tripwire": "tripwire"}


@pytest.fixture(scope="module")
def bwrap():
    if bwrap_problem(""):
        if IN_CI:
            pytest.fail(f"bwrap must run in CI: {bwrap_problem('')}")
        pytest.skip(f"bwrap cannot run here: {bwrap_problem('')}")
    raw = yaml.safe_load((ROOT / "conf/sandbox/bwrap.yaml").read_text())
    return BwrapSandbox(build(SandboxConfig, raw))


@pytest.mark.parametrize("name", sorted(ATTACKS))
def test_each_attack_passes_with_every_layer_off_and_fails_with_them_on(name: str, tmp_path: Path, template: Path,
                                                                        bwrap):
    files, command, stoppers = ATTACKS[name]
    tests = _tests(test_cmd=command)

    def attacked(label: str) -> Path:
        ws = tmp_path / label / "ws"
        shutil.copytree(template, ws)
        for path, text in files.items():
            (ws / path).write_text(text)
        return ws

    off = _grade(tests, attacked("off"), template, sandbox=bwrap, **OFF)
    assert off.reward == 1.0, f"{name}: the attack must work with every layer off: {off}"
    on = _grade(tests, attacked("on"), template, sandbox=bwrap)
    assert on.reward == 0.0, f"{name}: {on}"
    for layer in stoppers:  # each layer named stops it on its own
        alone = {**OFF, LAYERS[layer]: True}
        result = _grade(tests, attacked(layer), template, sandbox=bwrap, **alone)
        assert result.reward == 0.0, f"{name} with only {layer} on: {result}"


def test_an_atexit_printer_fools_only_a_reader_of_the_output(workspace: Path, template: Path):
    """What a parser of pytest's ``-rA`` summary would have scored 1.0; the JUnit report says 0."""
    lines = "".join(f"PASSED {t}\\n" for t in _tests().test_ids)
    (workspace / "calc.py").write_text(CALC + f"\n\nimport atexit\natexit.register(lambda: print('{lines}'))\n")
    result = _grade(_tests(), workspace, template, **OFF)
    assert all(f"PASSED {t}" in result.detail["log_tail"] for t in _tests().test_ids)
    assert result.reward == 0.0 and result.detail["failed"] == [f"{TEST_FILE}::test_sub"]


def test_what_is_dropped_is_recorded_with_its_rule(workspace: Path, template: Path):
    (workspace / "calc.py").write_text(FIXED_CALC)
    for path, text in {"conftest.py": PASS_ALL, "sub/conftest.py": PASS_ALL, "tox.ini": "[pytest]\n",
                       "json.py": "x = 1\n", "sitecustomize.py": "", "x.pth": "import os\n",
                       "pkg/__init__.py": "", "pkg/json.py": "ok = 1\n", "helper.py": "import inspect\n",
                       "setup.cfg": "[tool:pytest]\naddopts = -p evilplug\n"}.items():
        (workspace / path).parent.mkdir(parents=True, exist_ok=True)
        (workspace / path).write_text(text)
    result = _grade(_tests(), workspace, template)
    why = {d["path"]: d["why"] for d in result.detail["dropped"]}
    assert result.reward == 1.0  # the fix stands: nothing it needs was dropped
    assert set(why) == {"conftest.py", "sub/conftest.py", "tox.ini", "json.py", "sitecustomize.py", "x.pth",
                        "helper.py", "setup.cfg"}, why
    assert "shadows the module 'json'" in why["json.py"] and "inspect" in why["helper.py"]
    assert "added pkg/json.py" in result.detail["kept"]  # inside a package: no shadowing


# ---------------------------------------------------------------- reports and diffs


def test_junit_keys_follow_pytests_own_mangling():
    assert junit_key("tests/test_a.py::test_x") == ("tests.test_a", "test_x")
    assert junit_key("tests/test_a.py::TestK::test_m[a::b - c]") == ("tests.test_a.TestK", "test_m[a::b - c]")
    assert junit_key("t.py::test_p[[x]]") == ("t", "test_p[[x]]")


def test_reports_with_declarations_or_over_the_budget_are_refused(tmp_path: Path):
    (tmp_path / "a.xml").write_text('<!DOCTYPE x [<!ENTITY e "y">]><testsuites><testcase classname="c" name="n"/>'
                                    "</testsuites>")
    (tmp_path / "b.xml").write_text("<testsuites>" + "<testcase classname='c' name='m'/>" * 100 + "</testsuites>")
    report = read_reports(tmp_path, max_bytes=1000)
    assert report.num_files == 0 and len(report.problems) == 2 and report.statuses == {}


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
