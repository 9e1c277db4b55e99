"""Which checkpoint: the controller owns the policy (when to save, what to resume from); the core
cell owns the tensors and writes them (cellrunner.checkpoint).

Layout, shared with the writer: ``<run>/checkpoints/v<N>/`` with ``checkpoint.json`` written last,
after the tensors, into a temporary folder renamed into place; a ``v<N>`` folder without it is
an interrupted write and never counts. Directory listing (and deleting old ones): no tensors here.
"""

from __future__ import annotations

import re
import shutil
from dataclasses import dataclass
from pathlib import Path

META_FILE = "checkpoint.json"
_VERSION_DIR = re.compile(r"^v(\d+)$")


@dataclass(frozen=True, slots=True)
class Checkpoint:
    version: int
    path: Path


def latest_checkpoint(checkpoint_dir: str | Path) -> Checkpoint | None:
    """The newest complete checkpoint under ``checkpoint_dir``, or None."""
    root = Path(checkpoint_dir)
    if not root.is_dir():
        return None
    found = []
    for child in root.iterdir():
        m = _VERSION_DIR.match(child.name)
        if m and (child / META_FILE).is_file():
            found.append(Checkpoint(int(m.group(1)), child))
    return max(found, key=lambda c: c.version, default=None)


def prune(checkpoint_dir: str | Path, keep: int) -> list[int]:
    """Delete all but the newest ``keep`` complete checkpoints, and interrupted writes older than
    the newest complete one; return the versions deleted. ``keep`` 0 deletes nothing."""
    latest = latest_checkpoint(checkpoint_dir)
    if keep <= 0 or latest is None:
        return []
    complete, stale = [], []
    for child in Path(checkpoint_dir).iterdir():
        m = _VERSION_DIR.match(child.name)
        if not m:
            continue
        version = int(m.group(1))
        if (child / META_FILE).is_file():
            complete.append((version, child))
        elif version < latest.version:
            stale.append((version, child))
    complete.sort(reverse=True)
    gone = complete[keep:] + stale
    for _, path in gone:
        shutil.rmtree(path, ignore_errors=True)
    return sorted(v for v, _ in gone)


def due(version: int, every: int) -> bool:
    """Save after the step that produced ``version``? (``every`` 0: only at the end of the run.)"""
    return every > 0 and version % every == 0
