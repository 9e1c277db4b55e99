"""``harness=command``: any CLI, for harnesses Gyre has never heard of.

``harness.argv`` and the values of ``harness.env`` take the placeholders {prompt_file} {workspace}
{model} {base_url} {anthropic_base_url} {token}. Prefer the token from the environment
(``OPENAI_API_KEY`` / ``ANTHROPIC_API_KEY`` are always set): on argv it is readable in /proc.
"""

from __future__ import annotations

import shutil
from pathlib import Path

from workloads.api import HarnessCommand, HarnessLaunch
from workloads.config import CommandHarnessConfig
from workloads.harnesses.common import SYSTEM_PATH, expand, placeholders


class CommandHarness:
    kind = "command"

    def __init__(self, cfg: CommandHarnessConfig):
        self.cfg = cfg

    def check_installed(self) -> str:
        program = self.cfg.argv[0]
        if "{" in program:
            return ""
        found = shutil.which(program, path=SYSTEM_PATH) if "/" not in program else program
        if found is None or not Path(found).exists():
            return (f"harness=command: {program!r} is not on {SYSTEM_PATH} (give a full path in harness.argv "
                    "and its install in harness.ro_paths)")
        return ""

    def command(self, launch: HarnessLaunch) -> HarnessCommand:
        values = placeholders(launch)
        argv = [expand(a, values) for a in self.cfg.argv]
        env = {k: expand(v, values) for k, v in self.cfg.env.items()}
        return HarnessCommand(argv=argv, env=env, ro_paths=tuple(Path(p) for p in self.cfg.ro_paths))
