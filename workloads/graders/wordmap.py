"""The ``wordmap`` grader: reads the task's file from a workspace and scores it against the target.

Reward: a dense similarity in [0, 1] between the file's text and the target phrase, both
normalised (lower case, whitespace collapsed, surrounding quotes/backticks and a trailing ``.`` or
``;`` dropped)::

    dense  = PREFIX_WEIGHT * prefix_dice + (1 - PREFIX_WEIGHT) * difflib_ratio
    reward = (1 - EXACT_BONUS) * dense + EXACT_BONUS * exact

``prefix_dice`` is 2 * (common prefix length) / (total length): it pays for getting the start
right, so a policy that writes the answer token by token climbs a path with few side optima;
the ratio pays for the right characters anywhere. Junk inside the text costs; an exact match
scores 1.0; an empty or missing file scores 0.

Outcomes versus failures. What the agent left behind is an outcome and gets a reward: a missing
file (it wrote nothing) is 0.0; so is text far from the target, and so is a file that is not
valid UTF-8 (undecodable bytes become U+FFFD and score as the junk they are; excluding them
would shield a policy that writes garbage from its penalty). A *grader failure* is ``reward
None`` with an error, never 0: the workspace is missing, the file cannot be read (permissions,
a directory in its place), or the grader raised. The controller excludes such an execution.

The grader reads only the workspace, so it grades a timed-out (killed) run the same way: the
bundled harness replaces the file atomically, so the file is always some complete reply.

Symlinks. The answer must be a regular file in the workspace. A symlink in its place is never
followed (it is opened with ``O_NOFOLLOW`` relative to the workspace), whether it points inside
or outside: the agent put it there, so it is an outcome and scores 0.0, like a missing file. Read
through, it would let an agent score another file (a target kept elsewhere) or make the grader
read anything on the node. A FIFO or device is opened non-blocking and never waited on.
"""

from __future__ import annotations

import difflib
import errno
import os
import re
from dataclasses import dataclass
from pathlib import Path

from workloads.tasksets.wordmap import Task

EXACT_BONUS = 0.2
"""Share of the reward paid only for an exact (normalised) match."""
PREFIX_WEIGHT = 0.5
"""Share of the dense part that is prefix agreement (the rest is the difflib ratio)."""
MAX_FILE_BYTES = 65536
"""Content past this is not read; the ratio to a short phrase is ~0 long before it."""

_SPACE = re.compile(r"\s+")
_EDGES = " `'\""


@dataclass(frozen=True)
class GradeResult:
    reward: float | None
    """In [0, 1]; None when grading failed (the execution is then excluded, never scored 0)."""
    error: str = ""


def normalise(text: str) -> str:
    text = _SPACE.sub(" ", text.lower()).strip(_EDGES)
    return text.removesuffix(";").removesuffix(".").strip(_EDGES)


def similarity(text: str, target: str) -> float:
    """The reward for ``text`` written for ``target``, in [0, 1]; 1.0 only on an exact match."""
    got, want = normalise(text), normalise(target)
    if not got or not want:
        return 1.0 if got == want else 0.0
    ratio = difflib.SequenceMatcher(None, got, want, autojunk=False).ratio()
    prefix = 2.0 * len(os.path.commonprefix([got, want])) / (len(got) + len(want))
    dense = PREFIX_WEIGHT * prefix + (1.0 - PREFIX_WEIGHT) * ratio
    return (1.0 - EXACT_BONUS) * dense + EXACT_BONUS * float(got == want)


def _read_no_follow(workspace: Path, name: str) -> bytes:
    """Up to MAX_FILE_BYTES of ``workspace/name``; ELOOP when ``name`` is a symlink."""
    dir_fd = os.open(workspace, os.O_RDONLY | os.O_DIRECTORY)
    try:
        fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK, dir_fd=dir_fd)
    finally:
        os.close(dir_fd)
    with os.fdopen(fd, "rb") as f:
        return f.read(MAX_FILE_BYTES)


def grade(task: Task, workspace: Path) -> GradeResult:
    try:
        if not workspace.is_dir():
            return GradeResult(None, f"{task.task_id}: workspace missing: {workspace}")
        try:
            data = _read_no_follow(workspace, task.file_name)
        except FileNotFoundError:
            return GradeResult(0.0)
        except OSError as exc:
            if exc.errno == errno.ELOOP:  # a symlink where the answer belongs: the agent's doing
                return GradeResult(0.0)
            return GradeResult(None, f"{task.task_id}: cannot read {task.file_name}: {exc}")
        text = data.decode("utf-8", errors="replace")
        return GradeResult(similarity(text, task.target))
    except Exception as exc:  # a grader bug must exclude the execution, not score it 0
        return GradeResult(None, f"{task.task_id}: grader raised {type(exc).__name__}: {exc}")
