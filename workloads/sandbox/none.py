"""``sandbox=none``: no confinement, only cwd, a clean environment and the launcher's limits. Logged loudly."""

from __future__ import annotations

import os
import sys

from workloads.api import SandboxSpec
from workloads.sandbox.launcher import INNER_SOURCE, inner_argv

SYSTEM_PYTHON = "/usr/bin/python3"


class NoSandbox:
    kind = "none"
    shows_fixed_paths = False

    def wrap(self, spec: SandboxSpec) -> list[str]:
        if spec.workspace_inside is not None or spec.home_inside is not None or spec.ro_binds:
            raise ValueError("sandbox=none shows every path where it is: want no *_inside paths or ro_binds")
        python = SYSTEM_PYTHON if os.access(SYSTEM_PYTHON, os.X_OK) else sys.executable
        return [*inner_argv(python, str(INNER_SOURCE), spec, nproc=False), *spec.argv]

    def describe(self) -> str:
        return ("SANDBOX OFF (sandbox=none): harnesses run as this user with every file, process and "
                "address of this node in reach (rlimits and the no-setuid filter still apply)")
