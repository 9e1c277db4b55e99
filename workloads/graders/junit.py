"""pytest's JUnit XML reports, read defensively, and test ids mapped onto them exactly.

The report is written by the test process, which runs the agent's code, so it is untrusted input:
its size is capped, a document type or entity declaration is refused (no entity expansion), and a
report that does not parse is no report. Statuses are merged over every report of a grading (a
test command may run pytest more than once) with the worst one winning.

pytest names a test in its report by ``classname`` and ``name``, derived from the node id by
``mangle_test_address`` in ``_pytest/junitxml.py``: the node id is split at its first ``[`` (the
parameters), the part before at ``::``, the file path's ``/`` become ``.`` and its ``.py`` is
dropped; the last part with its parameters is ``name``, the rest joined by ``.`` is
``classname``. ``junit_key`` computes the same pair from a row's test id, so ids with brackets,
``::`` or spaces inside their parameters and non-ASCII characters are found exactly as pytest
wrote them, never by re-parsing its output.
"""

from __future__ import annotations

import re
import xml.etree.ElementTree as ET
from dataclasses import dataclass
from pathlib import Path

Status = str
"""``passed``, ``failed``, ``error``, ``skipped`` or ``xfailed``."""

_RANK = {"passed": 0, "xfailed": 1, "skipped": 2, "failed": 3, "error": 4}
_DECLARATION = re.compile(rb"<!\s*(DOCTYPE|ENTITY)", re.IGNORECASE)


def junit_key(test_id: str) -> tuple[str, str]:
    """(classname, name) under which pytest's JUnit report holds the node id ``test_id``."""
    path, bracket, params = test_id.partition("[")
    names = path.split("::")
    names[0] = re.sub(r"\.py$", "", names[0].replace("/", "."))
    names[-1] += bracket + params
    return ".".join(names[:-1]), names[-1]


@dataclass
class Report:
    statuses: dict[tuple[str, str], Status]
    collection_errors: list[str]
    """Files (by their dotted name) pytest could not collect."""
    problems: list[str]
    """Report files refused (too large, declarations, not XML)."""
    num_files: int = 0


def read_reports(folder: Path, *, max_bytes: int) -> Report:
    """Every ``*.xml`` in ``folder``, merged; the budget ``max_bytes`` covers them all."""
    report = Report({}, [], [])
    budget = max_bytes
    for path in sorted(folder.glob("*.xml")):
        try:
            size = path.lstat().st_size
            if not path.is_file() or path.is_symlink():
                report.problems.append(f"{path.name}: not a regular file")
                continue
            if size > budget:
                report.problems.append(f"{path.name}: {size} bytes, over the report budget")
                continue
            budget -= size
            data = path.read_bytes()
        except OSError as exc:
            report.problems.append(f"{path.name}: {exc}")
            continue
        problem = _merge(data, report)
        if problem:
            report.problems.append(f"{path.name}: {problem}")
        else:
            report.num_files += 1
    return report


def _merge(data: bytes, report: Report) -> str:
    if _DECLARATION.search(data):
        return "holds a DOCTYPE or ENTITY declaration"
    try:
        root = ET.fromstring(data)
    except ET.ParseError as exc:
        return f"not XML: {exc}"
    cases = list(root.iter("testcase"))
    for case in cases:
        classname, name = case.get("classname", ""), case.get("name", "")
        status = _status(case)
        if not classname and status == "error":  # pytest's record of a file it could not collect
            report.collection_errors.append(name)
        key = (classname, name)
        old = report.statuses.get(key)
        if old is None or _RANK[status] > _RANK[old]:
            report.statuses[key] = status
    return ""


def _status(case: ET.Element) -> Status:
    tags = {child.tag: child for child in case}
    if "error" in tags:
        return "error"
    if "failure" in tags:
        return "failed"
    if "skipped" in tags:
        return "xfailed" if tags["skipped"].get("type") == "pytest.xfail" else "skipped"
    return "passed"
