"""Typed mirror of conf/workload/*.yaml, conf/harness/*.yaml and conf/sandbox/*.yaml."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal


@dataclass(frozen=True, kw_only=True)
class ThinkTimeConfig:
    """Tool time the bundled harness spends after each model call, so runs have the long-tailed
    lengths of real agent runs (``kind: none`` leaves the harness as fast as it can go)."""

    kind: Literal["none", "lognormal"]
    median_s: float
    """Median of a run's total think time."""
    sigma: float
    """Log-normal shape: 1.0 puts about 1 run in 20 past 5x the median."""
    max_s: float
    """A run's total think time is capped here (set it past ``timeout_s`` to have runs time out)."""
    seed: int
    """A run's think time is a function of (seed, execution id): the same in every policy's run."""

    def check(self) -> None:
        if self.median_s <= 0 or self.sigma < 0 or self.max_s <= 0:
            raise ValueError("think_time: want median_s > 0, sigma >= 0, max_s > 0")


@dataclass(frozen=True, kw_only=True)
class DriftConfig:
    """Runs that change shape as training goes (workloads/drift.py): 1.0 and -1 leave them fixed."""

    growth: float
    """Turns and think time at step ``over_steps - 1``, as a multiple of step 0's (geometric between)."""
    over_steps: int
    mix_step: int
    """From this step on the task mix changes (-1: never)."""
    mix_think: float
    """... think time x this (tool-heavier tasks: > 1)."""
    mix_turns: float
    """... turns x this."""

    def check(self) -> None:
        if not (self.growth > 0 and self.over_steps >= 1 and self.mix_think > 0 and self.mix_turns > 0):
            raise ValueError("drift: want growth > 0, over_steps >= 1, mix_think > 0, mix_turns > 0")


@dataclass(frozen=True, kw_only=True)
class WorkloadConfig:
    name: str
    """The task set's name (``wordmap``, ``pyfix``, or a user's own)."""
    kind: Literal["wordmap", "swe"]
    """``wordmap``: the bundled one-turn set; ``swe``: SWE-style JSONL rows (workloads/tasksets/swe.py)."""
    task_file: str
    """``swe``: the JSONL task file ('' with ``generate``: the generated set's file)."""
    eval_task_file: str
    """``swe``: held-out tasks ('' holds out ``num_eval_tasks`` rows of ``task_file``, seeded)."""
    generate: Literal["", "pyfix"]
    """Write a bundled task set into ``data_dir`` first (deterministic, offline), then load it."""
    data_dir: str
    """Generated task sets and per-task workspace templates are kept here (shared by runs)."""
    grader: Literal["wordmap", "tests"]
    """``wordmap``: similarity of the answer to the target; ``tests``: the task's hidden tests."""
    answer_from: Literal["file", "stdout"]
    """``wordmap``: the answer is the task's named file, or the harness's final stdout line(s)."""
    reward: Literal["binary", "fraction"]
    """``tests``: 1 when every FAIL_TO_PASS and PASS_TO_PASS test passes, else 0; or the fraction passed."""
    grader_timeout_s: float
    """Hidden tests past this are killed: a grader failure (excluded), never reward 0."""
    num_train_tasks: int
    num_eval_tasks: int
    groups_per_step: int
    group_size: int
    """Executions of one task per GSPO group (16 on clusters; fewer in the embedded default)."""
    min_usable_per_group: int
    """A group with fewer gradable executions is dropped whole, and counted."""
    max_turns: int
    max_new_tokens: int
    timeout_s: float
    """A harness run past this is killed and graded from its workspace (partial grading)."""
    task_seed: int
    think_time: ThinkTimeConfig
    drift: DriftConfig
    harness_nice: int = 10
    """How far below the controller's CPU priority harness processes run (``nice`` steps), so a burst of harness start-ups (a step's
    group launched at once) cannot starve the controller, proxy and cells sharing the node's
    cores; 0 keeps the controller's priority."""

    def check(self) -> None:
        if self.kind == "swe" and not (self.task_file or self.generate):
            raise ValueError("task_file: a swe workload needs a JSONL task file (or generate: pyfix)")
        if self.kind == "wordmap" and self.grader != "wordmap":
            raise ValueError("grader: the wordmap task set is graded by the wordmap grader")
        if self.kind == "swe" and self.grader != "tests":
            raise ValueError("grader: swe tasks are graded by their hidden tests (grader: tests)")
        if self.grader_timeout_s <= 0:
            raise ValueError("grader_timeout_s: want > 0")
        if not 0 <= self.harness_nice <= 19:
            raise ValueError("harness_nice: want 0..19")
        if self.group_size < 2:
            raise ValueError("group_size: want >= 2 (advantages are normalised within a group)")
        if not 1 <= self.min_usable_per_group <= self.group_size:
            raise ValueError("min_usable_per_group: want 1..group_size")


# ---------------------------------------------------------------- harnesses (conf/harness/*.yaml)


@dataclass(frozen=True, kw_only=True)
class BundledHarnessConfig:
    """Gyre's own stand-in harness (workloads/harness.py): one file-writing agent over HTTP."""

    kind: Literal["bundled"]


@dataclass(frozen=True, kw_only=True)
class ClaudeCodeHarnessConfig:
    kind: Literal["claude_code"]
    binary: str
    """'' for the pinned install of ``make claude-code`` (.tools/claude-code)."""
    bare: bool
    """``--bare``: no CLAUDE.md, plugins, memory or attribution; a short system prompt and Bash/Edit/Read."""
    system_prompt: str
    """'' keeps Claude Code's own; else ``--system-prompt`` (shapes the agent, the binary unchanged)."""
    tools: str | None
    """null keeps Claude Code's tools; else ``--tools`` (e.g. ``Bash,Read,Edit``, or ``""`` for none)."""
    max_turns: int
    """``--max-turns`` (0: Claude Code's own limit)."""
    extra_args: tuple[str, ...]
    env: dict[str, str]


@dataclass(frozen=True, kw_only=True)
class MiniSweAgentHarnessConfig:
    kind: Literal["mini_swe_agent"]
    binary: str
    """'' for the pinned install of ``make mini-swe-agent`` (.tools/mini-swe-agent)."""
    step_limit: int
    extra_args: tuple[str, ...]
    env: dict[str, str]


@dataclass(frozen=True, kw_only=True)
class QwenCodeHarnessConfig:
    kind: Literal["qwen_code"]
    binary: str
    """'' for the pinned install of ``make qwen-code`` (.tools/qwen-code)."""
    max_session_turns: int
    extra_args: tuple[str, ...]
    env: dict[str, str]


@dataclass(frozen=True, kw_only=True)
class CommandHarnessConfig:
    """Any CLI. Placeholders in ``argv`` and ``env`` values: {prompt_file} {workspace} {model}
    {base_url} {anthropic_base_url} {token}."""

    kind: Literal["command"]
    argv: tuple[str, ...]
    env: dict[str, str]
    ro_paths: tuple[str, ...]
    """What the program needs to see read-only inside the sandbox (its install), besides the system."""

    def check(self) -> None:
        if not self.argv:
            raise ValueError("argv: want the command to run, e.g. ['my-agent', '--task', '{prompt_file}']")


HarnessConfig = (BundledHarnessConfig | ClaudeCodeHarnessConfig | MiniSweAgentHarnessConfig | QwenCodeHarnessConfig
                 | CommandHarnessConfig)


# ---------------------------------------------------------------- sandboxes (conf/sandbox/*.yaml)


@dataclass(frozen=True, kw_only=True)
class SandboxConfig:
    kind: Literal["auto", "bwrap", "apptainer", "none"]
    """``auto``: bwrap where it runs here, else ``none`` (said loudly in the log)."""
    binary: str
    """'' finds ``bwrap`` / ``apptainer`` on PATH."""
    image: str
    """``apptainer``: the image (.sif or a sandbox folder); '' for the host's system as the image."""
    ro_paths: tuple[str, ...]
    """Extra read-only paths every sandboxed process sees (a shared task environment)."""
