"""Harness adapters: what each starts, with what environment, and the one line when it is missing."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from workloads.api import HarnessLaunch
from workloads.config import (
    BundledHarnessConfig, ClaudeCodeHarnessConfig, CommandHarnessConfig, MiniSweAgentHarnessConfig,
    QwenCodeHarnessConfig, ThinkTimeConfig,
)
from workloads.harnesses import make_harness
from workloads.harnesses.common import common_env, expand

TOKEN = "gyre.s0-g0-e0.0." + "ab" * 32


def launch(tmp_path: Path) -> HarnessLaunch:
    (tmp_path / "ws").mkdir(exist_ok=True)
    (tmp_path / "home").mkdir(exist_ok=True)
    prompt = tmp_path / "prompt.md"
    prompt.write_text("Fix the failing test in calc.py.")
    return HarnessLaunch(
        execution_id="s0-g0-e0", workspace=tmp_path / "ws", prompt_file=prompt, home=tmp_path / "home",
        model="gyre-policy", base_url="http://127.0.0.1:8123/v1", anthropic_base_url="http://127.0.0.1:8123",
        token=TOKEN, max_turns=2, max_new_tokens=16, temperature=1.0,
    )


def test_every_harness_gets_the_proxy_token_and_prompt_file_in_its_environment(tmp_path):
    env = common_env(launch(tmp_path))
    assert env["OPENAI_BASE_URL"] == "http://127.0.0.1:8123/v1" and env["ANTHROPIC_BASE_URL"] == "http://127.0.0.1:8123"
    assert env["OPENAI_API_KEY"] == env["ANTHROPIC_API_KEY"] == TOKEN
    assert env["GYRE_PROMPT_FILE"] == str(tmp_path / "prompt.md") and env["HOME"] == str(tmp_path / "home")


@pytest.mark.parametrize("cfg", [
    BundledHarnessConfig(kind="bundled"),
    ClaudeCodeHarnessConfig(kind="claude_code", binary="", bare=True, system_prompt="Be brief.", tools="",
                            max_turns=3, extra_args=(), env={}),
    MiniSweAgentHarnessConfig(kind="mini_swe_agent", binary="", step_limit=5, extra_args=(), env={}),
    QwenCodeHarnessConfig(kind="qwen_code", binary="", max_session_turns=5, extra_args=(), env={}),
], ids=lambda c: c.kind)
def test_no_token_on_argv(tmp_path, cfg):
    """argv is readable by every local user in /proc; the token is only ever in the environment."""
    cmd = make_harness(cfg).command(launch(tmp_path))
    assert not any(TOKEN in a for a in cmd.argv)
    assert cmd.ro_paths, "the sandbox must be told what install the program needs"


def test_claude_code_is_headless_offline_and_shaped_by_its_own_flags(tmp_path):
    cfg = ClaudeCodeHarnessConfig(kind="claude_code", binary="", bare=True, system_prompt="Be brief.", tools="",
                                  max_turns=3, extra_args=("--verbose",), env={"X": "1"})
    cmd = make_harness(cfg).command(launch(tmp_path))
    argv = cmd.argv
    assert argv[1:3] == ["-p", "Fix the failing test in calc.py."] and "--dangerously-skip-permissions" in argv
    assert argv[argv.index("--tools") + 1] == "" and argv[argv.index("--system-prompt") + 1] == "Be brief."
    assert "--bare" in argv and argv[argv.index("--max-turns") + 1] == "3" and argv[-1] == "--verbose"
    assert cmd.env["CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC"] == "1" and cmd.env["X"] == "1"
    default = make_harness(ClaudeCodeHarnessConfig(kind="claude_code", binary="", bare=False, system_prompt="",
                                                   tools=None, max_turns=0, extra_args=(), env={}))
    assert "--tools" not in default.command(launch(tmp_path)).argv  # null keeps Claude Code's own tools


def test_bundled_harness_runs_one_file_with_the_system_python_and_its_think_time(tmp_path):
    think = ThinkTimeConfig(kind="lognormal", median_s=2.0, sigma=1.0, max_s=9.0, seed=3)
    cmd = make_harness(BundledHarnessConfig(kind="bundled"), think_time=think).command(launch(tmp_path))
    assert cmd.argv[1] == "-I" and cmd.argv[2].endswith("workloads/harness.py")
    assert cmd.ro_paths == (Path(cmd.argv[2]),)
    assert cmd.argv[cmd.argv.index("--think-max-s") + 1] == "9.0"
    # keyed by the execution id: every workspace folder is named "workspace"
    assert cmd.argv[cmd.argv.index("--think-key") + 1] == "s0-g0-e0"


def test_command_harness_expands_placeholders(tmp_path):
    cfg = CommandHarnessConfig(kind="command", argv=("/bin/sh", "-c", "agent --task {prompt_file} --in {workspace}"),
                               env={"MY_URL": "{base_url}", "MY_MODEL": "{model}"}, ro_paths=("/opt/agent",))
    cmd = make_harness(cfg).command(launch(tmp_path))
    assert cmd.argv[2] == f"agent --task {tmp_path / 'prompt.md'} --in {tmp_path / 'ws'}"
    assert cmd.env == {"MY_URL": "http://127.0.0.1:8123/v1", "MY_MODEL": "gyre-policy"}
    assert cmd.ro_paths == (Path("/opt/agent"),)


def test_an_unknown_placeholder_is_an_error_not_passed_through():
    with pytest.raises(ValueError, match="unknown placeholder {tokne}"):
        expand("--key {tokne}", {"token": "t"})


@pytest.mark.parametrize("cfg,target", [
    (ClaudeCodeHarnessConfig(kind="claude_code", binary="/nonexistent/claude", bare=False, system_prompt="",
                             tools=None, max_turns=0, extra_args=(), env={}), "make claude-code"),
    (MiniSweAgentHarnessConfig(kind="mini_swe_agent", binary="/nonexistent/mini", step_limit=5, extra_args=(),
                               env={}), "make mini-swe-agent"),
    (QwenCodeHarnessConfig(kind="qwen_code", binary="/nonexistent/qwen", max_session_turns=5, extra_args=(),
                           env={}), "make qwen-code"),
], ids=lambda c: getattr(c, "kind", ""))
def test_a_missing_binary_says_which_make_target_installs_it(cfg, target):
    line = make_harness(cfg).check_installed()
    assert target in line and "\n" not in line


def test_the_pinned_installs_are_found():
    """make test installs all three (Makefile): an adapter that cannot find them would fail every run."""
    for cfg in (ClaudeCodeHarnessConfig(kind="claude_code", binary="", bare=False, system_prompt="", tools=None,
                                        max_turns=0, extra_args=(), env={}),
                MiniSweAgentHarnessConfig(kind="mini_swe_agent", binary="", step_limit=5, extra_args=(), env={}),
                QwenCodeHarnessConfig(kind="qwen_code", binary="", max_session_turns=5, extra_args=(), env={})):
        problem = make_harness(cfg).check_installed()
        if problem and os.environ.get("CI") != "true":
            pytest.skip(f"make test-fast installs no harness: {problem}")
        assert problem == ""


def test_command_harness_program_must_exist():
    cfg = CommandHarnessConfig(kind="command", argv=("no-such-agent-binary",), env={}, ro_paths=())
    assert "no-such-agent-binary" in make_harness(cfg).check_installed()
