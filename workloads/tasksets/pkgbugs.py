"""The bundled task set ``pkgbugs``: bugs planted in a real package, graded by that package's own tests.

``generate(data_dir)`` writes, deterministically and offline,

- ``<data_dir>/pkgbugs/repos/<instance_id>/``: a bare git repository per task. Its first commit
  (the task's ``base_commit``) is the package's sdist with one bug planted in its source and its
  test file(s) without the tests that catch the bug, so the visible tests pass; its second commit,
  HEAD, is the future a workspace never shows: the fix and the full test suite;
- ``<data_dir>/pkgbugs/tasks.jsonl``: one row per task in the format workloads/tasksets/swe.py
  loads, with the gold ``patch`` (source only), ``test_patch`` (restores the full test files),
  ``FAIL_TO_PASS`` / ``PASS_TO_PASS`` as exact pytest node ids, and the package's plain
  ``test_cmd`` (``python -m pytest -q test_inflection.py``): the shape of users' own rows, which
  carry no ``-rA`` summary, so these tasks grade only through pytest's JUnit XML;
- ``<data_dir>/pkgbugs/STAMP``: the generator version; a different or missing stamp regenerates.

The package and its bugs are data (workloads/tasksets/pkgbugs_inflection.py); the sdist ships in
workloads/tasksets/sources/. Which tests are FAIL_TO_PASS and which PASS_TO_PASS is measured, not
labelled: the suite really runs under ``/usr/bin/python3 -m pytest`` on the correct and the buggy
package, and outcomes are read from ``--junitxml``, where a small plugin adds each test's node id
and parameters. Ids are pytest's own, kept verbatim: brackets, spaces and quotes as they are, and
non-ASCII parameters as pytest escapes them (``test_titleize[ana \\xedndia-Ana \\xcdndia]``). A
test is hidden from the base by deleting its row of a literal parameter table, else its whole
function. A test failing on the correct package, a bug no test catches, or a base whose visible
tests do not all pass stops the generator with an AssertionError naming it. The problem statement
reports what one or two calls return with the bug and what they should (both evaluated), never the
fix. The generator is trusted code: it runs the package's tests unconfined, but needs no network.
Repositories are written by pyfix's git object writer, so their hashes are fixed too.
"""

from __future__ import annotations

import ast
import functools
import hashlib
import json
import os
import random
import re
import shlex
import shutil
import subprocess
import tarfile
import tempfile
import types
import xml.etree.ElementTree as ET
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from workloads.tasksets.pkgbugs_inflection import INFLECTION, Bug, Package
from workloads.tasksets.pyfix import _diff, _write_repository

GENERATOR_VERSION = "1"
"""Bump on any change to what ``generate`` writes: existing data dirs then regenerate."""
PACKAGE = INFLECTION
SOURCES_DIR = Path(__file__).resolve().parent / "sources"
PYTHON = "/usr/bin/python3"
"""The interpreter the sandbox shows (Debian's, with python3-pytest): the one the tests are measured on."""
RUN_TIMEOUT_S = 120.0
_COMMIT_EPOCHS = (1704110400, 1704715200)
"""2024-01-01 and 2024-01-08, 12:00 UTC: fixed dates give every base_commit the same hash everywhere."""
_PLUGIN_NAME = "_pkgbugs_ids"
_PLUGIN = '''"""Writes each test's node id and parameters into pytest's JUnit XML as a property."""
import json


def pytest_collection_modifyitems(items):
    for item in items:
        callspec = getattr(item, "callspec", None)
        params = None if callspec is None else {k: repr(v) for k, v in callspec.params.items()}
        # JSON keeps the value ASCII, so JUnit's XML escaping cannot alter it.
        item.user_properties.append(("pkgbugs", json.dumps({"nodeid": item.nodeid, "params": params})))
'''


@dataclass(frozen=True)
class _Result:
    outcome: str
    """``passed``, ``failure``, ``error`` or ``skipped``."""
    params: dict[str, str] | None
    """Parametrized tests: argument name -> repr of its value."""


@dataclass(frozen=True)
class _Run:
    results: dict[str, _Result]
    """Node id -> result, every collected test."""
    errors: tuple[str, ...]
    """JUnit entries that are no test (a file that failed to collect)."""


def task_file(data_dir: str | Path) -> Path:
    return Path(data_dir) / "pkgbugs" / "tasks.jsonl"


def generate(data_dir: str | Path) -> Path:
    """Write the task set under ``data_dir/pkgbugs`` unless its stamp is current; the task file's path.

    Built in a temporary folder and renamed into place, so concurrent callers never see half a set.
    """
    target = Path(data_dir) / "pkgbugs"
    stamp = target / "STAMP"
    if stamp.is_file() and stamp.read_text() == GENERATOR_VERSION:
        target.chmod(0o700)  # gold patches and hidden tests: the run user's alone, whatever umask made it
        return target / "tasks.jsonl"
    Path(data_dir).mkdir(parents=True, exist_ok=True)
    building = Path(tempfile.mkdtemp(prefix=".pkgbugs.", dir=data_dir))
    try:
        _write_task_set(building, PACKAGE)
        (building / "STAMP").write_text(GENERATOR_VERSION)
        if target.exists():
            stale = Path(tempfile.mkdtemp(prefix=".pkgbugs-stale.", dir=data_dir))
            target.rename(stale / "pkgbugs")
            shutil.rmtree(stale, ignore_errors=True)
        try:
            building.rename(target)
        except OSError:
            if not (stamp.is_file() and stamp.read_text() == GENERATOR_VERSION):
                raise  # not a concurrent generator that finished first
    finally:
        shutil.rmtree(building, ignore_errors=True)
    return target / "tasks.jsonl"


def _write_task_set(root: Path, package: Package) -> None:
    files = _unpack(package)
    ids = [f"pkgbugs__{package.name}-{number}" for number in range(1, len(package.bugs) + 1)]
    buggy = [_plant(files, package, bug, instance_id) for bug, instance_id in zip(package.bugs, ids)]
    with tempfile.TemporaryDirectory(prefix="pkgbugs-runs.") as scratch:
        run = functools.partial(_run_tests, test_files=package.test_files, scratch=Path(scratch))
        correct = run(files)
        if correct.errors:
            raise AssertionError(f"{package.sdist}: the correct package's tests do not collect: {correct.errors}")
        failing = [i for i, r in correct.results.items() if r.outcome in ("failure", "error")]
        if failing:
            raise AssertionError(f"{package.sdist}: {failing[0]} fails on the correct package")
        # The runs are separate processes: a few at once, results in bug order whatever finishes first.
        with ThreadPoolExecutor(min(4, os.cpu_count() or 1)) as pool:
            splits = [_split(instance_id, correct, measured)
                      for instance_id, measured in zip(ids, pool.map(run, buggy))]
            bases = [{**tree, **_visible_tests(tree, package, correct, fail_to_pass)}
                     for tree, (fail_to_pass, _) in zip(buggy, splits)]
            for instance_id, visible, split in zip(ids, pool.map(run, bases), splits):
                _check_visible(instance_id, visible, *split)
    rows = [_write_task(root / "repos" / instance_id, instance_id, package, bug, files, base, split)
            for instance_id, bug, base, split in zip(ids, package.bugs, bases, splits)]
    with open(root / "tasks.jsonl", "w", encoding="utf-8", newline="\n") as f:
        for row in rows:
            f.write(json.dumps(row, sort_keys=True) + "\n")


def _write_task(repo: Path, instance_id: str, package: Package, bug: Bug, files: dict[str, str],
                base: dict[str, str], split: tuple[list[str], list[str]]) -> dict[str, Any]:
    fail_to_pass, pass_to_pass = split
    subject = _subject(bug)
    base_commit, _ = _write_repository(repo, [
        (base, f"Import {package.sdist.removesuffix('.tar.gz')}", _COMMIT_EPOCHS[0]),
        (files, f"Fix {subject} ({bug.kind}) and test it", _COMMIT_EPOCHS[1]),
    ])
    patch = _diff(package.source_path, base[package.source_path], files[package.source_path])
    statement = _problem_statement(instance_id, package, bug, base[package.source_path], files[package.source_path])
    added = [line[1:].strip() for line in patch.splitlines()
             if line.startswith("+") and not line.startswith("+++") and line[1:].strip()]
    if any(line in statement for line in added):
        raise AssertionError(f"{instance_id}: the problem statement gives away the fix")
    return {
        "instance_id": instance_id,
        "repo": f"repos/{instance_id}",
        "base_commit": base_commit,
        "problem_statement": statement,
        "FAIL_TO_PASS": fail_to_pass,
        "PASS_TO_PASS": pass_to_pass,
        "patch": patch,
        "test_patch": "".join(_diff(path, base[path], files[path]) for path in package.test_files
                              if base[path] != files[path]),
        "test_cmd": shlex.join(["python", "-m", "pytest", "-q", *package.test_files]),
        "package": package.sdist.removesuffix(".tar.gz"),
        "bug_kind": bug.kind,
        "version": GENERATOR_VERSION,
    }


# ---------------------------------------------------------------- the package and its bugs


def _unpack(package: Package) -> dict[str, str]:
    """The sdist's files (path under its root folder -> text), less ``package.dropped``."""
    sdist = SOURCES_DIR / package.sdist
    digest = hashlib.sha256(sdist.read_bytes()).hexdigest()
    if digest != package.sdist_sha256:
        raise AssertionError(f"{sdist}: sha256 {digest}, want {package.sdist_sha256}")
    files: dict[str, str] = {}
    with tarfile.open(sdist) as archive:
        for member in sorted(archive.getmembers(), key=lambda m: m.name):
            _root, _, path = member.name.partition("/")
            if not member.isfile() or set(path.split("/")) & set(package.dropped):
                continue
            files[path] = archive.extractfile(member).read().decode("utf-8")
    for path in (package.source_path, *package.test_files):
        if not files.get(path, "").endswith("\n"):
            raise AssertionError(f"{sdist}: {path} is missing or does not end in a newline")
    return files


def _plant(files: dict[str, str], package: Package, bug: Bug, instance_id: str) -> dict[str, str]:
    source = files[package.source_path]
    if source.count(bug.correct) != 1:
        raise AssertionError(f"{instance_id}: bug text must occur once in {package.source_path}: {bug.correct!r}")
    changed = [pair for pair in zip(bug.correct.split("\n"), bug.buggy.split("\n")) if pair[0] != pair[1]]
    if len(changed) != 1 or bug.correct.count("\n") != bug.buggy.count("\n"):
        raise AssertionError(f"{instance_id}: a bug changes exactly one line: {bug.buggy!r}")
    return {**files, package.source_path: source.replace(bug.correct, bug.buggy)}


def _split(instance_id: str, correct: _Run, buggy: _Run) -> tuple[list[str], list[str]]:
    """(FAIL_TO_PASS, PASS_TO_PASS): the tests passing on the correct package that do / do not fail on the buggy one."""
    passing = sorted(i for i, r in correct.results.items() if r.outcome == "passed")
    still_passing = {i for i, r in buggy.results.items() if r.outcome == "passed"}  # a test gone missing is caught
    fail_to_pass = [i for i in passing if i not in still_passing]
    if not fail_to_pass:
        raise AssertionError(f"{instance_id}: no test catches the bug")
    return fail_to_pass, [i for i in passing if i in still_passing]


def _check_visible(instance_id: str, visible: _Run, fail_to_pass: list[str], pass_to_pass: list[str]) -> None:
    if visible.errors:
        raise AssertionError(f"{instance_id}: the visible tests do not collect: {visible.errors}")
    shown = set(visible.results)
    if shown & set(fail_to_pass) or not shown <= set(pass_to_pass):
        raise AssertionError(f"{instance_id}: the visible tests show {sorted(shown - set(pass_to_pass))[:3]}")
    failing = [i for i, r in visible.results.items() if r.outcome != "passed"]
    if failing:
        raise AssertionError(f"{instance_id}: visible test {failing[0]} does not pass on the base")


# ---------------------------------------------------------------- running the package's tests


def _run_tests(files: dict[str, str], *, test_files: tuple[str, ...], scratch: Path) -> _Run:
    """Run ``test_files`` of the tree ``files`` under ``PYTHON -m pytest``; what its JUnit XML says."""
    run_dir = Path(tempfile.mkdtemp(dir=scratch))
    try:
        tree, plugin_dir = run_dir / "tree", run_dir / "plugin"
        plugin_dir.mkdir()
        (plugin_dir / f"{_PLUGIN_NAME}.py").write_text(_PLUGIN)
        for path, text in files.items():
            (tree / path).parent.mkdir(parents=True, exist_ok=True)
            (tree / path).write_text(text, encoding="utf-8")
        # A fixed hash seed and no auto-loaded plugins: the same outcomes on every machine.
        env = {"PATH": "/usr/local/bin:/usr/bin:/bin", "LC_ALL": "C.UTF-8", "PYTHONHASHSEED": "0",
               "PYTHONDONTWRITEBYTECODE": "1", "PYTEST_DISABLE_PLUGIN_AUTOLOAD": "1", "PYTHONPATH": str(plugin_dir)}
        junit = run_dir / "junit.xml"
        command = [PYTHON, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", _PLUGIN_NAME,
                   f"--junitxml={junit}", *test_files]
        done = subprocess.run(command, cwd=tree, env=env, capture_output=True, text=True, timeout=RUN_TIMEOUT_S)
        if not junit.is_file():
            raise AssertionError(f"{PYTHON} -m pytest wrote no JUnit XML (exit {done.returncode}): "
                                 f"{(done.stdout + done.stderr).strip()[-500:]}")
        return _read_junit(junit)
    finally:
        shutil.rmtree(run_dir, ignore_errors=True)


def _read_junit(path: Path) -> _Run:
    results: dict[str, _Result] = {}
    errors: list[str] = []
    for case in ET.parse(path).iter("testcase"):
        labels = [p.get("value", "") for p in case.iter("property") if p.get("name") == "pkgbugs"]
        outcome = next((tag for tag in ("error", "failure", "skipped") if case.find(tag) is not None), "passed")
        if not labels:
            errors.append(f"{case.get('classname')}::{case.get('name')}: {outcome}")
            continue
        label = json.loads(labels[0])
        nodeid = label["nodeid"]
        # A grader reading JUnit XML knows a test by classname and name: they must spell its node id.
        if (case.get("classname"), case.get("name")) != _junit_names(nodeid):
            raise AssertionError(f"{nodeid}: JUnit XML names it {case.get('classname')!r} {case.get('name')!r}")
        if nodeid not in results or outcome != "passed":  # a teardown error is a second entry
            results[nodeid] = _Result(outcome, label["params"])
    return _Run(results, tuple(errors))


def _junit_names(nodeid: str) -> tuple[str, str]:
    """(classname, name) that pytest's JUnit XML gives the test ``nodeid`` (its ``mangle_test_address``)."""
    path, bracket, params = nodeid.partition("[")
    names = path.split("::")
    names[0] = re.sub(r"\.py$", "", names[0].replace("/", "."))
    return ".".join(names[:-1]), names[-1] + bracket + params


# ---------------------------------------------------------------- hiding the tests that catch the bug


def _visible_tests(files: dict[str, str], package: Package, correct: _Run, fail_to_pass: list[str]) -> dict[str, str]:
    """Each test file without the FAIL_TO_PASS tests: their rows of a parameter table, or whole functions."""
    visible = {}
    for path in package.test_files:
        hidden = [(i, correct.results[i]) for i in fail_to_pass if i.split("::", 1)[0] == path]
        visible[path] = _hide(files[path], path, hidden) if hidden else files[path]
    return visible


def _hide(text: str, path: str, hidden: list[tuple[str, _Result]]) -> str:
    tree = ast.parse(text)
    functions = {n.name: n for n in tree.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))}
    tables = {n.targets[0].id: n.value for n in tree.body
              if isinstance(n, ast.Assign) and len(n.targets) == 1 and isinstance(n.targets[0], ast.Name)}
    targets: list[tuple[ast.FunctionDef | ast.AsyncFunctionDef, tuple[Any, ast.expr] | None]] = []
    for nodeid, result in hidden:
        name = nodeid.split("::", 1)[1].partition("[")[0]
        if "::" in name or name not in functions:
            raise AssertionError(f"{nodeid}: only module-level test functions of {path} can be hidden")
        targets.append((functions[name], _parameter_row(functions[name], tables, result.params)))
    hidden_rows: dict[int, set[int]] = {}
    for _, found in targets:
        if found is not None:
            hidden_rows.setdefault(id(found[0]), set()).add(id(found[1]))
    lines = text.splitlines(keepends=True)
    drop: set[int] = set()
    for function, found in targets:
        # An emptied table would collect as one skipped test: hide its tests' functions instead.
        if found is not None and len(hidden_rows[id(found[0])]) < len(found[0].elts):
            drop.update(range(found[1].lineno, found[1].end_lineno + 1))
            continue
        first = min([function.lineno, *(d.lineno for d in function.decorator_list)])
        while first > 1 and not lines[first - 2].strip():  # and the blank lines that set it apart
            first -= 1
        drop.update(range(first, function.end_lineno + 1))
    return "".join(line for number, line in enumerate(lines, start=1) if number not in drop)


def _parameter_row(function: ast.FunctionDef | ast.AsyncFunctionDef, tables: dict[str, ast.expr],
                   params: dict[str, str] | None) -> tuple[Any, ast.expr] | None:
    """(table, row): the one literal row, on lines of its own, that gave the test ``params``; None:
    the test is no such row's (not parametrized, or by code), so its whole function is hidden."""
    if params is None:
        return None
    for decorator in function.decorator_list:
        if not (isinstance(decorator, ast.Call) and ast.unparse(decorator.func) == "pytest.mark.parametrize"
                and len(decorator.args) == 2 and not decorator.keywords):
            continue
        try:
            raw_names = ast.literal_eval(decorator.args[0])
        except (ValueError, TypeError, SyntaxError):
            return None
        names = [n.strip() for n in raw_names.split(",")] if isinstance(raw_names, str) else list(raw_names)
        if set(names) != set(params):  # stacked or fixture parametrization: not one row's doing
            return None
        bare = isinstance(raw_names, str) and len(names) == 1  # pytest wraps each value in a 1-tuple
        want = tuple(params[n] for n in names)
        found = [(table, row) for table, row in _rows(decorator.args[1], tables) or ()
                 if _row_values(row, bare=bare) == want]
        if len(found) != 1:
            return None
        table, row = found[0]
        alone = table.lineno < row.lineno and row.end_lineno < table.end_lineno and all(
            e.end_lineno < row.lineno or e.lineno > row.end_lineno for e in table.elts if e is not row)
        return (table, row) if alone else None
    return None


def _rows(expr: ast.expr, tables: dict[str, ast.expr]) -> list[tuple[ast.expr, ast.expr]] | None:
    """(table, row) for each row of a literal parameter list: inline, a module-level name, or a sum of them."""
    if isinstance(expr, ast.Name):
        expr = tables.get(expr.id, expr)
    if isinstance(expr, (ast.Tuple, ast.List)):
        return [(expr, row) for row in expr.elts]
    if isinstance(expr, ast.BinOp) and isinstance(expr.op, ast.Add):
        left, right = _rows(expr.left, tables), _rows(expr.right, tables)
        return None if left is None or right is None else left + right
    return None


def _row_values(row: ast.expr, *, bare: bool) -> tuple[str, ...] | None:
    try:
        value = ast.literal_eval(row)
    except (ValueError, TypeError, SyntaxError):  # pytest.param(...), a call, a name: not a literal row
        return None
    if bare:
        value = (value,)
    return tuple(map(repr, value)) if isinstance(value, (tuple, list)) else None


# ---------------------------------------------------------------- the problem statement


_OPENERS = (
    "I think there is a bug in `{name}.{subject}`.",
    "`{name}.{subject}` gives wrong results for some inputs.",
    "While using {name} I ran into unexpected behaviour from `{subject}`.",
    "Bug report: `{name}.{subject}` does not do what its documentation says.",
)
_WRONG_VALUE = (
    "`{expr}` returns `{got}`, but it should return `{want}`.",
    "Calling `{expr}` gives `{got}` instead of `{want}`.",
    "I expected `{expr}` to be `{want}`, yet it is `{got}`.",
)
_CLOSERS = ("", "Other inputs seem fine.", "Could you take a look?", "Please fix it without changing the API.")


def _subject(bug: Bug) -> str:
    match = re.match(r"\w+\.(\w+)\(", bug.symptoms[0])
    assert match, f"a symptom calls a function of the package: {bug.symptoms[0]!r}"
    return match.group(1)


def _problem_statement(instance_id: str, package: Package, bug: Bug, buggy_source: str, source: str) -> str:
    """A user's report: what the symptoms return with the bug and what they should return."""
    rng = random.Random(instance_id)
    buggy, correct = _load_module(package, buggy_source), _load_module(package, source)
    lines = [rng.choice(_OPENERS).format(name=package.name, subject=_subject(bug)), ""]
    for expr in bug.symptoms:
        want, got = _outcome(expr, package, correct), _outcome(expr, package, buggy)
        if want == got:
            raise AssertionError(f"{instance_id}: the symptom {expr} does not show the bug")
        lines.append(_symptom(rng, expr, want=want, got=got))
    closer = rng.choice(_CLOSERS)
    return "\n".join(lines + (["", closer] if closer else [])) + "\n"


def _symptom(rng: random.Random, expr: str, *, want: str, got: str) -> str:
    raised = "raises "
    if want.startswith(raised):
        return f"`{expr}` {'raises' if got.startswith(raised) else 'returns'} `{got.removeprefix(raised)}`, " \
               f"but it should raise `{want.removeprefix(raised)}`."
    if got.startswith(raised):
        return f"`{expr}` raises `{got.removeprefix(raised)}` instead of returning `{want}`."
    return rng.choice(_WRONG_VALUE).format(expr=expr, got=got, want=want)


def _load_module(package: Package, source: str) -> types.ModuleType:
    module = types.ModuleType(package.name)
    exec(compile(source, package.source_path, "exec"), module.__dict__)
    return module


def _outcome(expr: str, package: Package, module: types.ModuleType) -> str:
    """``repr`` of what ``expr`` gives, or ``raises Kind: message``."""
    try:
        return repr(eval(expr, {package.name: module}))
    except Exception as exc:
        return f"raises {type(exc).__name__}: {str(exc)[:80]}"
