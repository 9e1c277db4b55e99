"""What is measured and cleaned in the folders an agent wrote, from outside its sandbox.

- ``measure``: bytes and entries under a few folders, walked without following links and stopping
  at a bound, so a tree of a million files costs a bounded walk (the execution manager kills a run
  past its ``disk_bytes`` / ``disk_files``: no per-user disk quota exists on most nodes);
- ``strip_special_bits``: clears setuid, setgid and sticky bits everywhere under a folder. The
  sandbox's seccomp filter and ``nosuid`` binds are the first two layers; this third one means even
  a bit that got through never stays on a file of the run folder (which is 0700 besides);
- ``cut_log``: a harness log past its limit is cut back to its first bytes, with a line saying so.
"""

from __future__ import annotations

import os
import stat
from dataclasses import dataclass
from pathlib import Path

SPECIAL_BITS = stat.S_ISUID | stat.S_ISGID | stat.S_ISVTX


@dataclass(frozen=True)
class Usage:
    num_bytes: int
    num_entries: int
    complete: bool
    """False when the walk stopped at ``max_entries``."""


def measure(folders: list[Path], *, max_entries: int) -> Usage:
    """Allocated bytes (``st_blocks``, so sparse files count as what they use) and entries."""
    total_bytes, entries = 0, 0
    stack = [f for f in folders if f.is_dir()]
    while stack:
        folder = stack.pop()
        try:
            with os.scandir(folder) as it:
                for entry in it:
                    entries += 1
                    if entries > max_entries:
                        return Usage(total_bytes, entries, False)
                    try:
                        st = entry.stat(follow_symlinks=False)
                    except OSError:
                        continue
                    total_bytes += st.st_blocks * 512
                    if stat.S_ISDIR(st.st_mode):
                        stack.append(Path(entry.path))
        except OSError:
            continue
    return Usage(total_bytes, entries, True)


def strip_special_bits(folder: Path) -> list[str]:
    """Clear setuid/setgid/sticky bits under ``folder`` (links never followed); the paths changed."""
    changed: list[str] = []
    if not folder.is_dir():
        return changed
    for root, dirs, files in os.walk(folder, followlinks=False):
        for name in dirs + files:
            path = os.path.join(root, name)
            try:
                st = os.lstat(path)
                if stat.S_ISLNK(st.st_mode) or not st.st_mode & SPECIAL_BITS:
                    continue
                fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
                try:
                    os.fchmod(fd, stat.S_IMODE(os.fstat(fd).st_mode) & ~SPECIAL_BITS)
                finally:
                    os.close(fd)
                changed.append(os.path.relpath(path, folder))
            except OSError:
                continue
    return changed


def cut_log(path: Path, max_bytes: int) -> bool:
    """Cut ``path`` to its first ``max_bytes`` plus one line saying how much was dropped; whether it was cut."""
    try:
        size = path.stat().st_size
    except OSError:
        return False
    if size <= max_bytes:
        return False
    with open(path, "r+b") as f:
        f.truncate(max_bytes)
        f.seek(max_bytes)
        f.write(f"\n[gyre: cut at {max_bytes} bytes of {size}: the run passed sandbox.limits.log_bytes]\n".encode())
    return True
