"""Typed mirror of conf/workload/*.yaml, conf/harness/*.yaml and conf/sandbox/*.yaml."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from workloads.api import ResourceLimits


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
    block_steps: int
    """> 0: two task families alternate in blocks of this many steps, tool-heavy first (0: off)."""
    tool_think: float
    """Tool-heavy blocks: think time x this (long tool time, few tokens: many runs near the timeout)."""
    tool_turns: float
    """Tool-heavy blocks: turns x this."""
    token_think: float
    """Token-heavy blocks: think time x this (short runs, many tokens to train)."""
    token_turns: float
    """Token-heavy blocks: turns x this."""

    def check(self) -> None:
        if not (self.growth > 0 and self.over_steps >= 1 and self.mix_think > 0 and self.mix_turns > 0):
            raise ValueError("drift: want growth > 0, over_steps >= 1, mix_think > 0, mix_turns > 0")
        if self.block_steps < 0 or min(self.tool_think, self.tool_turns, self.token_think, self.token_turns) <= 0:
            raise ValueError("drift: want block_steps >= 0 and tool_think, tool_turns, token_think, token_turns > 0")


@dataclass(frozen=True, kw_only=True)
class GradingConfig:
    """How a task set's hidden tests grade an agent's change (workloads/graders/tests.py; what each
    setting stops is in docs/grading.md). The agent's change is the workspace's difference from the
    task's template; only what survives ``filter_change`` is applied to a fresh copy of the template."""

    runner: Literal["pytest"]
    """The test runner whose report the grader reads: pytest, through its JUnit XML. Rows whose
    test ids or test command this runner cannot read are refused when the task file loads."""
    test_paths: tuple[str, ...]
    """Patterns naming test files: the agent's changes to them are dropped (the template's copy and
    the hidden tests stand). A pattern without ``/`` matches any component of a path (a file's name
    or a folder on its way: ``tests`` drops everything under any ``tests/``); one with ``/`` matches the
    whole path from the tree's root. ``fnmatch`` syntax."""
    untrusted_paths: tuple[str, ...]
    """Patterns (as ``test_paths``) of what must not take part in a test run even outside test
    folders: runner configuration, import hooks, compiled modules, caches."""
    forbidden_refs: tuple[str, ...]
    """Regular expressions: a kept Python file whose added lines match one is dropped whole (code
    that reaches for the test runner, the interpreter's import or exit machinery, or the report)."""
    protected_modules: tuple[str, ...]
    """Top-level module names a new file must not shadow, besides the standard library's (the
    runner's own: pytest and what it imports)."""
    filter_change: bool
    """Drop what the patterns and rules above name (off only to measure what the filter stops)."""
    isolate_runner: bool
    """Run the tests with the template's runner configuration chosen by the grader, plugin
    autoload off, no user site, a fresh ``HOME`` (off only to measure what it stops)."""
    tripwire: bool
    """Add a test that must fail to the hidden tests; a report where it did not fail was tampered
    with, and scores 0."""
    canary_ttl_s: float
    """How long the canary (the untouched template's run, which must pass its PASS_TO_PASS tests) is
    trusted once it passed; a grade below 1 is only final with a canary this fresh."""
    max_file_bytes: int
    """A changed file larger than this is dropped (recorded)."""
    max_change_bytes: int
    """Kept changes past this in all: the change scores 0 (an agent-made outcome)."""
    max_change_files: int
    """Entries walked in the workspace, or files changed, past this: the change scores 0."""
    max_report_bytes: int
    """JUnit reports past this in all are refused (read as no report)."""
    environment: str
    """A read-only folder (a virtualenv or prefix) visible in every sandbox of the task set, its
    ``bin/`` first on ``PATH`` and its ``bin/python`` the tests' interpreter; '' for the system's.
    A row's own ``environment`` wins."""
    setup_network: bool
    """A row's ``setup_cmd`` (run once, in the sandbox, in the template) may use the network; a
    row's own ``setup_network`` wins."""

    def check(self) -> None:
        import re

        for pattern in self.forbidden_refs:
            try:
                re.compile(pattern)
            except re.error as exc:
                raise ValueError(f"forbidden_refs: {pattern!r}: {exc}") from None
        if self.canary_ttl_s < 0:
            raise ValueError("canary_ttl_s: want >= 0")
        for name in ("max_file_bytes", "max_change_bytes", "max_change_files", "max_report_bytes"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name}: want > 0")


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
    generate: Literal["", "pyfix", "pkgbugs"]
    """Write a bundled task set into ``data_dir`` first (deterministic, offline), then load it:
    ``pyfix`` (generated projects) or ``pkgbugs`` (bugs planted in a real package, graded by its own tests)."""
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
    grading: GradingConfig | None
    """``tests``: how hidden tests grade (null for the wordmap set, which has none)."""
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
        if self.grader == "tests" and self.grading is None:
            raise ValueError("grading: hidden-test grading needs its settings (see conf/workload/pyfix.yaml)")
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
class LimitsConfig:
    """What one execution's harness (``limits``) or one grader run (``grader_limits``) may use; 0 is
    no limit for that one. Where each is enforced: docs/sandbox.md."""

    processes: int
    """Processes and threads at once: a cgroup's ``pids.max`` where the node lets the run make
    cgroups; else RLIMIT_NPROC inside bwrap's user namespace (never for uid 0)."""
    memory_bytes: int
    """A cgroup's memory limit for the whole tree, and RLIMIT_DATA for each process."""
    cpu_time_s: int
    """RLIMIT_CPU, per process: past it the process is killed."""
    file_bytes: int
    """RLIMIT_FSIZE: no file (logs included) grows past this."""
    open_files: int
    """RLIMIT_NOFILE."""
    tmp_bytes: int
    """Size of the private ``/tmp`` and ``/dev/shm`` (bwrap; tmpfs, so it is memory)."""
    log_bytes: int
    """Harness only: stdout and stderr each; past it the run is killed and its logs cut to this."""
    disk_bytes: int
    """Harness only: its workspace and home together; past it the run is killed."""
    disk_files: int
    """Harness only: files and folders in its workspace and home; past it the run is killed."""
    disk_check_s: float
    """Harness only: how often logs, disk and files are measured."""

    def check(self) -> None:
        for name in ("processes", "memory_bytes", "cpu_time_s", "file_bytes", "open_files", "tmp_bytes", "log_bytes",
                     "disk_bytes", "disk_files"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name}: want >= 0 (0: no limit)")
        if self.disk_check_s <= 0:
            raise ValueError("disk_check_s: want > 0")

    def resources(self) -> ResourceLimits:
        return ResourceLimits(processes=self.processes, memory_bytes=self.memory_bytes, cpu_time_s=self.cpu_time_s,
                              file_bytes=self.file_bytes, open_files=self.open_files, tmp_bytes=self.tmp_bytes)


@dataclass(frozen=True, kw_only=True)
class SandboxConfig:
    kind: Literal["auto", "bwrap", "apptainer", "none"]
    """``auto``: bwrap where it runs here, else apptainer where ``image`` is set and it runs; with
    neither the run stops at start (``none`` runs unconfined, only when named)."""
    binary: str
    """'' finds ``bwrap`` / ``apptainer`` on PATH."""
    image: str
    """``apptainer``: the image (.sif or a sandbox folder); '' for the host's system as the image."""
    ro_paths: tuple[str, ...]
    """Extra read-only paths every sandboxed process sees (a shared task environment)."""
    fixed_paths: bool
    """Show every harness run its workspace at ``/workspace``, its home at ``/home/agent`` and its
    task at ``/run/gyre/prompt.md`` (``bwrap``, ``apptainer``), so a group's prompts, which name
    them, are the same and share their KV; false: each run sees its host paths (``none`` always)."""
    limits: LimitsConfig
    """Each harness run's."""
    grader_limits: LimitsConfig
    """Each grader test run's (and a task's ``setup_cmd``); the ``log``/``disk`` keys are unused."""
    cgroups: bool
    """Put each harness run and grader run in a cgroup of its own where the node lets the run make
    them (cgroup v2 delegated, as by Slurm or systemd; or writable v1 hierarchies); false: rlimits only."""
