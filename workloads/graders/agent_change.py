"""The agent's change: how a finished workspace differs from its task's template, file by file.

The grader never runs anything in the workspace. It walks it (``os.scandir``, links never
followed) beside the template and lists what was added, modified or deleted, as data: the bytes
of each changed regular file and whether it was executable. What is not a regular file or a
folder (a symlink, a FIFO, a socket, a device) is never part of a change: it is listed as
refused. The walk is bounded (entries and bytes), so a workspace of a million files or a huge file
costs the grader a bounded walk, and says so.

A file whose size and modification time equal the template's is taken as unchanged without being
read (workspaces are ``cp -a`` copies, which keep both). An agent that rewrites a file and puts
its size and time back only hides its change from itself: what the grader does not see is not
applied to the fresh tree, where the template's copy stands.
"""

from __future__ import annotations

import os
import stat
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

ChangeKind = Literal["added", "modified", "deleted"]


@dataclass(frozen=True, slots=True)
class FileChange:
    path: str
    """Relative, ``/``-separated."""
    kind: ChangeKind
    data: bytes = b""
    """The new content (empty for a deletion)."""
    executable: bool = False


@dataclass(frozen=True, slots=True)
class Refused:
    path: str
    why: str


@dataclass
class AgentChange:
    files: list[FileChange] = field(default_factory=list)
    refused: list[Refused] = field(default_factory=list)
    """Entries that can never be part of a change (links, special files, files over the size limit)."""
    overflow: str = ""
    """Non-empty when the walk stopped at a limit: the change is incomplete, and scores 0."""


def collect_change(workspace: Path, template: Path, *, max_file_bytes: int, max_entries: int,
                   skip_dirs: frozenset[str] = frozenset({".git"})) -> AgentChange:
    """The change from ``template`` to ``workspace``. Folders named in ``skip_dirs`` are not walked
    on either side (the agent's ``.git`` says nothing the files do not)."""
    change = AgentChange()
    budget = [max_entries]
    _walk(workspace, template, "", change, budget, max_file_bytes, skip_dirs)
    return change


def _entries(folder: Path | None) -> dict[str, os.stat_result]:
    if folder is None:
        return {}
    try:
        with os.scandir(folder) as it:
            return {e.name: e.stat(follow_symlinks=False) for e in it}
    except (FileNotFoundError, NotADirectoryError):
        return {}


def _walk(ws: Path | None, tpl: Path | None, rel: str, change: AgentChange, budget: list[int], max_file_bytes: int,
          skip_dirs: frozenset[str]) -> None:
    mine, theirs = _entries(ws), _entries(tpl)
    budget[0] -= len(mine)
    if budget[0] < 0:
        change.overflow = f"the workspace holds more entries than the grader walks (at {rel or '.'})"
        return
    for name in sorted(set(mine) | set(theirs)):
        path = f"{rel}{name}"
        if name in skip_dirs and (stat.S_ISDIR(mine[name].st_mode) if name in mine else True):
            continue
        new, old = mine.get(name), theirs.get(name)
        new_dir = new is not None and stat.S_ISDIR(new.st_mode)
        old_dir = old is not None and stat.S_ISDIR(old.st_mode)
        if old is not None and not old_dir and (new is None or not stat.S_ISREG(new.st_mode)):
            change.files.append(FileChange(path, "deleted"))  # gone, or replaced by a folder or a link
        if new_dir or old_dir:
            _walk(ws / name if ws and new_dir else None, tpl / name if tpl and old_dir else None, f"{path}/", change,
                  budget, max_file_bytes, skip_dirs)
            if change.overflow:
                return
        if new is None or new_dir:
            continue
        if not stat.S_ISREG(new.st_mode):
            kind = "a symbolic link" if stat.S_ISLNK(new.st_mode) else "not a regular file"
            change.refused.append(Refused(path, f"{kind}: never part of a change"))
            continue
        if old is not None and stat.S_ISREG(old.st_mode) and (new.st_size, new.st_mtime_ns) == (old.st_size, old.st_mtime_ns):
            continue
        if new.st_size > max_file_bytes:
            change.refused.append(Refused(path, f"{new.st_size} bytes, over the {max_file_bytes}-byte limit per file"))
            continue
        assert ws is not None  # new is an entry of ws
        data = _read_regular(ws / name, max_file_bytes)
        if data is None:
            change.refused.append(Refused(path, "changed while it was read, or not readable"))
            continue
        executable = bool(new.st_mode & stat.S_IXUSR)
        if old is not None and stat.S_ISREG(old.st_mode):
            same_mode = executable == bool(old.st_mode & stat.S_IXUSR)
            if same_mode and tpl is not None and _read_regular(tpl / name, max_file_bytes + 1) == data:
                continue
            change.files.append(FileChange(path, "modified", data, executable))
        else:
            change.files.append(FileChange(path, "added", data, executable))


def _read_regular(path: Path, limit: int) -> bytes | None:
    """The file's bytes, opened without following a link, refusing anything but a regular file."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError:
        return None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return None
        chunks, size = [], 0
        while size <= limit:
            chunk = os.read(fd, 1 << 20)
            if not chunk:
                return b"".join(chunks)
            chunks.append(chunk)
            size += len(chunk)
        return None
    finally:
        os.close(fd)
