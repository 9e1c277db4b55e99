"""Unified diffs, parsed strictly and applied in Python: the hidden tests' ``test_patch``.

A patch is parsed into ``FilePatch`` objects, each path checked to stay inside the tree (no ``..``,
not absolute, never ``.git``). Applying writes each file through directory fds opened with
``O_NOFOLLOW``: a symlink or a file where a directory belongs is removed (never followed) and
replaced, so a tree that held a planted link cannot redirect a write outside it. No ``git apply``
runs here, so no ``.git/config`` of anyone's is ever read.
"""

from __future__ import annotations

import errno
import os
import re
import shutil
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath


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


# ---------------------------------------------------------------- writing inside a tree only


def apply_file_patches(files: list[FilePatch], *, tree: Path, base_tree: Path) -> None:
    """Rebuild each patched file from ``base_tree`` (so nothing already in ``tree`` at that path
    takes part) and write it into ``tree``, never through a symlink: see the module docstring."""
    with TreeWriter(tree) as out:
        for fp in files:
            path = fp.new_path or fp.old_path
            assert path is not None
            if fp.new_path is None:
                out.remove(path)
                continue
            if fp.old_path is None:
                original, mode = "", 0o644
            else:
                source = base_tree / fp.old_path
                original = source.read_bytes().decode("utf-8", errors="surrogateescape")
                mode = source.stat().st_mode & 0o777
            text = apply_hunks(original, fp.hunks, path)
            out.write(path, text.encode("utf-8", errors="surrogateescape"), mode)


class TreeWriter:
    """Writes and removes files at relative paths strictly inside one folder (an open directory
    fd; every component opened ``O_NOFOLLOW``), whatever links that folder holds."""

    def __init__(self, tree: Path) -> None:
        self._tree = tree
        self._root_fd = -1

    def __enter__(self) -> TreeWriter:
        self._root_fd = os.open(self._tree, os.O_RDONLY | os.O_DIRECTORY)
        return self

    def __exit__(self, *_exc: object) -> None:
        os.close(self._root_fd)

    def write(self, path: str, data: bytes, mode: int) -> None:
        """``path`` replaced by a new regular file holding ``data``; ``mode`` keeps only 0o777 bits."""
        _write_in(self._root_fd, check_relative_path(path, "write"), data, mode & 0o777)

    def remove(self, path: str) -> None:
        _remove_in(self._root_fd, check_relative_path(path, "remove"))


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
