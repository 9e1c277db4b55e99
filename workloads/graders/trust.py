"""What of an agent's change the grader lets take part in a test run, and why the rest is dropped.

The grader applies an agent's change to a fresh copy of the task's template, so whatever is
dropped here simply does not exist when the hidden tests run: the template's copy stands (or its
absence). The rules, in order; the first that matches drops the file and names itself:

1. a file the hidden tests (``test_patch``) rebuild;
2. a test file: ``grading.test_paths`` (the template's tests stand, deletions included);
3. runner configuration, import hooks, compiled or cached modules: ``grading.untrusted_paths``;
4. a ``setup.cfg`` or ``pyproject.toml`` whose pytest section differs from the template's (the
   rest of such a file is not needed by any test run, and the section is how ``addopts`` loads a
   plugin);
5. a new module or package that would shadow one the runner imports: a name of the standard
   library or of ``grading.protected_modules``, at a folder that is not itself a package (the tree's
   root, or any folder an import path can start at);
6. a Python file whose added lines match ``grading.forbidden_refs`` (the test runner, the
   interpreter's import, exit and frame machinery, the report).

Rules 1–3 also keep the agent from deleting those files. Rules 4–6 look at what the agent wrote.
What no rule can see: a patch to trusted source that special-cases the tests' inputs, or reaches the
test process by a route none of the patterns names. That is why the grader also runs a tripwire
test and reads results from outside the agent's workspace (workloads/graders/tests.py).
"""

from __future__ import annotations

import configparser
import fnmatch
import re
import sys
import tomllib
from collections import Counter
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

from workloads.config import GradingConfig
from workloads.graders.agent_change import FileChange

PYTEST_SECTION_FILES = ("setup.cfg", "pyproject.toml")
MODULE_SUFFIXES = (".py", ".pyc", ".so", ".pyd", ".pyw")


@dataclass(frozen=True, slots=True)
class Dropped:
    path: str
    why: str


def matches(path: str, patterns: tuple[str, ...]) -> str:
    """The first pattern ``path`` matches ('' for none): a pattern without ``/`` against each
    component, one with ``/`` against the whole path."""
    parts = path.split("/")
    for pattern in patterns:
        if "/" in pattern.strip("/"):
            if fnmatch.fnmatchcase(path, pattern.strip("/")):
                return pattern
        elif any(fnmatch.fnmatchcase(part, pattern.strip("/")) for part in parts):
            return pattern
    return ""


def filter_change(files: list[FileChange], cfg: GradingConfig, *, template: Path,
                  rebuilt: set[str]) -> tuple[list[FileChange], list[Dropped]]:
    """(kept, dropped) of the agent's changed ``files``; ``rebuilt``: the paths ``test_patch`` writes."""
    if not cfg.filter_change:
        return list(files), []
    protected = frozenset(sys.stdlib_module_names) | frozenset(cfg.protected_modules)
    refs = [re.compile(p) for p in cfg.forbidden_refs]
    packages = _packages(template, files)
    kept: list[FileChange] = []
    dropped: list[Dropped] = []
    for change in files:
        why = _why_dropped(change, cfg, template=template, rebuilt=rebuilt, protected=protected, refs=refs,
                           packages=packages)
        if why:
            dropped.append(Dropped(change.path, why))
        else:
            kept.append(change)
    return kept, dropped


def _why_dropped(change: FileChange, cfg: GradingConfig, *, template: Path, rebuilt: set[str],
                 protected: frozenset[str], refs: list[re.Pattern[str]], packages: set[str]) -> str:
    path = change.path
    if path in rebuilt:
        return "a file the hidden tests rebuild"
    pattern = matches(path, cfg.test_paths)
    if pattern:
        return f"a test file (grading.test_paths: {pattern})"
    pattern = matches(path, cfg.untrusted_paths)
    if pattern:
        return f"runner configuration, an import hook or a compiled module (grading.untrusted_paths: {pattern})"
    if change.kind == "deleted":
        return ""
    name = PurePosixPath(path).name
    if name in PYTEST_SECTION_FILES:
        why = _pytest_section_changed(name, change.data, template / path)
        if why:
            return why
    if change.kind == "added":
        shadowed = _shadowed_module(path, packages, protected)
        if shadowed:
            return f"shadows the module {shadowed!r}, which the test runner imports"
    if path.endswith((".py", ".pyw")):
        found = _forbidden_ref(change.data, template / path, refs)
        if found:
            return f"refers to {found!r} (grading.forbidden_refs)"
    return ""


def _pytest_section_changed(name: str, data: bytes, original: Path) -> str:
    old = original.read_bytes() if original.is_file() else b""
    try:
        if name == "pyproject.toml":
            new_section, old_section = (_toml_pytest(d) for d in (data, old))
        else:
            new_section, old_section = (_cfg_pytest(d) for d in (data, old))
    except ValueError as exc:
        return f"cannot be read as {name} ({exc}), so its pytest section cannot be checked"
    if new_section != old_section:
        return "changes its pytest section"
    return ""


def _toml_pytest(data: bytes) -> object:
    try:
        doc = tomllib.loads(data.decode("utf-8"))
    except (UnicodeDecodeError, tomllib.TOMLDecodeError) as exc:
        raise ValueError(str(exc)) from None
    return doc.get("tool", {}).get("pytest") if isinstance(doc.get("tool"), dict) else doc.get("tool")


def _cfg_pytest(data: bytes) -> object:
    parser = configparser.ConfigParser(interpolation=None, strict=False)
    try:
        parser.read_string(data.decode("utf-8"))
    except (UnicodeDecodeError, configparser.Error) as exc:
        raise ValueError(str(exc).splitlines()[0]) from None
    return {s: dict(parser[s]) for s in ("tool:pytest", "pytest") if parser.has_section(s)}


def _packages(template: Path, files: list[FileChange]) -> set[str]:
    """Folders (relative to the tree, ``.`` for its root) holding an ``__init__.py`` after the change."""
    found = {str(p.parent.relative_to(template)) for p in template.rglob("__init__.py")
             if ".git" not in p.relative_to(template).parts}
    found |= {str(PurePosixPath(f.path).parent) for f in files
              if PurePosixPath(f.path).name == "__init__.py" and f.kind != "deleted"}
    return found


def _shadowed_module(path: str, packages: set[str], protected: frozenset[str]) -> str:
    """The protected name ``path`` would stand for at some import root, or ''."""
    parts = path.split("/")
    for i, part in enumerate(parts):
        parent = "/".join(parts[:i]) or "."
        if parent in packages:
            continue  # inside a package, this name is relative to it
        is_file = i == len(parts) - 1
        stem = part.split(".", 1)[0] if is_file and part.endswith(MODULE_SUFFIXES) else (part if not is_file else "")
        if stem in protected:
            return stem
    return ""


def _forbidden_ref(data: bytes, original: Path, refs: list[re.Pattern[str]]) -> str:
    """The first forbidden reference in the lines ``data`` adds to ``original`` (all lines of a new file)."""
    text = data.decode("utf-8", errors="replace")
    before = Counter(original.read_text("utf-8", errors="replace").splitlines()) if original.is_file() else Counter()
    for line in text.splitlines():
        if before[line] > 0:
            before[line] -= 1
            continue
        for ref in refs:
            found = ref.search(line)
            if found:
                return found.group(0)
    return ""
