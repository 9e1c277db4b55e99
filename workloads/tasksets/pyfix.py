"""The bundled coding task set ``pyfix``: small Python projects with a planted bug, as SWE-style rows.

``generate(data_dir)`` writes, deterministically and offline,

- ``<data_dir>/pyfix/repos/<instance_id>/``: a (bare) git repository per task. Its first commit (the
  task's ``base_commit``) holds the module with the bug, a README and a few visible tests that
  pass; its second commit, the repository's HEAD, is the fix with the hidden tests: the future
  history a workspace must never show (workloads/tasksets/swe.py builds workspaces without it);
- ``<data_dir>/pyfix/tasks.jsonl``: one row per task in the format swe.py loads, with the gold
  ``patch``, the hidden tests as ``test_patch`` and the ``FAIL_TO_PASS`` / ``PASS_TO_PASS`` ids;
- ``<data_dir>/pyfix/STAMP``: the generator version; a different or missing stamp regenerates.

A task is one ``Family`` (a module of a few functions, and test cases as plain expressions) and
one ``Bug`` (a text substitution planting, say, an off-by-one); the 20 families are data, in
workloads/tasksets/pyfix_families/, and this module is the generator. Expected values come from
running the correct module; which tests are FAIL_TO_PASS (fail with the bug, pass fixed) and which are
PASS_TO_PASS (pass both) is found by running every test in-process on both versions, so the split
is measured, not hand-labelled, and a bug no test catches stops the generator. The problem
statement reports the symptom of one or two failing cases in a user's words, never the fix.

Tests run with the system's ``python3 -m pytest`` (Debian's python3-pytest), which is what the
sandbox shows; the projects use the standard library only and grade in well under a second.
"""

from __future__ import annotations

import builtins
import difflib
import hashlib
import json
import random
import shutil
import tempfile
import types
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from workloads.tasksets.pyfix_families import FAMILIES, Bug, Family

GENERATOR_VERSION = "1"
"""Bump on any change to what ``generate`` writes: existing data dirs then regenerate."""
_AUTHOR = "pyfix <pyfix@gyre.invalid>"
_COMMIT_EPOCHS = (1704110400, 1704715200)
"""2024-01-01 and 2024-01-08, 12:00 UTC: with fixed dates every commit hash (so every base_commit)
is the same on every machine."""


@dataclass(frozen=True)
class _Test:
    name: str
    callable_name: str
    expr: str
    code: str


def task_file(data_dir: str | Path) -> Path:
    return Path(data_dir) / "pyfix" / "tasks.jsonl"


def generate(data_dir: str | Path) -> Path:
    """Write the task set under ``data_dir/pyfix`` unless its stamp is current; the task file's path.

    Built in a temporary folder and renamed into place, so concurrent callers never see half a set.
    """
    target = Path(data_dir) / "pyfix"
    stamp = target / "STAMP"
    if stamp.is_file() and stamp.read_text() == GENERATOR_VERSION:
        target.chmod(0o700)  # gold patches and hidden tests: the run user's alone, whatever umask made it
        return target / "tasks.jsonl"
    Path(data_dir).mkdir(parents=True, exist_ok=True)
    building = Path(tempfile.mkdtemp(prefix=".pyfix.", dir=data_dir))
    try:
        _write_task_set(building)
        (building / "STAMP").write_text(GENERATOR_VERSION)
        if target.exists():
            stale = Path(tempfile.mkdtemp(prefix=".pyfix-stale.", dir=data_dir))
            target.rename(stale / "pyfix")
            shutil.rmtree(stale, ignore_errors=True)
        try:
            building.rename(target)
        except OSError:
            if not (stamp.is_file() and stamp.read_text() == GENERATOR_VERSION):
                raise  # not a concurrent generator that finished first
    finally:
        shutil.rmtree(building, ignore_errors=True)
    return target / "tasks.jsonl"


def _write_task_set(root: Path) -> None:
    rows = []
    for family in FAMILIES:
        for number, bug in enumerate(family.bugs, start=1):
            instance_id = f"pyfix__{family.module}-{number}"
            rows.append(_write_task(root / "repos" / instance_id, instance_id, family, bug))
    with open(root / "tasks.jsonl", "w", encoding="utf-8", newline="\n") as f:
        for row in rows:
            f.write(json.dumps(row, sort_keys=True) + "\n")


def _write_task(repo: Path, instance_id: str, family: Family, bug: Bug) -> dict[str, Any]:
    if family.source.count(bug.correct) != 1:
        raise AssertionError(f"{instance_id}: bug text must occur once in {family.module}.py: {bug.correct!r}")
    buggy_source = family.source.replace(bug.correct, bug.buggy)
    correct_module = _load_module(family.module, family.source)
    buggy_module = _load_module(family.module, buggy_source)
    tests = _make_tests(family, correct_module)
    fail_to_pass, pass_to_pass = [], []
    for test in tests:
        if not _passes(test, correct_module):
            raise AssertionError(f"{instance_id}: {test.name} fails on the correct module")
        (pass_to_pass if _passes(test, buggy_module) else fail_to_pass).append(test)
    if not fail_to_pass:
        raise AssertionError(f"{instance_id}: no test catches the bug {bug.buggy!r}")
    visible = _visible_tests(tests, pass_to_pass)
    test_path = f"tests/test_{family.module}.py"
    hidden_text, visible_text = _test_file(family.module, tests), _test_file(family.module, visible)

    base = {"README.md": _readme(family), f"{family.module}.py": buggy_source, test_path: visible_text}
    fixed = {**base, f"{family.module}.py": family.source, test_path: hidden_text}
    base_commit, _ = _write_repository(repo, [
        (base, f"Add {family.module}: {family.title}", _COMMIT_EPOCHS[0]),
        (fixed, f"Fix {fail_to_pass[0].callable_name} ({bug.kind}) and test it", _COMMIT_EPOCHS[1]),
    ])
    statement = _problem_statement(instance_id, family, fail_to_pass, correct_module, buggy_module)
    ids = lambda group: [f"{test_path}::{t.name}" for t in group]  # noqa: E731
    return {
        "instance_id": instance_id,
        "repo": f"repos/{instance_id}",
        "base_commit": base_commit,
        "problem_statement": statement,
        "FAIL_TO_PASS": ids(fail_to_pass),
        "PASS_TO_PASS": ids(pass_to_pass),
        "patch": _diff(f"{family.module}.py", buggy_source, family.source),
        "test_patch": _diff(test_path, visible_text, hidden_text),
        "bug_kind": bug.kind,
        "version": GENERATOR_VERSION,
    }


# ---------------------------------------------------------------- tests, measured in-process


def _load_module(name: str, source: str) -> types.ModuleType:
    module = types.ModuleType(name)
    exec(compile(source, f"{name}.py", "exec"), module.__dict__)
    return module


def _outcome(expr: str, module: types.ModuleType) -> tuple[str, Any]:
    """("value", v) or ("raises", exception) of ``expr`` evaluated against ``module``."""
    try:
        return "value", eval(expr, dict(module.__dict__))
    except Exception as exc:
        return "raises", exc


def _make_tests(family: Family, module: types.ModuleType) -> list[_Test]:
    tests = []
    for callable_name, exprs in family.cases.items():
        for number, expr in enumerate(exprs, start=1):
            name = f"test_{callable_name.replace('.', '_').lower()}_{number}"
            kind, result = _outcome(expr, module)
            if kind == "raises":
                exc_name = type(result).__name__
                assert getattr(builtins, exc_name, None) is type(result), f"{name}: {exc_name} is not a builtin"
                code = f"def {name}():\n    with pytest.raises({exc_name}):\n        {expr}\n"
            elif result is None or isinstance(result, bool):
                code = f"def {name}():\n    assert {expr} is {result!r}\n"
            else:
                assert eval(repr(result)) == result, f"{name}: {result!r} does not round-trip"
                code = f"def {name}():\n    assert {expr} == {result!r}\n"
            tests.append(_Test(name, callable_name, expr, code))
    return tests


def _passes(test: _Test, module: types.ModuleType) -> bool:
    # The test's globals are what its file's imports would bind; pytest.raises is stood in for, so
    # generating needs no pytest (the controller's install may have none).
    namespace: dict[str, Any] = {"pytest": types.SimpleNamespace(raises=_Raises),
                                 **{k: v for k, v in vars(module).items() if not k.startswith("__")}}
    try:
        exec(test.code, namespace)
        namespace[test.name]()
        return True
    except Exception:
        return False


class _Raises:
    """``pytest.raises(kind)`` as the generated tests use it: the block must raise ``kind``."""

    def __init__(self, kind: type[BaseException]):
        self.kind = kind

    def __enter__(self) -> None:
        return None

    def __exit__(self, kind, value, traceback) -> bool:
        if kind is None:
            raise AssertionError(f"DID NOT RAISE {self.kind.__name__}")
        return issubclass(kind, self.kind)  # another exception propagates: the test fails


def _visible_tests(tests: list[_Test], pass_to_pass: list[_Test]) -> list[_Test]:
    """The first passing test of up to three callables: what the repository shipped with."""
    chosen: dict[str, _Test] = {}
    for test in pass_to_pass:
        if test.callable_name not in chosen and len(chosen) < 3:
            chosen[test.callable_name] = test
    return [t for t in tests if t in chosen.values()]


def _test_file(module: str, tests: list[_Test]) -> str:
    names = sorted({t.callable_name.split(".")[0] for t in tests})
    header = f"import pytest\n\nfrom {module} import {', '.join(names)}\n" if names else "import pytest\n"
    return header + "".join(f"\n\n{t.code}" for t in tests)


# ---------------------------------------------------------------- words and files


_OPENERS = (
    "I think there is a bug in `{callable}` ({module}.py).",
    "`{callable}` in `{module}.py` gives wrong results for some inputs.",
    "Found a problem with the {title} in `{module}.py`, in `{callable}`.",
    "While using `{module}.py` I ran into unexpected behaviour from `{callable}`.",
    "Bug report: `{callable}` does not do what its documentation says.",
)
_WRONG_VALUE = (
    "`{expr}` returns `{got}`, but it should return `{want}`.",
    "Calling `{expr}` gives `{got}` instead of `{want}`.",
    "I expected `{expr}` to be `{want}`, yet it is `{got}`.",
)
_CLOSERS = ("", "Everything else I tried works as documented.", "Please fix it without changing the signature.",
            "Could you take a look?", "Other inputs seem fine.")


def _problem_statement(instance_id: str, family: Family, failing: list[_Test], correct: types.ModuleType,
                       buggy: types.ModuleType) -> str:
    rng = random.Random(instance_id)
    subject = failing[0].callable_name
    lines = [rng.choice(_OPENERS).format(callable=subject, module=family.module, title=family.title), ""]
    for test in [t for t in failing if t.callable_name == subject][:2]:
        lines.append(_symptom(rng, test.expr, _outcome(test.expr, correct), _outcome(test.expr, buggy)))
    doc = _docstring(correct, subject)
    if doc:
        lines += ["", f'Its docstring says: "{doc}"']
    closer = rng.choice(_CLOSERS)
    return "\n".join(lines + (["", closer] if closer else [])) + "\n"


def _symptom(rng: random.Random, expr: str, want: tuple[str, Any], got: tuple[str, Any]) -> str:
    def show(outcome: tuple[str, Any]) -> str:
        kind, value = outcome
        if kind == "raises":
            text = f"{type(value).__name__}: {value}"
        elif type(value).__repr__ is object.__repr__:  # its repr holds an address: not the same twice
            text = f"a {type(value).__name__} object"
        else:
            text = repr(value)
        return text if len(text) <= 100 else text[:97] + "..."

    if want[0] == "value" and got[0] == "value":
        return rng.choice(_WRONG_VALUE).format(expr=expr, got=show(got), want=show(want))
    if want[0] == "value":
        return f"`{expr}` raises `{show(got)}` instead of returning `{show(want)}`."
    expected = type(want[1]).__name__
    if got[0] == "value":
        return f"`{expr}` returns `{show(got)}`, but it should raise `{expected}`."
    return f"`{expr}` raises `{show(got)}`, but it should raise `{expected}`."


def _docstring(module: types.ModuleType, callable_name: str) -> str:
    obj: Any = module
    for part in callable_name.split("."):
        obj = getattr(obj, part, None)
    doc = (getattr(obj, "__doc__", None) or "").strip()
    return " ".join(doc.split())


def _readme(family: Family) -> str:
    return (f"# {family.module}\n\n{family.title[0].upper()}{family.title[1:]}, in `{family.module}.py` "
            f"(standard library only).\n\nRun the tests with `python3 -m pytest`.\n")


def _diff(path: str, before: str, after: str) -> str:
    body = difflib.unified_diff(before.splitlines(keepends=True), after.splitlines(keepends=True),
                                f"a/{path}", f"b/{path}")
    return f"diff --git a/{path} b/{path}\n" + "".join(body)


def _write_repository(repo: Path, commits: list[tuple[dict[str, str], str, int]]) -> list[str]:
    """A bare git repository at ``repo`` holding ``commits`` (files, message, epoch seconds) in a
    line, ``main`` at the last; the commits' hashes.

    Objects are written directly rather than by running git: five git processes for each of the
    140 repositories made generation take a minute on a busy 2-core machine, and the hashes, which
    depend only on content, names and the fixed dates, come out exactly as git's own.
    """
    (repo / "refs" / "heads").mkdir(parents=True)
    (repo / "refs" / "tags").mkdir()
    (repo / "objects").mkdir()
    (repo / "HEAD").write_text("ref: refs/heads/main\n")
    (repo / "config").write_text("[core]\n\trepositoryformatversion = 0\n\tfilemode = true\n\tbare = true\n")
    hashes: list[str] = []
    for files, message, epoch in commits:
        tree = _write_tree(repo, {path: text.encode("utf-8") for path, text in files.items()})
        ident = f"{_AUTHOR} {epoch} +0000"
        header = [f"tree {tree}", *(f"parent {h}" for h in hashes[-1:]), f"author {ident}", f"committer {ident}"]
        hashes.append(_write_object(repo, "commit", ("\n".join(header) + f"\n\n{message}\n").encode("utf-8")))
    (repo / "refs" / "heads" / "main").write_text(hashes[-1] + "\n")
    return hashes


def _write_tree(repo: Path, files: dict[str, bytes]) -> str:
    blobs: dict[str, bytes] = {}
    folders: dict[str, dict[str, bytes]] = {}
    for path, data in files.items():
        head, _, rest = path.partition("/")
        if rest:
            folders.setdefault(head, {})[rest] = data
        else:
            blobs[head] = data
    entries = [(name, "100644", _write_object(repo, "blob", data)) for name, data in blobs.items()]
    entries += [(name, "40000", _write_tree(repo, sub)) for name, sub in folders.items()]
    entries.sort(key=lambda e: e[0] + "/" if e[1] == "40000" else e[0])  # git's order: a folder sorts as 'name/'
    body = b"".join(f"{mode} {name}".encode() + b"\0" + bytes.fromhex(sha) for name, mode, sha in entries)
    return _write_object(repo, "tree", body)


def _write_object(repo: Path, kind: str, body: bytes) -> str:
    data = f"{kind} {len(body)}".encode() + b"\0" + body
    digest = hashlib.sha1(data).hexdigest()
    path = repo / "objects" / digest[:2] / digest[2:]
    if not path.exists():
        path.parent.mkdir(exist_ok=True)
        path.write_bytes(zlib.compress(data))
    return digest

