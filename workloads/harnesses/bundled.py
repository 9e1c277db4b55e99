"""``harness=bundled``: Gyre's own stand-in harness (workloads/harness.py), run by the system Python.

It is one stdlib-only file, so inside a sandbox it needs only that file and ``/usr/bin/python3``,
not the project's venv. Its token comes from ``OPENAI_API_KEY``, never from argv.
"""

from __future__ import annotations

import sys
from pathlib import Path

from workloads.api import HarnessCommand, HarnessLaunch
from workloads.config import BundledHarnessConfig, ThinkTimeConfig

HARNESS_FILE = Path(__file__).resolve().parent.parent / "harness.py"
SYSTEM_PYTHON = Path("/usr/bin/python3")


class BundledHarness:
    kind = "bundled"

    def __init__(self, cfg: BundledHarnessConfig, *, think_time: ThinkTimeConfig | None = None):
        self.cfg = cfg
        self.think = think_time

    def check_installed(self) -> str:
        return ""

    def command(self, launch: HarnessLaunch) -> HarnessCommand:
        python = str(SYSTEM_PYTHON) if SYSTEM_PYTHON.exists() else sys.executable
        argv = [
            python, "-I", str(HARNESS_FILE), "--base-url", launch.base_url, "--workspace", str(launch.workspace),
            "--max-turns", str(launch.max_turns), "--max-tokens", str(launch.max_new_tokens),
            "--temperature", str(launch.temperature), "--model", launch.model,
        ]
        if self.think is not None and self.think.kind == "lognormal":  # long-tailed run lengths (bench.elastic)
            argv += ["--think-median-s", str(self.think.median_s * launch.think_scale), "--think-sigma", str(self.think.sigma),
                     "--think-max-s", str(self.think.max_s), "--think-seed", str(self.think.seed),
                     # the execution id, not the workspace's name: every workspace is ``<id>/workspace``
                     "--think-key", launch.execution_id]
        return HarnessCommand(argv=argv, env={}, ro_paths=(HARNESS_FILE,))
