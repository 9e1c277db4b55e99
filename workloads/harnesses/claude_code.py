"""``harness=claude_code``: the pinned Claude Code binary, headless (notes: harness-claude-code.md).

``claude -p <prompt> --output-format text --dangerously-skip-permissions``: the final answer goes
to stdout (a grader may read it). Non-essential traffic is off (no telemetry, no preflight, and a
reproducible prompt), ``IS_SANDBOX=1`` where Gyre runs as root (Claude Code refuses skipped
permissions as root otherwise). ``bare``, ``system_prompt``, ``tools`` and ``max_turns`` shape the
agent through Claude Code's own flags; the binary is never modified.
"""

from __future__ import annotations

from pathlib import Path

from workloads.api import HarnessCommand, HarnessLaunch
from workloads.config import ClaudeCodeHarnessConfig
from workloads.harnesses.common import TOOLS_DIR, is_root, missing_binary, prompt_arg

INSTALL_DIR = TOOLS_DIR / "claude-code"
DEFAULT_BINARY = INSTALL_DIR / "node_modules" / ".bin" / "claude"


class ClaudeCodeHarness:
    kind = "claude_code"

    def __init__(self, cfg: ClaudeCodeHarnessConfig):
        self.cfg = cfg
        self.binary = Path(cfg.binary) if cfg.binary else DEFAULT_BINARY

    def check_installed(self) -> str:
        return missing_binary(self.binary, self.kind, "claude-code")

    def command(self, launch: HarnessLaunch) -> HarnessCommand:
        c = self.cfg
        argv = [str(self.binary), "-p", prompt_arg(launch), "--output-format", "text",
                "--dangerously-skip-permissions", "--model", launch.model]
        if c.bare:
            argv.append("--bare")
        if c.system_prompt:
            argv += ["--system-prompt", c.system_prompt]
        if c.tools is not None:
            argv += ["--tools", c.tools]
        if c.max_turns:
            argv += ["--max-turns", str(c.max_turns)]
        argv += list(c.extra_args)
        env = {
            "ANTHROPIC_MODEL": launch.model, "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1",
            "DISABLE_AUTOUPDATER": "1", **({"IS_SANDBOX": "1"} if is_root() else {}), **c.env,
        }
        return HarnessCommand(argv=argv, env=env, ro_paths=(self._install_root(),))

    def _install_root(self) -> Path:
        """What the sandbox must show: the npm prefix holding the binary (a hard link in its package)."""
        return INSTALL_DIR if self.binary == DEFAULT_BINARY else self.binary.resolve().parent
