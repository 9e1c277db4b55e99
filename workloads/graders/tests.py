"""The hidden-test grader: the agent's patch, applied to a fresh copy of the template, tested there.

A policy under RL optimises whatever this grader rewards, so everything the agent left is
untrusted input. For one finished (or timed-out, or crashed) execution the grader:

1. takes the agent's change: the workspace's difference from the task's template, file by file
   (workloads/graders/agent_change.py; links and special files are never part of it);
2. drops what it must not trust (workloads/graders/trust.py: test files, runner configuration,
   import hooks, modules shadowing the runner, code reaching for the runner), recorded in
   ``grade.json``;
3. copies the template afresh, applies what is kept, writes the hidden tests (``test_patch``,
   rebuilt from the template) and a *tripwire*: a test with a random name that must fail;
4. runs the task's ``test_cmd`` there, in the sandbox with no network and the grader's limits,
   through the grader's own ``python``/``pytest`` (workloads/graders/pytest_runner.py): pytest
   imported before the tree is importable, the template's runner configuration (``-c``), no plugin
   autoload, no user site, a fresh ``HOME``;
5. reads each test's status from pytest's JUnit XML in a folder the agent never saw
   (workloads/graders/junit.py), never from the output.

Who caused an outcome decides whether it scores 0 or is excluded:

| outcome | reward |
| --- | --- |
| the tests ran and reported | 1 / 0 (``binary``) or the share passed (``fraction``) |
| a named test missing from the report, a test file that does not collect | that test failed |
| the tests ran past the timeout | 0 |
| the test process exited or crashed before writing its report | 0 |
| the tripwire did not fail (the report was rewritten) | 0 |
| the change is over the grader's size or file limits | 0 |
| the grader's sandbox did not start | None (excluded, counted) |
| the grader raised, or the template is missing | None |
| any reward below 1 when the canary fails | None |

The *canary* is the untouched template graded the same way (tripwire included): its PASS_TO_PASS
tests must pass. It runs only when a grade would be below 1, and a pass is trusted for
``grading.canary_ttl_s``; when it fails, the test environment itself is broken (pytest missing, a
node out of disk, a sandbox that cannot write), so the grade is excluded, never 0.

Layers, and what each cannot stop (docs/grading.md has the table per attack): the filter sees
files, so code that special-cases the tests' inputs or reaches the runner by a route no pattern
names passes it; the runner is imported first, but the code under test runs in the same process
afterwards and can still patch it; the tripwire catches results rewritten wholesale, not a rewrite
aimed at exactly the hidden tests (which the agent never sees). The sandbox keeps all of it inside
the fresh tree and the report folder, which are made for this grading alone.
"""

from __future__ import annotations

import difflib
import json
import logging
import secrets
import shlex
import shutil
import string
import subprocess
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from workloads.api import GradeResult, ResourceLimits, Sandbox, SandboxSpec
from workloads.config import GradingConfig
from workloads.graders.agent_change import AgentChange, FileChange, collect_change
from workloads.graders.junit import junit_key, read_reports
from workloads.graders.patches import PatchError, TreeWriter, apply_file_patches, parse_patch
from workloads.graders.trust import Dropped, filter_change
from workloads.sandbox.run import run_confined

log = logging.getLogger(__name__)

RewardMode = Literal["binary", "fraction"]
TestOutcome = Literal["reported", "timeout", "no_report", "tampered", "sandbox_failed"]

LOG_TAIL_CHARS = 4000
"""Characters of the test output kept in ``GradeResult.detail`` for the report (never parsed)."""
RUNNER_SOURCE = Path(__file__).with_name("pytest_runner.py")
SYSTEM_PYTHON = "/usr/bin/python3"
SYSTEM_PATH = "/usr/local/bin:/usr/bin:/bin"
PASSING = ("passed", "xfailed")
"""As SWE-bench: an expected failure that fails counts as passed."""
PYTEST_CONFIG_FILES = ("pytest.ini", ".pytest.ini", "pyproject.toml", "tox.ini", "setup.cfg")
"""pytest's own order of the files it takes its configuration from (``_pytest/config/findpaths.py``)."""


@dataclass(frozen=True, kw_only=True)
class HiddenTests:
    """What the grader needs of a task (workloads/tasksets/swe.py builds it from a task row)."""

    task_id: str
    test_patch: str
    """A unified diff (git style, ``a/`` and ``b/`` prefixes); '' when the tests are in the repo."""
    test_cmd: str
    """A shell command run in the fresh tree that runs pytest (its report is the grader's)."""
    fail_to_pass: tuple[str, ...]
    pass_to_pass: tuple[str, ...]
    environment: Path | None = None
    """A read-only prefix (a venv) whose ``bin/python`` runs the tests; None: the system's python3."""

    @property
    def test_ids(self) -> tuple[str, ...]:
        return tuple(dict.fromkeys(self.fail_to_pass + self.pass_to_pass))

    @property
    def python(self) -> str:
        if self.environment is None:
            return SYSTEM_PYTHON
        for name in ("python", "python3"):
            if (self.environment / "bin" / name).exists():
                return str(self.environment / "bin" / name)
        return str(self.environment / "bin" / "python")


@dataclass(frozen=True, kw_only=True)
class GradeSetup:
    """How a task set grades: its sandbox and settings (the same for every task of the set)."""

    sandbox: Sandbox
    grading: GradingConfig
    reward: RewardMode
    limits: ResourceLimits | None = None
    cgroups: Any = None
    """A ``workloads.sandbox.cgroups.CgroupSupport`` (None: rlimits only)."""


@dataclass
class TestRun:
    outcome: TestOutcome
    statuses: dict[str, str] = field(default_factory=dict)
    """Expected test id -> status, for ids the report named."""
    collection_errors: list[str] = field(default_factory=list)
    exit_code: int | None = None
    elapsed_s: float = 0.0
    log_tail: str = ""
    why: str = ""
    limits_hit: dict[str, int] = field(default_factory=dict)


# ---------------------------------------------------------------- grading one execution


def grade_hidden_tests(tests: HiddenTests, *, workspace: Path, template: Path, grade_dir: Path, setup: GradeSetup,
                       timeout_s: float, canary: Canary) -> GradeResult:
    """Grade ``workspace``'s change against ``template`` (see the module docstring). Never raises."""
    started = time.monotonic()
    try:
        if not template.is_dir():
            return GradeResult(reward=None, error=f"{tests.task_id}: template missing: {template}")
        if not workspace.is_dir():  # nothing the agent could have removed: the execution folder is ours
            return GradeResult(reward=None, error=f"{tests.task_id}: workspace missing: {workspace}")
        grade_dir.mkdir(parents=True, exist_ok=True)
        g = setup.grading
        change = collect_change(workspace, template, max_file_bytes=g.max_file_bytes, max_entries=g.max_change_files)
        rebuilt = {fp.new_path or fp.old_path for fp in parse_patch(tests.test_patch)}
        kept, dropped = filter_change(change.files, g, template=template, rebuilt=rebuilt)  # type: ignore[arg-type]
        detail: dict[str, Any] = {
            "kept": [f"{c.kind} {c.path}" for c in kept],
            "dropped": [{"path": d.path, "why": d.why} for d in dropped]
            + [{"path": r.path, "why": r.why} for r in change.refused],
        }
        _write_patch(grade_dir / "patch.diff", kept, template)
        too_big = _over_limits(change, kept, g)
        if too_big:
            return _final(tests, GradeResult(reward=0.0, detail={**detail, "outcome": "oversize_change",
                                                                 "why": too_big}), started)
        run = run_tests(tests, kept, template=template, folder=grade_dir / "run", setup=setup, timeout_s=timeout_s)
        value, passed, failed = score(tests, run, setup.reward)
        detail.update(outcome=run.outcome, passed=passed, failed=failed, exit_code=run.exit_code,
                      collection_errors=run.collection_errors, test_s=round(run.elapsed_s, 3),
                      log_tail=run.log_tail[-LOG_TAIL_CHARS:], limits_hit=run.limits_hit)
        if run.why:
            detail["why"] = run.why
        if value is None:
            return _final(tests, GradeResult(reward=None, detail=detail, error=f"{tests.task_id}: {run.why}"), started)
        if value < 1.0:
            ok, why, age_s = canary.check(tests, template=template, scratch=grade_dir / "canary", setup=setup,
                                          timeout_s=timeout_s)
            detail["canary"] = {"ok": ok, "age_s": round(age_s, 1), **({"why": why} if why else {})}
            if not ok:
                return _final(tests, GradeResult(reward=None, detail=detail, error=(
                    f"{tests.task_id}: the canary failed ({why}): the test environment is broken, so this "
                    f"{run.outcome} grade is not the agent's")), started)
        return _final(tests, GradeResult(reward=value, detail=detail), started)
    except Exception as exc:  # a grader bug must exclude the execution, not score it 0
        log.exception("%s: grader raised", tests.task_id)
        return GradeResult(reward=None, error=f"{tests.task_id}: grader raised {type(exc).__name__}: {exc}")
    finally:
        shutil.rmtree(grade_dir / "run" / "tree", ignore_errors=True)
        shutil.rmtree(grade_dir / "canary", ignore_errors=True)


def _final(tests: HiddenTests, result: GradeResult, started: float) -> GradeResult:
    result.detail["grade_s"] = round(time.monotonic() - started, 3)
    return result


def _over_limits(change: AgentChange, kept: list[FileChange], g: GradingConfig) -> str:
    if change.overflow:
        return change.overflow
    if len(kept) > g.max_change_files:
        return f"{len(kept)} files changed, over grading.max_change_files {g.max_change_files}"
    size = sum(len(c.data) for c in kept)
    if size > g.max_change_bytes:
        return f"{size} bytes changed, over grading.max_change_bytes {g.max_change_bytes}"
    return ""


def score(tests: HiddenTests, run: TestRun, reward: RewardMode) -> tuple[float | None, list[str], list[str]]:
    """(reward, or None for the grader's own failure; passed ids; failed ids)."""
    if run.outcome == "sandbox_failed":
        return None, [], list(tests.test_ids)
    passed = [t for t in tests.test_ids if run.statuses.get(t) in PASSING] if run.outcome == "reported" else []
    failed = [t for t in tests.test_ids if t not in passed]
    if run.outcome != "reported":
        return 0.0, passed, failed
    if reward == "binary":
        return float(not failed), passed, failed
    return len(passed) / len(tests.test_ids), passed, failed


# ---------------------------------------------------------------- one test run in a fresh tree


def run_tests(tests: HiddenTests, change: list[FileChange], *, template: Path, folder: Path, setup: GradeSetup,
              timeout_s: float) -> TestRun:
    """Build ``folder/tree`` (template + ``change`` + hidden tests + tripwire), run the tests there."""
    shutil.rmtree(folder, ignore_errors=True)
    tree, ro, home = folder / "tree", folder / "ro", folder / "home"
    report_dir = home / "report"
    for d in (ro / "bin", report_dir):
        d.mkdir(parents=True)
    _copy_tree(template, tree)
    with TreeWriter(tree) as out:
        for c in change:
            if c.kind == "deleted":
                out.remove(c.path)
            else:
                out.write(c.path, c.data, 0o755 if c.executable else 0o644)
    apply_file_patches(parse_patch(tests.test_patch), tree=tree, base_tree=template)
    g = setup.grading
    tripwire = _plant_tripwire(tests, tree) if g.tripwire else ""
    env = _environment(tests, g, tree=tree, ro=ro, home=home, report_dir=report_dir, template=template)
    ro_paths = (ro, *([tests.environment] if tests.environment is not None else ()))
    spec = SandboxSpec(argv=["/bin/sh", "-c", tests.test_cmd], workspace=tree, env=env, home=home, ro_paths=ro_paths,
                       network="none", limits=setup.limits)
    ran = run_confined(setup.sandbox, spec, timeout_s=timeout_s, output=folder / "output.log", cgroups=setup.cgroups,
                       cgroup_name=f"grade-{secrets.token_hex(6)}")
    run = TestRun(outcome="reported", exit_code=ran.exit_code, elapsed_s=ran.elapsed_s, log_tail=ran.output_tail,
                  limits_hit=ran.limits_hit)
    if not ran.started:
        run.outcome, run.why = "sandbox_failed", f"the grader's sandbox did not start: {ran.output_tail[-300:].strip()}"
        return run
    if ran.exit_code is None:
        run.outcome, run.why = "timeout", f"the tests ran past the grader's timeout of {timeout_s:g}s"
        return run
    report = read_reports(report_dir, max_bytes=g.max_report_bytes)
    if report.num_files == 0:
        run.outcome = "no_report"
        run.why = (f"the test process ended (exit {ran.exit_code}) without writing a report"
                   + (f"; refused: {'; '.join(report.problems)}" if report.problems else ""))
        return run
    run.collection_errors = report.collection_errors
    run.statuses = {t: report.statuses[junit_key(t)] for t in tests.test_ids if junit_key(t) in report.statuses}
    if tripwire:
        status = report.statuses.get(junit_key(tripwire), "missing")
        if status != "failed":
            run.outcome = "tampered"
            run.why = f"the tripwire test {tripwire} must fail and is {status}: the report was rewritten"
    return run


def _copy_tree(template: Path, tree: Path) -> None:
    subprocess.run(["cp", "-a", "--reflink=auto", str(template), str(tree)], check=True, capture_output=True)


def _plant_tripwire(tests: HiddenTests, tree: Path) -> str:
    """Append a test that must fail to the file of the first FAIL_TO_PASS test; its node id."""
    target = tests.fail_to_pass[0].split("::", 1)[0]
    path = tree / target
    if not path.is_file() or path.is_symlink():
        return ""  # the test file is not there: nothing of the task can pass either
    name = "test_" + "".join(secrets.choice(string.ascii_lowercase) for _ in range(10))
    text = path.read_bytes()
    text += b"" if text.endswith(b"\n") or not text else b"\n"
    text += f"\n\ndef {name}():\n    assert False, {name!r}\n".encode()
    with TreeWriter(tree) as out:
        out.write(target, text, path.stat().st_mode)
    return f"{target}::{name}"


def _environment(tests: HiddenTests, g: GradingConfig, *, tree: Path, ro: Path, home: Path, report_dir: Path,
                 template: Path) -> dict[str, str]:
    env_bin = f"{tests.environment}/bin:" if tests.environment is not None else ""
    env = {"PATH": f"{env_bin}{SYSTEM_PATH}", "HOME": str(home), "LANG": "C.UTF-8", "PYTHONDONTWRITEBYTECODE": "1",
           "PYTHONHASHSEED": "0"}
    fallback_report = shlex.quote(f"--junitxml={report_dir}/junit-addopts.xml")
    if not g.isolate_runner:  # the tests' own pytest, the tree's configuration: only the report is ours
        env["PYTEST_ADDOPTS"] = f"{fallback_report} -p no:cacheprovider"
        shim = ro / "bin" / "python"  # a plain `python` still means the task's interpreter (Debian has none)
        shim.write_text(f'#!/bin/sh\nexec {shlex.quote(tests.python)} "$@"\n')
        shim.chmod(0o755)
        env["PATH"] = f"{ro / 'bin'}:{env['PATH']}"
        return env
    ini = _runner_config(template, ro)
    shutil.copyfile(RUNNER_SOURCE, ro / "pytest_runner.py")
    settings = ro / "runner.json"
    settings.write_text(json.dumps({"report_dir": str(report_dir), "ini": str(ini), "rootdir": str(tree),
                                    "isolate": True}))
    run_pytest = f'exec {shlex.quote(tests.python)} -s -B {shlex.quote(str(ro / "pytest_runner.py"))} {shlex.quote(str(settings))} "$@"'
    shims = {
        "python": f'if [ "$1" = -m ] && {{ [ "$2" = pytest ] || [ "$2" = py.test ]; }}; then shift 2; {run_pytest}; fi\n'
                  f'exec {shlex.quote(tests.python)} "$@"',
        "pytest": run_pytest,
    }
    shims["python3"], shims["py.test"] = shims["python"], shims["pytest"]
    for name, body in shims.items():
        shim = ro / "bin" / name
        shim.write_text(f"#!/bin/sh\n# The grader's {name}: pytest runs through its runner (pytest_runner.py).\n{body}\n")
        shim.chmod(0o755)
    env.update({
        "PATH": f"{ro / 'bin'}:{env['PATH']}", "PYTHONNOUSERSITE": "1", "PYTEST_DISABLE_PLUGIN_AUTOLOAD": "1",
        # For a test_cmd that calls an interpreter by its full path: the same options, from pytest's own variable.
        "PYTEST_ADDOPTS": " ".join(["-c", shlex.quote(str(ini)), shlex.quote(f"--rootdir={tree}"),
                                    "-p no:cacheprovider", fallback_report]),
    })
    return env


def _runner_config(template: Path, ro: Path) -> Path:
    """The template's own pytest configuration, copied where the test process cannot write (the
    first file pytest would take at the tree's root), or an empty ``pytest.ini``."""
    for name in PYTEST_CONFIG_FILES:
        source = template / name
        if not source.is_file() or source.is_symlink():
            continue
        text = source.read_text("utf-8", errors="replace")
        holds = {"pyproject.toml": "[tool.pytest.ini_options]", "tox.ini": "[pytest]", "setup.cfg": "[tool:pytest]"}
        if name in holds and holds[name] not in text:
            continue
        shutil.copyfile(source, ro / name)
        return ro / name
    (ro / "pytest.ini").write_text("[pytest]\n")
    return ro / "pytest.ini"


def _write_patch(path: Path, kept: list[FileChange], template: Path) -> None:
    """The kept change as a unified diff (for people; the grader applies the files themselves)."""
    chunks: list[str] = []
    for c in kept:
        old_path = template / c.path
        old = old_path.read_bytes() if c.kind != "added" and old_path.is_file() else b""
        new = c.data if c.kind != "deleted" else b""
        try:
            a, b = old.decode("utf-8").splitlines(True), new.decode("utf-8").splitlines(True)
        except UnicodeDecodeError:
            chunks.append(f"Binary files a/{c.path} and b/{c.path} differ\n")
            continue
        chunks.extend(difflib.unified_diff(a, b, f"a/{c.path}" if c.kind != "added" else "/dev/null",
                                           f"b/{c.path}" if c.kind != "deleted" else "/dev/null"))
    path.write_text("".join(chunks), encoding="utf-8")


# ---------------------------------------------------------------- the canary


class Canary:
    """Whether the test environment works, per task: the untouched template's tests, graded the
    same way, pass their PASS_TO_PASS (with none, report every FAIL_TO_PASS) and trip the tripwire.
    A pass is remembered for ``grading.canary_ttl_s``; a failure is never remembered."""

    def __init__(self) -> None:
        self._passed_at: dict[str, float] = {}
        self._locks: dict[str, threading.Lock] = {}
        self._guard = threading.Lock()

    def check(self, tests: HiddenTests, *, template: Path, scratch: Path, setup: GradeSetup,
              timeout_s: float) -> tuple[bool, str, float]:
        """(ok, why not, seconds since the canary that vouches for this grade ran)."""
        with self._guard:
            lock = self._locks.setdefault(tests.task_id, threading.Lock())
        with lock:  # one canary per task at a time: the others wait for its verdict
            at = self._passed_at.get(tests.task_id)
            if at is not None and time.monotonic() - at <= setup.grading.canary_ttl_s:
                return True, "", time.monotonic() - at
            try:
                run = run_tests(tests, [], template=template, folder=scratch, setup=setup, timeout_s=timeout_s)
            finally:
                shutil.rmtree(scratch, ignore_errors=True)
            why = canary_problem(tests, run)
            if not why:
                self._passed_at[tests.task_id] = time.monotonic()
            return not why, why, 0.0


def canary_problem(tests: HiddenTests, run: TestRun) -> str:
    if run.outcome != "reported":
        return run.why or run.outcome
    if tests.pass_to_pass:
        broken = [t for t in tests.pass_to_pass if run.statuses.get(t) not in PASSING]
        return f"PASS_TO_PASS tests not passing on the untouched template: {broken[:5]}" if broken else ""
    missing = [t for t in tests.fail_to_pass if t not in run.statuses]
    return f"tests not reported on the untouched template: {missing[:5]}" if missing else ""


__all__ = ["Canary", "GradeSetup", "HiddenTests", "PatchError", "TestRun", "Dropped", "grade_hidden_tests",
           "run_tests", "score"]
