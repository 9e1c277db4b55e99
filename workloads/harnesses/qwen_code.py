"""``harness=qwen_code``: the pinned Qwen Code CLI (npm, node), headless over the OpenAI API.

``qwen <prompt> --yolo --auth-type openai`` with the proxy as its OpenAI base URL (also in
``OPENAI_BASE_URL``), usage statistics and update checks off, its settings in the execution's home.
"""

from __future__ import annotations

import json
from pathlib import Path

from workloads.api import HarnessCommand, HarnessLaunch
from workloads.config import QwenCodeHarnessConfig
from workloads.harnesses.common import TOOLS_DIR, missing_binary, prompt_arg

INSTALL_DIR = TOOLS_DIR / "qwen-code"
DEFAULT_BINARY = INSTALL_DIR / "node_modules" / ".bin" / "qwen"
# Settings Qwen Code reads from ~/.qwen/settings.json: nothing phones home from a training run.
SETTINGS = {"privacy": {"usageStatisticsEnabled": False}, "general": {"disableAutoUpdate": True},
            "telemetry": {"enabled": False}}


class QwenCodeHarness:
    kind = "qwen_code"

    def __init__(self, cfg: QwenCodeHarnessConfig):
        self.cfg = cfg
        self.binary = Path(cfg.binary) if cfg.binary else DEFAULT_BINARY

    def check_installed(self) -> str:
        return missing_binary(self.binary, self.kind, "qwen-code")

    def command(self, launch: HarnessLaunch) -> HarnessCommand:
        c = self.cfg
        settings = launch.home_on_host / ".qwen" / "settings.json"
        settings.parent.mkdir(parents=True, exist_ok=True)
        settings.write_text(json.dumps(SETTINGS))
        argv = [str(self.binary), prompt_arg(launch), "--yolo", "--auth-type", "openai",
                "--openai-base-url", launch.base_url, "--model", launch.model,
                "--max-session-turns", str(c.max_session_turns), *c.extra_args]
        env = {"OPENAI_MODEL": launch.model, **c.env}
        return HarnessCommand(argv=argv, env=env, ro_paths=(INSTALL_DIR if self.binary == DEFAULT_BINARY
                                                              else self.binary.resolve().parent,))
