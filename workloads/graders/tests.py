"""The hidden-test grader: put a task's hidden tests into a finished workspace, run them confined, score.

After a run ends (or was killed at its timeout) the workspace is whatever the agent left. The
grader, in order:

1. writes the hidden tests: every file ``test_patch`` touches is rebuilt from the task's *base
   tree* (the workspace template, never the agent's copy) with the patch applied, as SWE-bench
   resets test files before applying its test patch; agent edits to those files are discarded;
2. runs ``test_cmd`` through the sandbox (``network="none"``, a minimal environment), killed with
   its whole process group at the timeout;
3. parses pytest's ``-rA`` short summary (``PASSED id``, ``FAILED id - msg``, ``ERROR id``,
   ``XFAIL id - reason``) and rewards ``binary`` (1.0 when every FAIL_TO_PASS and PASS_TO_PASS
   test passed) or ``fraction`` (the share that passed). PASSED and XFAIL count as passed, as in
   SWE-bench; a test the summary does not name counts as failed.

Writing hidden tests is the one moment the grader writes into a folder an agent controlled, and
an agent may have replaced ``tests/test_x.py`` or ``tests/`` by a symlink to somewhere outside.
So the patch is applied here, in Python, never with ``git apply``: each path component is opened
relative to its parent with ``O_NOFOLLOW``; a symlink or file where a directory should be, and
anything at the target path, is removed (never followed) and replaced. For the same reason no git
command runs in the workspace outside the sandbox: its ``.git/config`` is the agent's (a
``core.fsmonitor`` there runs any command).

Outcomes versus grader failures. A failure is ``reward=None`` (the execution is excluded, never
scored 0): the test command could not start, ran past its timeout, the grader raised, the base
tree is missing, or the output names none of the task's tests (nor a collection error of a file
holding them), which is what a missing pytest, a usage error or an empty collection (pytest exit
2-5 with nothing reported) look like. A collection error of the task's own test file *is*
reported, and scores as failed tests: it is how a workspace whose code no longer imports looks,
and excluding it would spare a policy that breaks the module its penalty.

Known limit, shared with SWE-bench: the tests import the agent's code, so code planted in the
workspace (a ``conftest.py``) runs inside pytest and could print summary lines; the sandbox keeps
it inside the workspace, not honest.
"""

from __future__ import annotations

import errno
import os
import re
import shutil
import signal
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import Literal

from workloads.api import GradeResult, Sandbox, SandboxSpec

RewardMode = Literal["binary", "fraction"]

LOG_TAIL_CHARS = 4000
"""Characters of the test output kept in ``GradeResult.detail`` for the report."""
MAX_LOG_BYTES = 4 << 20
"""Only the last this many bytes of the test output are parsed (the summary is at the end)."""
GRADER_ENV = {
    "PATH": "/usr/local/bin:/usr/bin:/bin",
    "LANG": "C.UTF-8",
    "PYTHONDONTWRITEBYTECODE": "1",
    "PYTHONNOUSERSITE": "1",
    "PYTHONHASHSEED": "0",
}
"""The test command's whole environment (plus ``HOME`` = the workspace): the system's python3,
never the controller's venv, tokens or proxy settings."""

_PASS_STATUSES = ("PASSED", "XFAIL")
_FAIL_STATUSES = ("FAILED", "ERROR", "XPASS")
_SUMMARY_LINE = re.compile(r"^(PASSED|FAILED|ERROR|XFAIL|XPASS) (\S.*?)\s*$")


# ---------------------------------------------------------------- the hidden tests of one task


@dataclass(frozen=True, kw_only=True)
class HiddenTests:
    """What the grader needs of a task (workloads/tasksets/swe.py builds it from a task row)."""

    task_id: str
    test_patch: str
    """A unified diff (git style, ``a/`` and ``b/`` prefixes); '' when the tests are in the repo."""
    test_cmd: str
    """A shell command run in the workspace; it must print pytest's ``-rA`` summary."""
    fail_to_pass: tuple[str, ...]
    pass_to_pass: tuple[str, ...]

    @property
    def test_ids(self) -> tuple[str, ...]:
        return tuple(dict.fromkeys(self.fail_to_pass + self.pass_to_pass))


# ---------------------------------------------------------------- unified diffs, parsed strictly


class PatchError(ValueError):
    """A patch this grader cannot apply (bad syntax, binary, rename, path leaving the tree)."""


@dataclass(frozen=True)
class Hunk:
    old_start: int
    old_lines: tuple[str, ...]
    """Each line with its ``\\n``, except a last line marked ``\\ No newline at end of file``."""
    new_lines: tuple[str, ...]


@dataclass(frozen=True)
class FilePatch:
    old_path: str | None
    """None for a file the patch creates."""
    new_path: str | None
    """None for a file the patch deletes."""
    hunks: tuple[Hunk, ...] = field(default=())


_HUNK_HEADER = re.compile(r"^@@ -(\d+)(?:,(\d+))? \+(\d+)(?:,(\d+))? @@")


def parse_patch(text: str) -> list[FilePatch]:
    """The files of a git-style unified diff, each path checked to stay inside the tree."""
    lines = text.split("\n")
    files: list[FilePatch] = []
    i = 0
    while i < len(lines):
        line = lines[i]
        if line.startswith(("GIT binary patch", "Binary files ")):
            raise PatchError(f"line {i + 1}: binary patches are not supported")
        if line.startswith(("rename from ", "copy from ")):
            raise PatchError(f"line {i + 1}: renames and copies are not supported")
        if not line.startswith("--- "):
            i += 1
            continue
        if i + 1 >= len(lines) or not lines[i + 1].startswith("+++ "):
            raise PatchError(f"line {i + 1}: '---' without a '+++' line after it")
        old_path, new_path = _diff_path(line[4:], "a/", i), _diff_path(lines[i + 1][4:], "b/", i + 1)
        if old_path is None and new_path is None:
            raise PatchError(f"line {i + 1}: both sides are /dev/null")
        i += 2
        hunks: list[Hunk] = []
        while i < len(lines) and lines[i].startswith("@@"):
            hunk, i = _parse_hunk(lines, i)
            hunks.append(hunk)
        if not hunks:
            raise PatchError(f"line {i + 1}: {new_path or old_path}: no hunks")
        files.append(FilePatch(old_path, new_path, tuple(hunks)))
    if text.strip() and not files:
        raise PatchError("no '--- a/... +++ b/...' file headers found")
    return files


def _diff_path(raw: str, prefix: str, index: int) -> str | None:
    raw = raw.split("\t", 1)[0].rstrip()
    if raw == "/dev/null":
        return None
    if raw.startswith('"'):
        raise PatchError(f"line {index + 1}: quoted paths are not supported: {raw}")
    if not raw.startswith(prefix):
        raise PatchError(f"line {index + 1}: want a git-style path starting {prefix!r}: {raw}")
    return check_relative_path(raw[len(prefix):], f"line {index + 1}")


def check_relative_path(path: str, where: str) -> str:
    """``path`` if it names something strictly inside a tree (no '..', not absolute, not .git)."""
    parts = PurePosixPath(path).parts
    if (not parts or path.startswith("/") or any(p in ("..", ".") for p in path.split("/"))
            or "\0" in path or parts[0] == ".git"):
        raise PatchError(f"{where}: path leaves the tree or names .git: {path!r}")
    return "/".join(parts)


def _parse_hunk(lines: list[str], i: int) -> tuple[Hunk, int]:
    match = _HUNK_HEADER.match(lines[i])
    if not match:
        raise PatchError(f"line {i + 1}: bad hunk header: {lines[i]!r}")
    old_start = int(match.group(1))
    old_count = int(match.group(2)) if match.group(2) is not None else 1  # "@@ -5 +5 @@": one line
    new_count = int(match.group(4)) if match.group(4) is not None else 1
    old: list[str] = []
    new: list[str] = []
    last: list[list[str]] = []
    i += 1
    while len(old) < old_count or len(new) < new_count:
        if i >= len(lines):
            raise PatchError(f"line {i}: hunk ends early (want -{old_count} +{new_count} lines)")
        line = lines[i]
        tag, body = (line[:1], line[1:]) if line else (" ", "")  # an empty line is blank context
        if tag == " ":
            old.append(body + "\n")
            new.append(body + "\n")
            last = [old, new]
        elif tag == "-":
            old.append(body + "\n")
            last = [old]
        elif tag == "+":
            new.append(body + "\n")
            last = [new]
        elif tag == "\\":
            _strip_newline(last)
        else:
            raise PatchError(f"line {i + 1}: unexpected line in a hunk: {line[:60]!r}")
        i += 1
    if i < len(lines) and lines[i].startswith("\\"):
        _strip_newline(last)
        i += 1
    if len(old) != old_count or len(new) != new_count:
        raise PatchError(f"line {i}: hunk line counts do not match its header")
    return Hunk(old_start, tuple(old), tuple(new)), i


def _strip_newline(sides: list[list[str]]) -> None:
    for side in sides:
        side[-1] = side[-1].removesuffix("\n")


def apply_hunks(original: str, hunks: tuple[Hunk, ...], where: str) -> str:
    """``original`` with the hunks applied: each at its line, or at the nearest exact match."""
    lines = split_lines(original)
    out: list[str] = []
    pos = 0
    for hunk in hunks:
        want = max(hunk.old_start - 1, 0) if hunk.old_lines else hunk.old_start
        at = _find(lines, hunk.old_lines, want, pos)
        if at is None:
            raise PatchError(f"{where}: hunk at line {hunk.old_start} does not match the base file")
        out.extend(lines[pos:at])
        out.extend(hunk.new_lines)
        pos = at + len(hunk.old_lines)
    out.extend(lines[pos:])
    return "".join(out)


def split_lines(text: str) -> list[str]:
    """Lines with their ``\\n`` (only ``\\n`` splits, as in diff)."""
    parts = text.split("\n")
    return [p + "\n" for p in parts[:-1]] + ([parts[-1]] if parts[-1] else [])


def _find(lines: list[str], block: tuple[str, ...], want: int, start: int) -> int | None:
    n = len(block)
    candidates = range(start, len(lines) - n + 1)
    for at in sorted(candidates, key=lambda k: abs(k - want)):
        if tuple(lines[at:at + n]) == block:
            return at
    return None


# ---------------------------------------------------------------- writing inside a workspace only


def write_hidden_tests(files: list[FilePatch], *, workspace: Path, base_tree: Path) -> None:
    """Rebuild each patched file from ``base_tree`` and write it into ``workspace``, never through
    a symlink: see the module docstring."""
    root_fd = os.open(workspace, os.O_RDONLY | os.O_DIRECTORY)
    try:
        for fp in files:
            path = fp.new_path or fp.old_path
            assert path is not None
            if fp.new_path is None:
                _remove_in(root_fd, path)
                continue
            if fp.old_path is None:
                original, mode = "", 0o644
            else:
                source = base_tree / fp.old_path
                original = source.read_bytes().decode("utf-8", errors="surrogateescape")
                mode = source.stat().st_mode & 0o777
            text = apply_hunks(original, fp.hunks, path)
            _write_in(root_fd, path, text.encode("utf-8", errors="surrogateescape"), mode)
    finally:
        os.close(root_fd)


def _write_in(root_fd: int, path: str, data: bytes, mode: int) -> None:
    *parents, name = path.split("/")
    dir_fd = _open_dirs(root_fd, parents)
    try:
        _remove_entry(dir_fd, name)
        fd = os.open(name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, mode, dir_fd=dir_fd)
        try:
            _check_inside(root_fd, fd, path)
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view):]
        finally:
            os.close(fd)
    finally:
        os.close(dir_fd)


def _remove_in(root_fd: int, path: str) -> None:
    *parents, name = path.split("/")
    dir_fd = _open_dirs(root_fd, parents)
    try:
        _remove_entry(dir_fd, name)
    finally:
        os.close(dir_fd)


def _open_dirs(root_fd: int, parts: list[str]) -> int:
    """A new fd of ``root/parts...``, each component a real directory (made so when it is not)."""
    fd = os.dup(root_fd)
    for name in parts:
        flags = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW
        try:
            next_fd = os.open(name, flags, dir_fd=fd)
        except OSError as exc:
            if exc.errno not in (errno.ENOENT, errno.ELOOP, errno.ENOTDIR):
                os.close(fd)
                raise
            _remove_entry(fd, name)  # a symlink or a file where a directory belongs: replaced
            os.mkdir(name, 0o755, dir_fd=fd)
            next_fd = os.open(name, flags, dir_fd=fd)
        os.close(fd)
        fd = next_fd
    return fd


def _remove_entry(dir_fd: int, name: str) -> None:
    """Remove whatever ``name`` is in ``dir_fd`` (a symlink is unlinked, never followed)."""
    try:
        st = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
    except FileNotFoundError:
        return
    if os.path.stat.S_ISDIR(st.st_mode):
        shutil.rmtree(name, dir_fd=dir_fd)  # symlink-attack safe on Linux (rmtree.avoids_symlink_attacks)
    else:
        os.unlink(name, dir_fd=dir_fd)


def _check_inside(root_fd: int, fd: int, path: str) -> None:
    # The walk above cannot leave the root; this says so again from the kernel's view of both fds.
    root = os.readlink(f"/proc/self/fd/{root_fd}")
    real = os.readlink(f"/proc/self/fd/{fd}")
    if not real.startswith(root.rstrip("/") + "/"):
        raise PatchError(f"{path}: resolved outside the workspace ({real})")


# ---------------------------------------------------------------- running and scoring


def parse_summary(log: str) -> dict[str, str]:
    """Test id -> status from pytest's ``-rA`` short summary lines (the last status wins)."""
    statuses: dict[str, str] = {}
    for line in log.splitlines():
        match = _SUMMARY_LINE.match(line)
        if not match:
            continue
        status, rest = match.groups()
        test_id = rest if status == "PASSED" else rest.split(" - ", 1)[0].rstrip()
        statuses[test_id] = status
    return statuses


def score(tests: HiddenTests, statuses: dict[str, str], reward: RewardMode) -> tuple[float | None, list[str], list[str]]:
    """(reward or None when nothing of the task was reported, passed ids, failed ids)."""
    files = {t.split("::", 1)[0] for t in tests.test_ids}
    collection_errors = {t for t, s in statuses.items() if s == "ERROR" and t in files}
    passed = [t for t in tests.test_ids if statuses.get(t) in _PASS_STATUSES]
    failed = [t for t in tests.test_ids if t not in passed]
    if not collection_errors and not any(t in statuses for t in tests.test_ids):
        return None, passed, failed
    if reward == "binary":
        return float(not failed), passed, failed
    return len(passed) / len(tests.test_ids), passed, failed


def grade_hidden_tests(tests: HiddenTests, *, workspace: Path, base_tree: Path, sandbox: Sandbox,
                       reward: RewardMode, timeout_s: float) -> GradeResult:
    """Write the hidden tests into ``workspace``, run them in ``sandbox``, score. Never raises."""
    try:
        if not workspace.is_dir():
            return GradeResult(reward=None, error=f"{tests.task_id}: workspace missing: {workspace}")
        if not base_tree.is_dir():
            return GradeResult(reward=None, error=f"{tests.task_id}: base tree missing: {base_tree}")
        write_hidden_tests(parse_patch(tests.test_patch), workspace=workspace, base_tree=base_tree)
        exit_code, log, elapsed_s = _run(tests.test_cmd, workspace=workspace, sandbox=sandbox, timeout_s=timeout_s)
    except Exception as exc:  # a grader bug must exclude the execution, not score it 0
        return GradeResult(reward=None, error=f"{tests.task_id}: grader raised {type(exc).__name__}: {exc}")
    tail = log[-LOG_TAIL_CHARS:]
    if exit_code is None:
        return GradeResult(reward=None, error=f"{tests.task_id}: hidden tests timed out after {timeout_s:g}s",
                           detail={"log_tail": tail})
    value, passed, failed = score(tests, parse_summary(log), reward)
    detail = {"passed": passed, "failed": failed, "exit_code": exit_code, "elapsed_s": round(elapsed_s, 3),
              "log_tail": tail}
    if value is None:
        return GradeResult(reward=None, detail=detail, error=(
            f"{tests.task_id}: the test command reported none of the task's tests (exit {exit_code})"))
    return GradeResult(reward=value, detail=detail)


def _run(command: str, *, workspace: Path, sandbox: Sandbox, timeout_s: float) -> tuple[int | None, str, float]:
    """(exit code or None at the timeout, the output's tail, seconds)."""
    spec = SandboxSpec(argv=["/bin/sh", "-c", command], workspace=workspace,
                       env={**GRADER_ENV, "HOME": str(workspace)}, network="none")
    argv = sandbox.wrap(spec)
    started = time.monotonic()
    # The output goes to an unnamed file outside the workspace: no pipe to fill, nothing to tamper with.
    with tempfile.TemporaryFile() as out:
        proc = subprocess.Popen(argv, cwd=workspace, env=spec.env, stdin=subprocess.DEVNULL, stdout=out,
                                stderr=subprocess.STDOUT, start_new_session=True)
        try:
            exit_code: int | None = proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            exit_code = None
        finally:
            _kill_group(proc)
        size = out.seek(0, os.SEEK_END)
        out.seek(max(0, size - MAX_LOG_BYTES))
        log = out.read().decode("utf-8", errors="replace")
    return exit_code, log, time.monotonic() - started


def _kill_group(proc: subprocess.Popen) -> None:
    # Also after a normal exit: a test may have left a child running in the group.
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):  # the group is gone already
        pass
    proc.wait()
