"""Harness adapters: how to start one harness program for one execution (conf/harness).

An adapter only says which program to run, with which arguments, environment and read-only
install paths; it never parses the model's output (everything the model does reaches Gyre through
the proxy). Adding a harness is one module here and one YAML in conf/harness/.
"""

from __future__ import annotations

from workloads.api import HarnessAdapter
from workloads.config import HarnessConfig
from workloads.harnesses.bundled import BundledHarness
from workloads.harnesses.claude_code import ClaudeCodeHarness
from workloads.harnesses.command import CommandHarness
from workloads.harnesses.mini_swe_agent import MiniSweAgentHarness
from workloads.harnesses.qwen_code import QwenCodeHarness

_ADAPTERS = {
    "bundled": BundledHarness, "claude_code": ClaudeCodeHarness, "mini_swe_agent": MiniSweAgentHarness,
    "qwen_code": QwenCodeHarness, "command": CommandHarness,
}


def make_harness(cfg: HarnessConfig, **workload_knobs) -> HarnessAdapter:
    """The adapter for ``cfg.kind``. ``workload_knobs`` (think time) only reach the bundled harness."""
    if cfg.kind == "bundled":
        return BundledHarness(cfg, **workload_knobs)
    return _ADAPTERS[cfg.kind](cfg)
