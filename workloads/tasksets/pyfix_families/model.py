"""What a pyfix family is: a small correct module, its test cases, and the bugs planted in it.

The families' data lives in the sibling modules; workloads/tasksets/pyfix.py turns each
(family, bug) pair into one task. Only the standard library is imported here.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Bug:
    kind: str
    """What sort of mistake: off-by-one, wrong operator, missing case, wrong default, ..."""
    correct: str
    """Text found exactly once in the family's source."""
    buggy: str
    """What it becomes in the task's base commit."""


@dataclass(frozen=True)
class Family:
    module: str
    title: str
    source: str
    cases: dict[str, tuple[str, ...]]
    """Callable (``word_count`` or ``Stack.pop``) -> test expressions; the correct module's
    result (or exception) is what each test wants."""
    bugs: tuple[Bug, ...]
