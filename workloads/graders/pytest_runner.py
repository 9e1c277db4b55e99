"""The grader's pytest entry point, run inside the grader's sandbox instead of ``python -m pytest``.

    PYTHON -s -B pytest_runner.py SETTINGS.json [pytest arguments...]

Standard library and the interpreter's own pytest only; no Gyre import (this file is copied into a
read-only folder of the grading and run by the task's interpreter). The grader's ``python``,
``python3``, ``pytest`` and ``py.test`` on ``PATH`` lead here, so a task's own plain ``test_cmd``
(``python -m pytest -q tests/``) runs the way the grader chooses:

- pytest (and everything it imports at start) is imported while ``sys.path`` holds only the
  interpreter's own folders: a ``pytest.py``, ``_pytest/`` or ``pluggy/`` in the tree under test
  cannot stand in for it. Only then is the current folder put first on ``sys.path``, as
  ``python -m pytest`` does, so the tests import the code under test;
- the JUnit report goes to the grading's report folder, one file per pytest process;
- with ``isolate`` the runner configuration is the one the grader chose (``-c``, the template's own),
  the root folder is the tree's, and the cache plugin is off (``PYTEST_DISABLE_PLUGIN_AUTOLOAD`` and
  ``PYTHONNOUSERSITE`` come from the grader's environment).

What it cannot do: the code under test runs in this process, after this file, so it could still
change pytest from inside. The grader's tripwire test catches a run whose results were rewritten
wholesale (workloads/graders/tests.py).
"""

import json
import os
import sys


def main(argv: list[str]) -> int:
    with open(argv[0], encoding="utf-8") as f:
        settings = json.load(f)
    del sys.path[0]  # this file's folder: nothing of the tree, nothing to import from
    import pytest  # noqa: PLC0415 - before the tree is importable, on purpose

    sys.path.insert(0, os.getcwd())
    os.environ.pop("PYTEST_ADDOPTS", None)  # the same options, explicitly, below
    report = os.path.join(settings["report_dir"], f"junit-{os.getpid()}.xml")
    extra = [f"--junitxml={report}", "-p", "no:cacheprovider"]
    if settings["isolate"]:
        extra += ["-c", settings["ini"], f"--rootdir={settings['rootdir']}"]
    return int(pytest.main([*argv[1:], *extra]))


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
