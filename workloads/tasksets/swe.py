"""SWE-style task sets: JSONL rows in the SWE-bench shape, a workspace per execution, hidden-test grading.

A row (one JSON object a line; blank lines are skipped) is what SWE-bench, SWE-Gym and SWE-smith
publish, so their files load unchanged once the repositories are local:

- required: ``instance_id``, ``problem_statement`` (the prompt), ``repo`` (a local git repository
  or a tarball; a relative path resolves against the task file's folder, so SWE-bench's
  ``astropy/astropy`` finds a clone kept at ``<task file folder>/astropy/astropy``),
  ``base_commit``, ``FAIL_TO_PASS`` and ``PASS_TO_PASS`` (lists of test ids, or SWE-bench's
  strings holding a JSON list; FAIL_TO_PASS not empty);
- optional: ``test_cmd`` (a shell command that runs pytest, such as ``python -m pytest -q tests/``;
  default ``python -m pytest -q`` on the files of the test ids; the grader reads its JUnit report,
  never its output), ``test_patch`` (the hidden tests, a git-style diff applied at grading),
  ``setup_cmd`` (run once in the workspace template, in the sandbox), ``setup_network`` (true: the
  setup command may reach the network; default the task set's ``grading.setup_network``),
  ``environment`` (a folder, a virtualenv or prefix, every sandbox of the task sees read-only, its
  ``bin/`` first on ``PATH``; or an apptainer image ``.sif`` for ``sandbox=apptainer``; relative to the
  task file's folder; default the task set's ``grading.environment``), ``timeout_s`` (the grader's,
  instead of ``grader_timeout_s``), ``patch`` (the gold patch, used by ``python -m workloads.validate``);
- any other key (version, created_at, hints_text, environment_setup_commit, ...) is ignored.

A bad row stops the load with ``path:LINE: field: what is wrong`` (``TaskFileError``), and so does a
row the grader could not grade: with ``grading.runner: pytest``, every test id must be a pytest node
id (``path/to/test_file.py::name``, SWE-bench's Django rows name ``test_x (module.Class)`` and are
refused) and the test command must run pytest.

Workspaces. The first ``prepare`` of a task builds a template under
``<data_dir>/workspaces/<instance_id>-<hash>/``: the repository's tree at ``base_commit`` (or the
tarball's content), then a fresh ``git init`` with that tree as its one ``base`` commit, so the
agent can ``git diff`` but never sees the original repository or its later history (the fix);
then ``setup_cmd``, confined like a grader (no network unless the row says so). Every workspace is a ``cp -a --reflink=auto`` copy of the template. Templates
are built in a temporary folder and renamed into place, so threads and processes preparing the
same task race safely (the loser drops its copy). The template is also the base tree the grader
rebuilds hidden test files from.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import random
import re
import shlex
import shutil
import subprocess
import tarfile
import tempfile
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from workloads.api import GradeResult, ResourceLimits, RunArtifacts, Sandbox, SandboxSpec, Task
from workloads.config import WorkloadConfig
from workloads.graders.patches import PatchError, parse_patch
from workloads.graders.tests import Canary, GradeSetup, HiddenTests, grade_hidden_tests
from workloads.sandbox.run import run_confined

log = logging.getLogger(__name__)

DEFAULT_TEST_CMD = "python -m pytest -q"
PYTEST_NODE_ID = re.compile(r"^[^\s:\[][^:\[]*\.py::\S")
"""``file.py::name...``: what pytest reports a test as (the path's part holds no ``::`` or ``[``)."""
RUNS_PYTEST = re.compile(r"(?<![\w.-])(py\.test|pytest)(?![\w-])")
TEMPLATE_VERSION = "1"
"""Part of every template's folder name: bump it when the template layout changes."""
TARBALL_SUFFIXES = (".tar", ".tar.gz", ".tgz", ".tar.bz2", ".tbz2", ".tar.xz", ".txz")
BASE_COMMIT_ENV = {
    "GIT_AUTHOR_NAME": "gyre", "GIT_AUTHOR_EMAIL": "gyre@localhost", "GIT_AUTHOR_DATE": "2000-01-01T00:00:00+0000",
    "GIT_COMMITTER_NAME": "gyre", "GIT_COMMITTER_EMAIL": "gyre@localhost",
    "GIT_COMMITTER_DATE": "2000-01-01T00:00:00+0000",
    "GIT_CONFIG_NOSYSTEM": "1", "GIT_CONFIG_GLOBAL": os.devnull,
}
"""The workspace's one commit does not depend on who builds it or when."""
_UNSAFE_NAME_CHARS = re.compile(r"[^A-Za-z0-9._-]")


class TaskFileError(ValueError):
    """A task file row that cannot be loaded: ``path:LINE: field: what is wrong``."""


class WorkspaceError(RuntimeError):
    """A task's workspace template could not be built (bad base_commit, failing setup_cmd, ...)."""


@dataclass(frozen=True, kw_only=True)
class SweTask:
    instance_id: str
    problem_statement: str
    repo: Path
    """Absolute: a git repository (work tree or bare) or a tarball."""
    base_commit: str
    fail_to_pass: tuple[str, ...]
    pass_to_pass: tuple[str, ...]
    test_cmd: str
    test_patch: str
    setup_cmd: str
    timeout_s: float | None
    """The grader's timeout for this task; None: the workload's ``grader_timeout_s``."""
    patch: str
    """The gold patch ('' when the row has none)."""
    environment: Path | None = None
    """The row's own environment (a folder, or an apptainer image ending ``.sif``); None: the set's."""
    setup_network: bool | None = None
    """The row's own choice; None: the task set's ``grading.setup_network``."""

    @property
    def task_id(self) -> str:
        return self.instance_id

    @property
    def prompt(self) -> str:
        return self.problem_statement

    def hidden_tests(self, environment: Path | None = None) -> HiddenTests:
        """What the grader runs; ``environment``: the prefix the tests run with (None: the system's)."""
        return HiddenTests(task_id=self.instance_id, test_patch=self.test_patch, test_cmd=self.test_cmd,
                           fail_to_pass=self.fail_to_pass, pass_to_pass=self.pass_to_pass, environment=environment)


# ---------------------------------------------------------------- loading rows


def load_tasks(path: Path, *, runner: str = "pytest") -> list[SweTask]:
    """Every row of the JSONL file ``path``; the first bad row, or one ``runner`` cannot grade,
    raises ``TaskFileError``."""
    tasks: list[SweTask] = []
    first_line: dict[str, int] = {}
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise TaskFileError(f"{path}: cannot read the task file: {exc}") from exc
    for number, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        task = parse_row(line, base_dir=path.parent, where=f"{path}:{number}", runner=runner)
        if task.instance_id in first_line:
            raise TaskFileError(f"{path}:{number}: instance_id: {task.instance_id!r} repeats line "
                                f"{first_line[task.instance_id]}")
        first_line[task.instance_id] = number
        tasks.append(task)
    return tasks


def parse_row(line: str, *, base_dir: Path, where: str, runner: str = "pytest") -> SweTask:
    try:
        row = json.loads(line)
    except json.JSONDecodeError as exc:
        raise TaskFileError(f"{where}: row: not valid JSON: {exc}") from exc
    if not isinstance(row, dict):
        raise TaskFileError(f"{where}: row: want a JSON object, got {type(row).__name__}")

    def fail(name: str, what: str) -> TaskFileError:
        return TaskFileError(f"{where}: {name}: {what}")

    def text(name: str, *, required: bool) -> str:
        if name not in row or row[name] is None:
            if required:
                raise fail(name, "missing")
            return ""
        if not isinstance(row[name], str):
            raise fail(name, f"want a string, got {type(row[name]).__name__}")
        if required and not row[name].strip():
            raise fail(name, "empty")
        return row[name]

    instance_id = text("instance_id", required=True)
    fail_to_pass = _test_ids(row, "FAIL_TO_PASS", fail)
    if not fail_to_pass:
        raise fail("FAIL_TO_PASS", "want at least one test id (the tests the fix makes pass)")
    pass_to_pass = _test_ids(row, "PASS_TO_PASS", fail)
    test_patch = text("test_patch", required=False)
    try:
        parse_patch(test_patch)
    except PatchError as exc:
        raise fail("test_patch", str(exc)) from exc
    test_cmd = text("test_cmd", required=False) or default_test_cmd(fail_to_pass + pass_to_pass)
    _check_gradable(runner, fail_to_pass, pass_to_pass, test_cmd, fail)
    return SweTask(
        instance_id=instance_id,
        problem_statement=text("problem_statement", required=True),
        repo=_repo_path(text("repo", required=True), base_dir, fail),
        base_commit=text("base_commit", required=True).strip(),
        fail_to_pass=fail_to_pass,
        pass_to_pass=pass_to_pass,
        test_cmd=test_cmd,
        test_patch=test_patch,
        setup_cmd=text("setup_cmd", required=False),
        timeout_s=_timeout(row, fail),
        patch=text("patch", required=False),
        environment=_environment(text("environment", required=False), base_dir, fail),
        setup_network=_flag(row, "setup_network", fail),
    )


def _check_gradable(runner: str, fail_to_pass: tuple[str, ...], pass_to_pass: tuple[str, ...], test_cmd: str,
                    fail) -> None:
    """Refuse now a row every grading of which would fail: the grader reads ``runner``'s report only."""
    if runner != "pytest":
        raise fail("runner", f"no result reader for {runner!r} (the grader reads pytest's JUnit report)")
    for name, ids in (("FAIL_TO_PASS", fail_to_pass), ("PASS_TO_PASS", pass_to_pass)):
        for test_id in ids:
            if not PYTEST_NODE_ID.match(test_id):
                raise fail(name, f"{test_id!r} is not a pytest node id (path/to/test_file.py::name): the grader "
                                 "reads pytest's JUnit report, which names tests only so; rows of other runners "
                                 "(such as Django's `test_x (module.Class)`) need their ids converted")
    if not RUNS_PYTEST.search(test_cmd):
        raise fail("test_cmd", f"{test_cmd!r} does not run pytest, whose JUnit report the grader reads")


def _environment(raw: str, base_dir: Path, fail) -> Path | None:
    if not raw:
        return None
    path = (base_dir / raw).resolve()
    if raw.endswith(".sif"):
        if not path.is_file():
            raise fail("environment", f"no apptainer image at {path}")
        return path
    if not any((path / "bin" / name).exists() for name in ("python", "python3")):
        raise fail("environment", f"want a folder with bin/python (a virtualenv or prefix): {path}")
    return path


def _flag(row: dict[str, Any], name: str, fail) -> bool | None:
    value = row.get(name)
    if value is None or isinstance(value, bool):
        return value
    raise fail(name, f"want true or false, got {value!r}")


def _test_ids(row: dict[str, Any], name: str, fail) -> tuple[str, ...]:
    if name not in row:
        raise fail(name, "missing")
    value = row[name]
    if isinstance(value, str):  # SWE-bench stores the lists JSON-encoded
        try:
            value = json.loads(value)
        except json.JSONDecodeError as exc:
            raise fail(name, f"a string must hold a JSON list of test ids: {exc}") from exc
    if not isinstance(value, list) or not all(isinstance(t, str) and t.strip() for t in value):
        raise fail(name, f"want a list of non-empty test id strings, got {json.dumps(value)[:80]}")
    return tuple(value)


def _repo_path(raw: str, base_dir: Path, fail) -> Path:
    path = (base_dir / raw).resolve()
    is_work_tree = path.is_dir() and (path / ".git").exists()
    is_bare = (path / "HEAD").is_file() and (path / "objects").is_dir()
    if is_work_tree or is_bare:
        return path
    if path.is_file() and path.name.endswith(TARBALL_SUFFIXES):
        return path
    raise fail("repo", f"not a local git repository or tarball ({', '.join(TARBALL_SUFFIXES)}): {path}")


def _timeout(row: dict[str, Any], fail) -> float | None:
    value = row.get("timeout_s")
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise fail("timeout_s", f"want a number of seconds > 0, got {value!r}")
    return float(value)


def default_test_cmd(test_ids: tuple[str, ...]) -> str:
    """pytest with the ``-rA`` summary the grader parses, on the files the test ids name."""
    files = sorted({t.split("::", 1)[0] for t in test_ids if "::" in t})
    return " ".join([DEFAULT_TEST_CMD, *map(shlex.quote, files)])


# ---------------------------------------------------------------- the task set


class SweTaskSet:
    """``workloads.api.TaskSet`` over SWE-style JSONL rows (``cfg.task_file``, ``cfg.eval_task_file``)."""

    def __init__(self, cfg: WorkloadConfig, sandbox: Sandbox, *, grader_limits: ResourceLimits | None = None,
                 cgroups: Any = None):
        """``grader_limits``: what each test run may use; ``cgroups``: a ``CgroupSupport`` (None: rlimits only)."""
        if not cfg.task_file:
            raise ValueError("task_file: a swe task set needs a JSONL task file")
        if cfg.grading is None:
            raise ValueError("grading: a swe task set needs its grading settings")
        self.name = cfg.name
        self._cfg = cfg
        self._sandbox = sandbox
        self._setup = GradeSetup(sandbox=sandbox, grading=cfg.grading, reward=cfg.reward, limits=grader_limits,
                                 cgroups=cgroups)
        self._canary = Canary()
        self._default_env = _environment(cfg.grading.environment, Path.cwd(), _config_error)
        self._workspaces_dir = Path(cfg.data_dir).resolve() / "workspaces"
        self._train, self._eval = _split(cfg)
        self._locks: dict[Path, threading.Lock] = {}
        self._locks_guard = threading.Lock()

    def split(self) -> tuple[list[Task], list[Task]]:
        return list(self._train), list(self._eval)

    def prepare(self, task: Task, workspace: Path) -> None:
        """Copy the task's template (built on first use) to ``workspace``, which must not exist or be empty."""
        assert isinstance(task, SweTask)
        template = self.template(task)
        if workspace.exists():
            workspace.rmdir()  # an empty folder the caller made; anything else is an error
        workspace.parent.mkdir(parents=True, exist_ok=True)
        subprocess.run(["cp", "-a", "--reflink=auto", str(template), str(workspace)], check=True,
                       capture_output=True)

    def environment(self, task: Task) -> Path | None:
        """The task's read-only environment folder or image (the row's, else the set's)."""
        assert isinstance(task, SweTask)
        return task.environment or self._default_env

    def grade(self, task: Task, workspace: Path, run: RunArtifacts) -> GradeResult:
        assert isinstance(task, SweTask)
        try:
            template = self.template(task)
        except Exception as exc:
            return GradeResult(reward=None, error=f"{task.instance_id}: no template: {exc}")
        env = self.environment(task)
        tests = task.hidden_tests(env if env is not None and env.is_dir() else None)
        return grade_hidden_tests(tests, workspace=workspace, template=template, grade_dir=run.grade_dir,
                                  setup=self._setup, timeout_s=task.timeout_s or self._cfg.grader_timeout_s,
                                  canary=self._canary)

    def template(self, task: SweTask) -> Path:
        """The task's workspace template, built once (see the module docstring)."""
        final = self._workspaces_dir / f"{_UNSAFE_NAME_CHARS.sub('_', task.instance_id)}-{_template_key(task)}"
        if final.is_dir():
            return final
        with self._lock_for(final):  # one build per process; rename settles races between processes
            if final.is_dir():
                return final
            self._workspaces_dir.mkdir(parents=True, exist_ok=True)
            building = Path(tempfile.mkdtemp(prefix=f".{final.name}.", dir=self._workspaces_dir))
            log.info("%s: building the workspace template %s", task.instance_id, final)
            try:
                tree = _materialise(task, building)
                if task.setup_cmd:
                    self._run_setup(task, tree, building)
                try:
                    tree.rename(final)
                except OSError:
                    if not final.is_dir():
                        raise
                    log.info("%s: another process built the template first", task.instance_id)
            finally:
                shutil.rmtree(building, ignore_errors=True)
        return final

    def _run_setup(self, task: SweTask, tree: Path, building: Path) -> None:
        """The row's ``setup_cmd`` in the template being built, confined like a grader: the task
        author's command, but it builds what every agent then runs in, so it gets no network unless
        the task file says so, and the grader's limits."""
        network = task.setup_network if task.setup_network is not None else self._setup.grading.setup_network
        env_dir = self.environment(task)
        prefix = env_dir if env_dir is not None and env_dir.is_dir() else None
        home = building / "home"
        home.mkdir()
        path = f"{prefix}/bin:/usr/local/bin:/usr/bin:/bin" if prefix else "/usr/local/bin:/usr/bin:/bin"
        spec = SandboxSpec(argv=["/bin/sh", "-c", task.setup_cmd], workspace=tree, home=home,
                           env={"PATH": path, "HOME": str(home), "LANG": "C.UTF-8"}, network="host" if network else "none",
                           ro_paths=(prefix,) if prefix else (), limits=self._setup.limits,
                           image=str(env_dir) if env_dir is not None and env_dir.is_file() else "")
        timeout_s = task.timeout_s or self._cfg.grader_timeout_s
        ran = run_confined(self._sandbox, spec, timeout_s=timeout_s, output=building / "setup.log",
                           cgroups=self._setup.cgroups, cgroup_name=f"setup-{os.getpid()}-{threading.get_ident()}")
        if not ran.started:
            raise WorkspaceError(f"{task.instance_id}: setup_cmd: the sandbox did not start: {ran.output_tail[-500:]}")
        if ran.exit_code is None:
            raise WorkspaceError(f"{task.instance_id}: setup_cmd ran past {timeout_s:g}s")
        if ran.exit_code != 0:
            raise WorkspaceError(f"{task.instance_id}: setup_cmd exited {ran.exit_code}: {ran.output_tail.strip()[-500:]}")

    def _lock_for(self, path: Path) -> threading.Lock:
        with self._locks_guard:
            return self._locks.setdefault(path, threading.Lock())


def _split(cfg: WorkloadConfig) -> tuple[list[SweTask], list[SweTask]]:
    """(train, eval): eval from ``eval_task_file``, else ``num_eval_tasks`` rows held out by a
    shuffle seeded with ``task_seed``; train is the rest in file order. Both capped at their counts."""
    runner = cfg.grading.runner if cfg.grading is not None else "pytest"
    rows = load_tasks(Path(cfg.task_file), runner=runner)
    if cfg.eval_task_file:
        held_out = load_tasks(Path(cfg.eval_task_file), runner=runner)[:cfg.num_eval_tasks]
        eval_ids = {t.instance_id for t in held_out}
        both = [t.instance_id for t in rows if t.instance_id in eval_ids]
        if both:
            raise TaskFileError(f"{cfg.eval_task_file}: instance_id: also in task_file: {', '.join(both[:5])}")
        return rows[:cfg.num_train_tasks], held_out
    if not 0 <= cfg.num_eval_tasks < len(rows):
        raise ValueError(f"num_eval_tasks: {cfg.num_eval_tasks} leaves no training task of {len(rows)} rows")
    order = list(range(len(rows)))
    random.Random(cfg.task_seed).shuffle(order)
    eval_rows = set(order[:cfg.num_eval_tasks])
    held_out = [rows[i] for i in sorted(eval_rows)]
    train = [t for i, t in enumerate(rows) if i not in eval_rows]
    return train[:cfg.num_train_tasks], held_out


def _template_key(task: SweTask) -> str:
    # A commit names its own content; a tarball is named by its size and mtime.
    parts = [TEMPLATE_VERSION, str(task.repo), task.base_commit, task.setup_cmd]
    if task.repo.is_file():
        source = task.repo.stat()
        parts += [str(source.st_size), str(source.st_mtime_ns)]
    return hashlib.sha256("\0".join(parts).encode()).hexdigest()[:12]


def _materialise(task: SweTask, building: Path) -> Path:
    """``building/tree``: the base tree with a fresh one-commit git history."""
    tree = building / "tree"
    if task.repo.is_file():
        unpacked = building / "unpacked"
        unpacked.mkdir()
        with tarfile.open(task.repo) as archive:
            archive.extractall(unpacked, filter="data")  # no absolute paths, links out or devices
        entries = list(unpacked.iterdir())
        root = entries[0] if len(entries) == 1 and entries[0].is_dir() else unpacked
        if (root / ".git").exists():  # a packed repository: take base_commit from its history
            _checkout_tree(root, task.base_commit, tree, building)
        else:
            root.rename(tree)
    else:
        _checkout_tree(task.repo, task.base_commit, tree, building)
    shutil.rmtree(tree / ".git", ignore_errors=True)
    _git(tree, "init", "-q")
    _git(tree, "add", "-A", "-f")  # exactly the base tree, ignore rules notwithstanding
    _git(tree, "commit", "-q", "--no-verify", "--allow-empty", "-m", "base")
    return tree


def _checkout_tree(repo: Path, commit: str, tree: Path, building: Path) -> None:
    # read-tree + checkout-index, not `git archive`: archive honours export-ignore / export-subst
    # attributes, which some projects set on their tests. A private index leaves the repo untouched.
    git_dir = subprocess.run(["git", "-C", str(repo), "rev-parse", "--absolute-git-dir"], check=True,
                             capture_output=True, text=True).stdout.strip()
    tree.mkdir()
    env = {**os.environ, **BASE_COMMIT_ENV, "GIT_INDEX_FILE": str(building / "index")}
    base = ["git", f"--git-dir={git_dir}", f"--work-tree={tree}"]
    for args in (["read-tree", f"{commit}^{{tree}}"], ["checkout-index", "-a", "-f"]):
        done = subprocess.run(base + args, env=env, capture_output=True, text=True)
        if done.returncode != 0:
            raise WorkspaceError(f"{repo}: git {args[0]} {commit}: {done.stderr.strip()[-500:]}")


def _git(cwd: Path, *args: str) -> None:
    done = subprocess.run(["git", "-c", "commit.gpgsign=false", "-c", "core.autocrlf=false", *args], cwd=cwd,
                          env={**os.environ, **BASE_COMMIT_ENV}, capture_output=True, text=True)
    if done.returncode != 0:
        raise WorkspaceError(f"git {args[0]} in {cwd}: {done.stderr.strip()[-500:]}")


def _config_error(name: str, what: str) -> ValueError:
    return ValueError(f"grading.{name}: {what}")
